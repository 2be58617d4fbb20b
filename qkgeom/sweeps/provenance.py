"""Where a trial attempt ran, and on what: qkgeom's code, the git checkout, the versions
of Python, torch, Ray and CUDA, the host and the device.

:func:`provenance` is measured in the process that trains (a sweep's Ray worker, or
``qkgeom train``): on a cluster the driver's versions (CPU torch on the head) need not be
a worker's. It is stored per attempt in ``trial_attempts`` (docs/schema.md). Nothing here
imports torch or Ray: versions come from the installed packages' metadata, CUDA's from
torch only when the process has already imported it.
"""

from __future__ import annotations

import functools
import platform
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

# the paths qkgeom's content hash covers (qkgeom.sweeps.ship): a change there is "dirty"
SOURCE_PATHS = ("qkgeom", "migrations", "pyproject.toml")
FIELDS = ("code_version", "git_commit", "git_dirty", "python", "torch", "ray", "cuda",
          "host", "device")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def git_state(root: Path | None) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the checkout at ``root``; ``(None, None)`` when it is not
    one (an installed wheel) or git is missing. Dirty: uncommitted changes, tracked or
    not, under the paths qkgeom's content hash covers (:data:`SOURCE_PATHS`)."""
    if root is None or not (root / ".git").exists():
        return None, None

    def git(*args: str) -> str | None:
        try:
            p = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                               text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return p.stdout if p.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = git("status", "--porcelain", "--", *SOURCE_PATHS)
    return commit.strip(), None if status is None else bool(status.strip())


@functools.lru_cache(maxsize=1)
def _static() -> dict[str, Any]:
    """The part that cannot change while the process runs (computed once: git is slow)."""
    from qkgeom.sweeps.ship import code_version, source_root

    commit, dirty = git_state(source_root())
    if commit is None:  # an installed wheel: the checkout a shipped one was built from
        try:
            from qkgeom._shipped import GIT_COMMIT, GIT_DIRTY
        except ImportError:
            pass
        else:
            commit, dirty = GIT_COMMIT, GIT_DIRTY
    return {"code_version": code_version(), "git_commit": commit, "git_dirty": dirty,
            "python": platform.python_version(), "torch": _version("torch"),
            "ray": _version("ray"), "host": socket.gethostname()}


def provenance(device: str | None = None, **details: Any) -> dict[str, Any]:
    """This process's provenance: the :data:`FIELDS` (``device`` as given, e.g.
    ``cuda gpu=0``; ``cuda`` is the CUDA version torch was built with, None for a CPU
    build or when torch is not imported) and ``details`` (``platform``, the GPU's name
    when ``device`` is a CUDA one, and the keyword arguments: a Ray node id, ...)."""
    out = dict(_static(), device=device, cuda=None)
    torch = sys.modules.get("torch")
    extra: dict[str, Any] = {"platform": platform.platform()}
    if torch is not None:
        out["cuda"] = getattr(torch.version, "cuda", None)
        if device and device.startswith("cuda"):
            try:
                extra["gpu"] = torch.cuda.get_device_name(0)
            except Exception:  # no usable device after all; the trial says so itself
                pass
    out["details"] = {**extra, **details}
    return out


def code_provenance() -> dict[str, Any]:
    """The fields every process of a sweep shares (the code): what the driver records
    when an attempt starts, before the worker's own :func:`provenance` arrives."""
    return {k: _static()[k] for k in ("code_version", "git_commit", "git_dirty")}
