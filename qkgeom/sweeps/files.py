"""A sweep's files: where its Tune experiments live, and removing a sweep with everything
it wrote (``qkgeom sweep delete``).

A sweep writes into its Tune storage (``--storage``: a path, or a URI such as ``s3://...``
or ``file://...``; recorded in the stored spec under :data:`STORAGE_KEY`) one experiment
directory per phase: ``qkgeom-NAME`` and, for arms with baseline-relative targets,
``qkgeom-NAME-arms``, ``qkgeom-NAME-arms-2``, ... Its resume checkpoints and weight
snapshots are recorded in the ``checkpoints`` table, as paths or URIs, usually inside
those directories (``qkgeom train --db`` records its own run directory's).

No Ray here: paths and URIs alike are read and deleted through ``pyarrow.fs``, as Tune
and :class:`qkgeom.sweeps.callbacks.DbWriter` do.

Pitfall settled here: names are prefixes of one another (``qkgeom-a-arms`` is both sweep
``a``'s arm experiment and sweep ``a-arms``'s main one), and two sweeps may share a
storage. A path is removed only when no other sweep of the database could own it: not one
of their experiment directories, no checkpoint of theirs at, above or below it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkgeom.errors import QkgeomError

if TYPE_CHECKING:
    from qkgeom.store import Store

EXPERIMENT_PREFIX = "qkgeom-"
STORAGE_KEY = "_ray_storage"  # in the stored spec: the Tune storage of the sweep's run


# ---------------------------------------------------------------------- names and paths
def default_storage() -> str:
    return os.environ.get("QKGEOM_RAY_STORAGE") or str(Path.home() / "ray_results")


def join_storage(storage: str, name: str) -> str:
    """``storage/name`` for a path or a URI (``Path`` would turn ``s3://b`` into ``s3:/b``)."""
    if "://" in storage:
        base, _, query = storage.partition("?")
        return base.rstrip("/") + "/" + name + (f"?{query}" if query else "")
    return str(Path(storage).expanduser() / name)


def experiment_path(name: str, storage: str | None = None) -> str:
    return join_storage(storage or default_storage(), f"{EXPERIMENT_PREFIX}{name}")


def arm_experiments(name: str) -> Iterator[str]:
    """Names for the arm phase's Tune experiments of sweep ``name``: ``qkgeom-NAME-arms``,
    then ``-arms-2``, ``-arms-3``, ... (a later resume adds one for arms that could not
    run before)."""
    base = f"{EXPERIMENT_PREFIX}{name}-arms"
    yield base
    k = 2
    while True:
        yield f"{base}-{k}"
        k += 1


def is_experiment_of(dirname: str, name: str) -> bool:
    """Whether a directory called ``dirname`` in a storage is one of sweep ``name``'s
    experiments (``qkgeom-NAME``, ``qkgeom-NAME-arms``, ``qkgeom-NAME-arms-N``)."""
    pattern = rf"{re.escape(EXPERIMENT_PREFIX + name)}(-arms(-[2-9]|-[1-9][0-9]+)?)?"
    return re.fullmatch(pattern, dirname) is not None


def plain_spec(spec: dict | None) -> dict | None:
    """A stored spec without the run bookkeeping (:data:`STORAGE_KEY`)."""
    if spec is None:
        return None
    return {k: v for k, v in spec.items() if k != STORAGE_KEY}


# ---------------------------------------------------------------------- filesystems
def open_location(loc: str) -> tuple[Any, str]:
    """``(pyarrow filesystem, path on it)`` of a recorded location: a URI, else a path."""
    import pyarrow.fs as pafs

    if "://" in loc:
        try:
            return pafs.FileSystem.from_uri(loc)
        except Exception as e:  # unknown scheme, missing credentials, bad bucket name
            raise QkgeomError(f"cannot open {loc}: {str(e).strip().splitlines()[0]}; "
                              "check the storage's credentials and rerun") from None
    return pafs.LocalFileSystem(), str(Path(loc).expanduser().resolve())


def _key(loc: str) -> tuple[str, str]:
    """A comparable identity of a location, without opening its filesystem: the scheme
    (``local`` for paths and ``file://``) and the path, no query, no trailing slash."""
    if "://" in loc:
        scheme, _, rest = loc.partition("://")
        rest = rest.partition("?")[0].rstrip("/")
        return ("local", rest) if scheme == "file" else (scheme, rest)
    return "local", str(Path(loc).expanduser().resolve()).rstrip("/")


def _inside(a: tuple[str, str], b: tuple[str, str]) -> bool:
    """Whether location ``a`` is ``b`` or lies inside it."""
    return a[0] == b[0] and (a[1] == b[1] or a[1].startswith(b[1] + "/"))


def _size(fs: Any, path: str) -> int | None:
    """Bytes under ``path`` (a file or a directory); None when it does not exist."""
    import pyarrow.fs as pafs

    info = fs.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        return None
    if info.type != pafs.FileType.Directory:
        return int(info.size or 0)
    found = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
    return sum(int(f.size or 0) for f in found if f.type == pafs.FileType.File)


def _experiment_dirs(storage: str, name: str) -> list[str]:
    """The locations of sweep ``name``'s experiment directories that exist in ``storage``."""
    import pyarrow.fs as pafs

    fs, root = open_location(storage)
    try:
        found = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except OSError as e:
        raise QkgeomError(f"cannot list the Ray storage {storage}: "
                          f"{str(e).strip().splitlines()[0]}") from None
    names = sorted(f.base_name for f in found if f.type == pafs.FileType.Directory
                   and is_experiment_of(f.base_name, name))
    return [join_storage(storage, n) for n in names]


# ---------------------------------------------------------------------- deleting a sweep
@dataclass
class SweepRemoval:
    """What deleting sweep ``name`` removes: its rows (table -> count) and its files."""

    name: str
    db: str  # the database, password hidden
    rows: dict[str, int]
    storage: str | None  # the recorded Tune storage (None: not recorded, no experiment dirs)
    paths: list[tuple[str, int]] = field(default_factory=list)  # (location, bytes) to remove
    kept: list[tuple[str, str]] = field(default_factory=list)  # (location, why not removed)
    gone: int = 0  # recorded checkpoint locations that no longer exist
    running: list[str] = field(default_factory=list)  # trials the database holds as running
    live: list[str] = field(default_factory=list)  # ... of them with a fresh heartbeat

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.paths)

    def check_stopped(self) -> None:
        """Refuse to delete a sweep whose driver still sends heartbeats."""
        if self.live:
            raise QkgeomError(
                f"sweep {self.name} is running ({len(self.live)} trial(s) with a recent "
                f"heartbeat, e.g. {self.live[0]}); stop its driver first (Ctrl-C), then "
                f"delete it")


def plan_removal(store: Store, name: str) -> SweepRemoval:
    """Everything of sweep ``name`` that :func:`remove_sweep` would delete; changes nothing.

    The files: the sweep's experiment directories in its recorded storage, and every
    checkpoint location of its trials that lies outside them. A path another sweep of
    the database could own is kept (listed with the reason, see the module doc). Running
    trials with a fresh heartbeat (:mod:`qkgeom.store.lifecycle`) are ``live``: their sweep
    is not deleted while its driver runs.
    """
    import json

    from qkgeom.store.lifecycle import no_heartbeat_s

    store.require_sweep(name)
    frame = store.sweeps()
    sweeps = {r["name"]: json.loads(r["spec"]) for r in frame.iter_rows(named=True)}
    every = dict(zip(frame["name"], frame["heartbeat_s"]))[name]
    storage = (sweeps[name] or {}).get(STORAGE_KEY)
    locations = store.checkpoint_locations()
    running = store.trials(name).filter(status="running")
    plan = SweepRemoval(name=name, db=store.safe_url, rows=store.sweep_row_counts(name),
                        storage=storage, running=sorted(running["trial_key"]))
    plan.live = sorted(t["trial_key"] for t in running.iter_rows(named=True)
                       if every is not None and no_heartbeat_s(
                           "running", t["heartbeat_at"], t["started_at"], every) is None)
    theirs = [(s, _key(loc)) for s, loc in locations if s != name]
    storages = {s: _key(spec[STORAGE_KEY]) for s, spec in sweeps.items()
                if s != name and (spec or {}).get(STORAGE_KEY)}

    def owner(loc: str, key: tuple[str, str], experiment: bool) -> str | None:
        """Why another sweep could own ``loc``, or None."""
        if experiment:
            base = key[1].rsplit("/", 1)[-1]
            for s, k in storages.items():
                if k == _key(storage) and is_experiment_of(base, s):
                    return f"also an experiment directory of sweep {s}"
        for s, k in theirs:
            if _inside(k, key) or _inside(key, k):
                return f"holds or lies in a checkpoint of sweep {s}"
        return None

    dirs: list[tuple[str, tuple[str, str]]] = []
    for loc in _experiment_dirs(storage, name) if storage else []:
        why = owner(loc, _key(loc), True)
        if why is None:
            dirs.append((loc, _key(loc)))
        else:
            plan.kept.append((loc, why))
    candidates = list(dirs)
    for loc in sorted({loc for s, loc in locations if s == name}):
        key = _key(loc)
        if any(_inside(key, d) for _, d in dirs):
            continue  # removed with its experiment directory
        why = owner(loc, key, False)
        if why is None:
            candidates.append((loc, key))
        else:
            plan.kept.append((loc, why))
    for loc, _ in candidates:
        size = _size(*open_location(loc))
        if size is None:
            plan.gone += 1
        else:
            plan.paths.append((loc, size))
    return plan


def remove_sweep(store: Store, plan: SweepRemoval) -> dict[str, int]:
    """Delete the files of ``plan`` (:func:`plan_removal`), then the sweep's rows.

    Files first: if one cannot be deleted the rows stay, so the same command can run
    again once the cause is fixed (paths already gone are skipped). Returns the rows
    deleted per table.
    """
    import pyarrow.fs as pafs

    plan.check_stopped()
    for loc, _ in plan.paths:
        fs, path = open_location(loc)
        try:
            kind = fs.get_file_info(path).type
            if kind == pafs.FileType.Directory:
                fs.delete_dir(path)
            elif kind != pafs.FileType.NotFound:
                fs.delete_file(path)
        except OSError as e:
            raise QkgeomError(f"cannot delete {loc}: {str(e).strip().splitlines()[0]}; the "
                              f"sweep's rows are kept: fix that and run qkgeom sweep delete "
                              f"--name {plan.name} again") from None
    return store.delete_sweep(plan.name)
