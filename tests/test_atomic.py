"""qkgeom.atomic: a write lands whole or not at all, with a plain file's mode and bytes."""

from __future__ import annotations

import os
import stat

import pytest

from qkgeom.atomic import atomic_path, umasked


def mode(p) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_a_file_replaces_the_old_one_with_a_plain_files_mode(tmp_path):
    target = tmp_path / "x.json"
    target.write_text("old")
    plain = tmp_path / "plain"
    plain.write_text("")
    with atomic_path(target) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith("x.json.tmp")
        tmp.write_text("new")
        assert target.read_text() == "old"  # nothing visible before the rename
    assert target.read_text() == "new"
    assert mode(target) == mode(plain) == umasked(0o666)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "x.json"]


def test_an_error_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "x.json"
    target.write_text("old")
    with pytest.raises(KeyError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise KeyError("boom")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_a_directory_replaces_a_left_over_one(tmp_path):
    target = tmp_path / "enc"
    target.mkdir()
    (target / "stale.npy").write_text("from a crash")
    with atomic_path(target, directory=True) as tmp:
        assert tmp.is_dir() and not any(tmp.iterdir())
        (tmp / "meta.json").write_text("{}")
    assert [p.name for p in target.iterdir()] == ["meta.json"]
    assert mode(target) == umasked(0o777)
    assert [p.name for p in tmp_path.iterdir()] == ["enc"]
    with pytest.raises(OSError), atomic_path(tmp_path / "other", directory=True) as tmp:
        (tmp / "part").write_text("x")
        raise OSError("disk full")
    assert [p.name for p in tmp_path.iterdir()] == ["enc"]


def test_a_torch_checkpoint_has_the_bytes_of_the_earlier_tmp_then_rename(tmp_path):
    # checkpoints were written to state.pt.tmp and renamed: torch names the records in its
    # zip after that file, so the same object must give the same bytes through the helper
    torch = pytest.importorskip("torch")
    import zipfile

    obj = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 7}
    old = tmp_path / "old"
    old.mkdir()
    torch.save(obj, old / "state.pt.tmp")
    (old / "state.pt.tmp").replace(old / "state.pt")
    new = tmp_path / "new"
    new.mkdir()
    with atomic_path(new / "state.pt") as tmp:
        torch.save(obj, tmp)
    assert (new / "state.pt").read_bytes() == (old / "state.pt").read_bytes()
    assert zipfile.ZipFile(new / "state.pt").namelist()[0].startswith("state.pt/")
