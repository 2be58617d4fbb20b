"""Atomic writes: write under a unique name beside the target, then rename it into place.

A reader (another process, a resume after a crash) sees the old file or the new one, never
half of one: ``os.replace`` is atomic within one filesystem, which is why the temporary name
sits in the target's own directory. The result has the mode a plain ``open()`` or
``mkdir()`` would give it (``mkstemp`` and ``mkdtemp`` make theirs 0600 and 0700).

The temporary name is ``<name>.tmp<random>``, no dot after ``<name>.``: ``torch.save`` names
the records inside its zip after the file it writes up to the last dot, so a checkpoint
written through ``state.pt.tmpXXXX`` holds the ``state.pt/`` records, byte for byte the file
checkpoints have always been.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: str | os.PathLike, *, directory: bool = False) -> Iterator[Path]:
    """A fresh temporary path beside ``path`` to write: an empty file, or an empty directory
    when ``directory``. On a clean exit it takes ``path``'s place in one rename (a directory
    already at ``path`` is removed first: a rename cannot replace one that holds files); on
    an exception it is removed and ``path`` stays as it was. ``path``'s parent must exist.

        with atomic_path(d / "state.pt") as tmp:
            torch.save(state, tmp)
    """
    path = Path(path)
    prefix = f"{path.name}.tmp"
    if directory:
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=prefix))
    else:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=prefix)
        os.close(fd)
        tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, umasked(0o777 if directory else 0o666))
        if directory and path.is_dir():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        raise


def umasked(mode: int) -> int:
    """``mode`` as the process umask would give it to a new file or directory."""
    um = os.umask(0)
    os.umask(um)
    return mode & ~um
