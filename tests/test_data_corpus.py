"""The encoded-corpus cache: concurrent first use, identical encoding, cheap cached opens.

The reference encoding is today's (before issue 16) plain-Python one: the vocabulary is
``sorted(set(train))``, ids come from a dict lookup, unseen characters are 0, and the key is
sha256 over the three split texts' sha256 digests (first 20 hex characters).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from qkgeom.engine import data
from qkgeom.engine.data import DataError, load_corpus

ROOT = Path(__file__).resolve().parents[1]


def reference(train: str, val: str, test: str) -> dict:
    """Today's encoding of three split texts, in plain Python."""
    chars = sorted(set(train))
    lut = {c: i + 1 for i, c in enumerate(chars)}
    out: dict = {"chars": chars}
    h = hashlib.sha256()
    for name, text in (("train", train), ("val", val), ("test", test)):
        h.update(hashlib.sha256(text.encode()).digest())
        ids = np.array([lut.get(c, 0) for c in text], dtype=np.uint16)
        buf = io.BytesIO()
        np.save(buf, ids)
        out[name] = buf.getvalue()  # the .npy bytes np.save writes
        out[name + "_ids"] = ids
    out["key"] = h.hexdigest()[:20]
    return out


def split_file(text: str) -> tuple[str, str, str]:
    n = len(text)
    a, b = int(n * 0.90), int(n * 0.95)
    return text[:a], text[a:b], text[b:]


def assert_matches(c, ref: dict) -> None:
    assert c.key == ref["key"]
    assert c.chars == ref["chars"]
    d = data.cache_dir() / "encoded" / c.key
    for s in ("train", "val", "test"):
        assert (d / f"{s}.npy").read_bytes() == ref[s], s


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    c = tmp_path / "cache"
    monkeypatch.setenv("QKGEOM_CACHE", str(c))
    return c


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8")


# ---------------------------------------------------------------- (b) same encoding
def test_wikitext_directory_encodes_as_before(cache, wikitext_dir):
    valid, test = read(wikitext_dir / "wiki.valid.raw"), read(wikitext_dir / "wiki.test.raw")
    c = load_corpus(str(wikitext_dir))
    assert_matches(c, reference(valid, test, test))
    assert (np.asarray(c.test) == 0).sum() > 0  # the test text has characters unseen in valid


def test_wikitext_single_file_encodes_as_before(cache, wikitext_dir, monkeypatch):
    text = read(wikitext_dir / "wiki.test.raw")
    ref = reference(*split_file(text))
    monkeypatch.setattr(data, "_BLOCK", 100_003)  # block edges fall inside the splits
    assert_matches(load_corpus(str(wikitext_dir / "wiki.test.raw")), ref)


@pytest.mark.parametrize("block", [1, 2, 3, 7, 1 << 21])
def test_unseen_multibyte_astral_and_newlines(cache, tmp_path, monkeypatch, block):
    # \r\n and lone \r become \n (read_text's universal newlines), also across block edges;
    # 2-, 3- and 4-byte UTF-8 characters; the val/test parts hold characters unseen in train
    train = "ab\r\ncé\u00e9\u4e2d\U0001f600 z\rq\r\r\n" * 6 + "\ufeffend\r"
    tail = "x\U0001f601\u4e2e\r\nab\u0300" * 2 + "\r"
    f = tmp_path / "t.txt"
    f.write_bytes((train + tail).encode("utf-8"))
    monkeypatch.setattr(data, "_BLOCK", block)
    text = read(f)
    assert "\r" not in text and "\U0001f601" in text
    ref = reference(*split_file(text))
    c = load_corpus(str(f))
    assert_matches(c, ref)
    _, val, test = split_file(text)
    unseen = set(val + test) - set(split_file(text)[0])
    assert unseen and (np.asarray(c.test) == 0).sum() == sum(test.count(ch) for ch in unseen)


def test_directory_with_train_split_and_bad_input(cache, tmp_path, monkeypatch):
    d = tmp_path / "wt"
    d.mkdir()
    texts = {"train": "the cat\r\nsat \u00e9\n" * 50, "valid": "a dog \U0001f436\n" * 9,
             "test": "zebra\u00e9\n" * 7}
    for s, t in texts.items():
        (d / f"wiki.{s}.raw").write_text(t, encoding="utf-8")
    monkeypatch.setattr(data, "_BLOCK", 5)
    texts = {s: read(d / f"wiki.{s}.raw") for s in texts}
    c = load_corpus(str(d))
    assert_matches(c, reference(texts["train"], texts["valid"], texts["test"]))
    assert c.note.startswith("train/valid/test")
    (tmp_path / "bad.txt").write_bytes(b"abc\xff\xfe" * 10)
    with pytest.raises(DataError, match="not UTF-8"):
        load_corpus(str(tmp_path / "bad.txt"))
    (tmp_path / "blank.txt").write_text(" \n\t " * 100)
    with pytest.raises(DataError, match="training text .* is empty"):
        load_corpus(str(tmp_path / "blank.txt"))


# ---------------------------------------------------------------- (c)/(d) cached opens
class ReadSpy:
    """Counts reads of raw text (the real reader still runs)."""

    def __init__(self, monkeypatch):
        self.n, real = 0, data._blocks

        def blocks(path):
            self.n += 1
            return real(path)

        monkeypatch.setattr(data, "_blocks", blocks)


def stamp(p: Path) -> tuple[int, int]:
    st = p.stat()
    return st.st_ino, st.st_mtime_ns


def test_cached_open_reads_no_text_and_changes_are_seen(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_RACY_NS", 0)  # see the racy test below
    f = tmp_path / "t.txt"
    f.write_text("hello world, " * 400, encoding="utf-8")
    spy = ReadSpy(monkeypatch)
    a = load_corpus(str(f))
    assert spy.n > 0
    (rec,) = (cache / "sources").glob("*.json")
    npy = cache / "encoded" / a.key / "train.npy"
    rec0, npy0 = stamp(rec), stamp(npy)

    # an untouched file: the record is used as is, no text is read
    spy.n = 0
    b = load_corpus(str(f))
    assert spy.n == 0 and stamp(rec) == rec0 and b.key == a.key
    assert isinstance(b.train, np.memmap)

    # a new mtime, same content: hashed again (record rewritten), not encoded again
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))
    c = load_corpus(str(f))
    assert spy.n > 0 and stamp(rec) != rec0 and stamp(npy) == npy0 and c.key == a.key
    assert len(list((cache / "encoded").iterdir())) == 1

    # (d) new content of the same size: a new key and a new encoding of the new text
    new = "HELLO WORLD; " * 400
    f.write_text(new, encoding="utf-8")
    d = load_corpus(str(f))
    assert d.key != a.key
    assert_matches(d, reference(*split_file(new)))
    assert stamp(npy) == npy0  # the old encoding stays (another source may share it)


def test_identical_texts_share_the_encoding(cache, tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_RACY_NS", 0)
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("same text here. " * 300, encoding="utf-8")
    a, b = load_corpus(str(tmp_path / "a.txt")), load_corpus(str(tmp_path / "b.txt"))
    assert a.key == b.key and "a.txt" in a.note and "b.txt" in b.note
    assert len(list((cache / "encoded").iterdir())) == 1
    assert len(list((cache / "sources").glob("*.json"))) == 2


def test_a_just_written_file_is_hashed_again(cache, tmp_path, monkeypatch):
    # a file modified within _RACY_NS of its hashing could change again without a new
    # size/mtime/ctime (coarse timestamps): its record is not trusted on the next open
    f = tmp_path / "t.txt"
    f.write_text("fresh text " * 300, encoding="utf-8")
    load_corpus(str(f))
    (rec,) = (cache / "sources").glob("*.json")
    assert json.loads(rec.read_text())["racy"] is True
    spy = ReadSpy(monkeypatch)
    load_corpus(str(f))
    assert spy.n > 0


def test_cache_directory_left_incomplete_is_redone(cache, wikitext_dir):
    c = load_corpus(str(wikitext_dir))
    d = cache / "encoded" / c.key
    (d / "meta.json").unlink()  # as a crash of the old code left it
    (d / "train.npy").write_bytes(b"garbage")
    c2 = load_corpus(str(wikitext_dir))
    valid, test = read(wikitext_dir / "wiki.valid.raw"), read(wikitext_dir / "wiki.test.raw")
    assert_matches(c2, reference(valid, test, test))


# ---------------------------------------------------------------- (a) many processes
WORKER = r"""
import hashlib, json, sys, time
from pathlib import Path
import numpy as np
from qkgeom.engine.data import load_corpus
Path(sys.argv[2] + f".ready{sys.argv[3]}").touch()
while not Path(sys.argv[2]).exists():
    time.sleep(0.002)
c = load_corpus(sys.argv[1])
out = {s: hashlib.sha256(np.asarray(getattr(c, s)).tobytes()).hexdigest()
       for s in ("train", "val", "test")}
print(json.dumps(dict(out, key=c.key, chars=c.chars)))
"""


def run_at_once(source: str, tmp_path: Path, n: int = 6, pythonpath: str = "") -> list[dict]:
    env = dict(os.environ, QKGEOM_CACHE=str(tmp_path / "cache"),
               PYTHONPATH=os.pathsep.join(p for p in (pythonpath, str(ROOT),
                                                     os.environ.get("PYTHONPATH", "")) if p))
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, source, str(go), str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("go.ready*"))) < n and time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.01)
    go.touch()  # all imported: start them together
    outs = [p.communicate(timeout=300) for p in procs]
    errors = [err[-2000:] for (_, err), p in zip(outs, procs) if p.returncode != 0]
    assert not errors, errors[0]
    return [json.loads(o.strip().splitlines()[-1]) for o, _ in outs]


def summary(ref: dict) -> dict:
    out = {s: hashlib.sha256(ref[s + "_ids"].tobytes()).hexdigest()
           for s in ("train", "val", "test")}
    return dict(out, key=ref["key"], chars=ref["chars"])


def assert_clean_cache(cache: Path) -> None:
    (enc,) = (cache / "encoded").iterdir()  # one encoding, no temporary directory left
    assert not enc.name.startswith(".")
    assert sorted(p.name for p in enc.iterdir()) == ["meta.json", "test.npy", "train.npy",
                                                      "val.npy"]
    assert [p.name for p in (cache / "sources").iterdir() if p.name.startswith(".")] == []


def test_six_processes_single_file(tmp_path, wikitext_dir):
    text = read(wikitext_dir / "wiki.valid.raw") + read(wikitext_dir / "wiki.test.raw")
    f = tmp_path / "corpus.txt"
    f.write_text(text, encoding="utf-8")
    res = run_at_once(str(f), tmp_path)
    ref = summary(reference(*split_file(read(f))))
    assert all(r == ref for r in res)
    assert_clean_cache(tmp_path / "cache")


def test_six_processes_wiki_directory(tmp_path, wikitext_dir):
    d = tmp_path / "wt"
    d.mkdir()
    valid, test = read(wikitext_dir / "wiki.valid.raw"), read(wikitext_dir / "wiki.test.raw")
    (d / "wiki.train.raw").write_text((valid + test), encoding="utf-8")
    (d / "wiki.valid.raw").write_text(valid, encoding="utf-8")
    (d / "wiki.test.raw").write_text(test, encoding="utf-8")
    res = run_at_once(str(d), tmp_path)
    ref = summary(reference((valid + test), valid, test))
    assert all(r == ref for r in res)
    assert_clean_cache(tmp_path / "cache")


# The real download needs the network. This stand-in for the `datasets` package serves
# three splits and counts its calls, so that the test sees how many processes download.
FAKE_DATASETS = r'''
import os, time
def load_dataset(path, name):
    assert path == "Salesforce/wikitext" and name == "wikitext-2-raw-v1"
    with open(os.environ["FAKE_DATASETS_LOG"], "a") as fh:
        fh.write(f"{os.getpid()}\n")
    time.sleep(0.5)  # a slow download widens the window for a race
    rows = lambda s: [f" = {s} = \n", "", f" Some {s} text \u00e9 .\n"] * 2000
    return {s: {"text": rows(s)} for s in ("train", "validation", "test")}
'''


def test_six_processes_download_once(tmp_path, monkeypatch):
    stub = tmp_path / "stub"
    (stub / "datasets").mkdir(parents=True)
    (stub / "datasets" / "__init__.py").write_text(FAKE_DATASETS)
    log = tmp_path / "downloads.log"
    monkeypatch.setenv("FAKE_DATASETS_LOG", str(log))
    res = run_at_once("wikitext-2", tmp_path, pythonpath=str(stub))
    assert len(log.read_text().split()) == 1  # one process downloaded
    out = tmp_path / "cache" / "wikitext-2"
    assert sorted(p.name for p in out.iterdir()) == ["wiki.test.raw", "wiki.train.raw",
                                                      "wiki.valid.raw"]

    def raw(s):
        return "".join(r if r else " \n" for r in
                       [f" = {s} = \n", "", f" Some {s} text \u00e9 .\n"] * 2000)

    assert read(out / "wiki.valid.raw") == raw("validation")
    ref = summary(reference(raw("train"), raw("validation"), raw("test")))
    assert all(r == ref for r in res)
