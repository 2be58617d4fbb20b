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
    # absolute, symlinks not followed: a link is judged (and removed) as the link
    return pafs.LocalFileSystem(), os.path.normpath(os.path.abspath(os.path.expanduser(loc)))


def _key(loc: str) -> tuple[str, str]:
    """A comparable identity of a location, without opening its filesystem: the scheme
    (``local`` for paths and ``file://``) and the path, no query, no trailing slash."""
    if "://" in loc:
        scheme, _, rest = loc.partition("://")
        rest = rest.partition("?")[0].rstrip("/")
        return ("local", rest) if scheme == "file" else (scheme, rest)
    return "local", os.path.normpath(os.path.abspath(os.path.expanduser(loc))).rstrip("/")


def _inside(a: tuple[str, str], b: tuple[str, str]) -> bool:
    """Whether location ``a`` is ``b`` or lies inside it."""
    return a[0] == b[0] and (a[1] == b[1] or a[1].startswith(b[1] + "/"))


def _size(fs: Any, path: str) -> int | None:
    """Bytes under ``path`` (a file or a directory); None when it does not exist."""
    import pyarrow.fs as pafs

    if isinstance(fs, pafs.LocalFileSystem) and os.path.islink(path):
        return 0  # the link goes, not what it points at
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


# ---------------------------------------------------------------------- ownership stamps
OWNER_STAMP = ".qkgeom-owner.json"  # in each directory qkgeom creates for a sweep
# the names qkgeom gives saved state (Tune's checkpoint_NNNNNN, qkgeom's step_NNNNNNN):
# an unstamped location outside the sweep's experiment directories must be one of them
STATE_NAME = re.compile(r"(checkpoint_\d+|step_\d+)")


def stamp_directory(loc: str, identity: str | None, sweep: str) -> None:
    """Write ``loc/.qkgeom-owner.json`` naming the database ``identity`` and ``sweep``
    (the directory is created if needed); an existing stamp is left as it is. Best effort:
    a storage that refuses the write leaves the directory unstamped."""
    import json

    if identity is None:
        return
    try:
        fs, path = open_location(loc)
        fs.create_dir(path, recursive=True)
        stamp = f"{path}/{OWNER_STAMP}"
        import pyarrow.fs as pafs

        if fs.get_file_info(stamp).type != pafs.FileType.NotFound:
            return
        with fs.open_output_stream(stamp) as out:
            out.write(json.dumps({"database": identity, "sweep": sweep}).encode())
    except (OSError, QkgeomError):
        pass


def read_stamp(fs: Any, path: str) -> dict | None:
    """The ownership stamp in directory ``path`` (None when there is none or it is not
    one qkgeom wrote)."""
    import json

    try:
        with fs.open_input_stream(f"{path}/{OWNER_STAMP}") as f:
            got = json.loads(f.read(4096).decode())
    except (OSError, ValueError):
        return None
    return got if isinstance(got, dict) and "database" in got else None


def _nearest_stamp(loc: str) -> tuple[str, dict] | None:
    """The stamp of ``loc`` or of its nearest ancestor directory, with where it is."""
    fs, path = open_location(loc)
    while path and path not in ("/", "."):
        got = read_stamp(fs, path)
        if got is not None:
            return path, got
        parent = path.rsplit("/", 1)[0]
        if parent == path:
            break
        path = parent
    return None


# ---------------------------------------------------------------------- guards
def _local(loc: str) -> str | None:
    """The absolute local path of a location, symlinks not followed (None: not local)."""
    if "://" in loc:
        scheme, _, rest = loc.partition("://")
        return os.path.normpath(rest.partition("?")[0]) if scheme == "file" else None
    return os.path.normpath(os.path.abspath(os.path.expanduser(loc)))


def _contains(outer: str, inner: str) -> bool:
    """Whether path ``inner`` is ``outer`` or lies below it (both absolute, normalised)."""
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def protected_reason(loc: str, keep: dict[str, str]) -> str | None:
    """Why ``loc`` must never be deleted, or None: it is, or contains, the working
    directory, HOME, a filesystem root, or one of ``keep`` (path -> what it is, e.g. the
    storage root or another sweep's directory); compared as given and with symlinks
    resolved, so neither spelling slips past."""
    path = _local(loc)
    if path is None:
        return None
    guards = {os.getcwd(): "the working directory", str(Path.home()): "HOME"}
    guards.update(keep)
    spellings = {path}
    try:
        spellings.add(os.path.realpath(path))
    except OSError:
        pass
    for p in spellings:
        if p == "/" or os.path.dirname(p) == p or os.path.ismount(p):
            return "a filesystem root or mount point"
        for g, what in guards.items():
            for gs in {os.path.normpath(g), os.path.realpath(g)}:
                if _contains(p, gs):
                    return f"is or contains {what} ({gs})"
    return None


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
    live: list[str] = field(default_factory=list)  # why the sweep may be running now
    origin: str | None = None  # the database whose files they are, when not this one

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.paths)

    def check_stopped(self, live: list[str] | None = None) -> None:
        """Refuse to delete a sweep that may still run (``live``: the reasons, as
        :func:`qkgeom.store.liveness.sweep_liveness` gives them; default the plan's)."""
        live = self.live if live is None else live
        if live:
            leased = "holds the lease" in live[0]  # LiveSweep.describe of a live lease
            raise QkgeomError(
                f"sweep {self.name} may be running: {live[0]}; stop its driver first "
                "(Ctrl-C), then delete it" + ("" if leased else
                                              "; if you know it has stopped and nothing "
                                              "could prove it, give --stopped"))


def plan_removal(store: Store, name: str, *, stopped: bool = False) -> SweepRemoval:
    """Everything of sweep ``name`` that :func:`remove_sweep` would delete; changes nothing
    (``store`` may be read-only).

    A file is removed only when it is provably the sweep's: its experiment directories in
    its recorded storage, and its recorded checkpoint locations outside them when they lie
    in a directory stamped for this sweep by this database (``.qkgeom-owner.json``) or,
    unstamped, carry qkgeom's own names (``checkpoint_N``, ``step_N``). Never a path that
    is or contains the working directory, HOME, a filesystem root, the storage root or
    another sweep's storage or directory; never a path another sweep of the database
    could own; never the files of a sweep merged from another database (``sweeps.origin``).
    A symlink is removed as a link, its target never. ``live``: why the sweep may still
    run (:func:`qkgeom.store.liveness.sweep_liveness`); ``stopped`` drops the reasons that
    cannot be proved either way (no heartbeat interval, a stale lease elsewhere).
    """
    import json

    from qkgeom.store.lease import database_identity
    from qkgeom.store.liveness import sweep_liveness

    sid = store.require_sweep(name)
    frame = store.sweeps()
    sweeps = {r["name"]: json.loads(r["spec"]) for r in frame.iter_rows(named=True)}
    storage = (sweeps[name] or {}).get(STORAGE_KEY)
    locations = store.checkpoint_locations()
    trials = store.trials(name)
    running = trials.filter(status="running")
    plan = SweepRemoval(name=name, db=store.safe_url, rows=store.sweep_row_counts(name),
                        storage=storage, running=sorted(running["trial_key"]))
    plan.live = _live(sweep_liveness(store, name), stopped)
    owner = _Ownership.of(name, sweeps, locations, here=database_identity(store),
                          origin=_origin(store, sid),
                          trial_keys=tuple(trials["trial_key"].to_list()))
    foreign = owner.foreign
    if foreign:
        plan.origin = owner.origin

    dirs: list[tuple[str, tuple[str, str]]] = []
    not_ours: list[str] = []  # experiment directories of another database (merged, stamped)
    for loc in _experiment_dirs(storage, name) if storage else []:
        why = owner.why_not(loc, _key(loc), True)
        if why is None:
            dirs.append((loc, _key(loc)))
        else:
            plan.kept.append((loc, why))
            if foreign or OWNER_STAMP in why:
                not_ours.append(loc)
    candidates = list(dirs)
    for loc in sorted({loc for s, loc in locations if s == name}):
        key = _key(loc)
        if any(_inside(key, d) for _, d in dirs):
            continue  # removed with its experiment directory
        if any(_inside(key, _key(k)) for k in not_ours):
            continue  # in a directory that is not this database's: listed with it
        why = owner.why_not(loc, key, False)
        if why is None:
            candidates.append((loc, key))
        elif _exists_at(loc):
            plan.kept.append((loc, why))
        else:
            plan.gone += 1
    for loc, _ in candidates:
        size = _size(*open_location(loc))
        if size is None:
            plan.gone += 1
        else:
            plan.paths.append((loc, size))
    return plan


@dataclass
class _Ownership:
    """What decides whether a location is sweep ``name``'s to delete (see
    :func:`plan_removal`): this database's identity and the sweep's origin, its storage,
    the other sweeps' storages and checkpoints, and the paths never to delete."""

    name: str
    here: str | None
    origin: str | None
    storage: str | None
    storages: dict[str, tuple[str, str]]  # other sweep -> the key of its storage
    theirs: list[tuple[str, tuple[str, str]]]  # (other sweep, key of a checkpoint of it)
    keep: dict[str, str]  # local path -> what it is (never deleted, nor what contains it)
    trial_keys: tuple[str, ...] = ()  # the sweep's trials (Tune names their directories)

    @classmethod
    def of(cls, name: str, sweeps: dict[str, dict | None],
           locations: list[tuple[str, str]], *, here: str | None,
           origin: str | None, trial_keys: tuple[str, ...] = ()) -> _Ownership:
        storage = (sweeps[name] or {}).get(STORAGE_KEY)
        theirs = [(s, _key(loc)) for s, loc in locations if s != name]
        storages = {s: _key(spec[STORAGE_KEY]) for s, spec in sweeps.items()
                    if s != name and (spec or {}).get(STORAGE_KEY)}
        keep: dict[str, str] = {}
        if storage and _local(storage):
            keep[_local(storage)] = "the sweep's Ray storage root"
        for s, k in storages.items():
            if k[0] == "local":
                keep[k[1]] = f"the Ray storage of sweep {s}"
        for s, k in theirs:
            if k[0] == "local":
                keep.setdefault(k[1], f"a checkpoint of sweep {s}")
        return cls(name, here, origin, storage, storages, theirs, keep, trial_keys)

    @property
    def foreign(self) -> bool:
        """The sweep was merged from another database: its files are that one's."""
        return self.origin is not None and self.here is not None and self.origin != self.here

    def why_not(self, loc: str, key: tuple[str, str], experiment: bool) -> str | None:
        """Why ``loc`` is not provably this sweep's to delete (None: it is)."""
        if self.foreign:
            return (f"the sweep was merged from database {self.origin}: its files are that "
                    f"database's; delete the sweep there to remove them")
        if experiment:
            base = key[1].rsplit("/", 1)[-1]
            for s, k in self.storages.items():
                if k == _key(self.storage) and is_experiment_of(base, s):
                    return f"also an experiment directory of sweep {s}"
        for s, k in self.theirs:
            if _inside(k, key) or _inside(key, k):
                return f"holds or lies in a checkpoint of sweep {s}"
        why = protected_reason(loc, self.keep)
        if why is not None:
            return why
        stamp = _nearest_stamp(loc)
        if stamp is not None:
            where, got = stamp
            if got.get("database") != self.here or got.get("sweep") != self.name:
                return (f"{where}/{OWNER_STAMP} says it belongs to sweep "
                        f"{got.get('sweep')!r} of database {got.get('database')}")
        elif not experiment and not self.unstamped_but_ours(key[1]):
            return ("not a directory qkgeom made for this sweep (no ownership stamp, not "
                    "named like a checkpoint of it)")
        return None

    def unstamped_but_ours(self, path: str) -> bool:
        """An unstamped location outside the experiment directories: only of a sweep
        recorded before stamps existed (no ``origin``; every later one stamps what it
        makes), and only where qkgeom writes saved state: ``.../checkpoints/step_N``
        (``qkgeom train --db``), ``.../snapshots/step_N`` or ``<trial dir>/checkpoint_N``
        of one of the sweep's trials."""
        if self.origin is not None:
            return False
        parts = path.rstrip("/").split("/")
        if len(parts) < 3 or not STATE_NAME.fullmatch(parts[-1]):
            return False
        parent = parts[-2]
        if parts[-1].startswith("step_"):
            return parent in ("checkpoints", "snapshots")
        return any(parent.startswith(f"{k}_") for k in self.trial_keys)


def _live(live: Any, stopped: bool) -> list[str]:
    """Why the sweep may run (:class:`qkgeom.store.liveness.LiveSweep`), as the plan lists
    it; ``stopped`` (the user knows its driver is gone) drops what cannot be proved either
    way, never a live lease."""
    if live is None or (stopped and not live.provable):
        return []
    return [live.describe()]


def _origin(store: Store, sweep_id: int) -> str | None:
    from sqlalchemy import select

    from qkgeom.store.models import Sweep

    s = Sweep.__table__
    with store._read() as conn:
        return conn.execute(select(s.c.origin).where(s.c.id == sweep_id)).scalar()


def _exists_at(loc: str) -> bool:
    try:
        path = _local(loc)
        if path is not None:
            return os.path.lexists(path)
        return _size(*open_location(loc)) is not None
    except (OSError, QkgeomError):
        return False


def _delete(loc: str) -> None:
    """Remove one location: a symlink as a link (never its target), a local directory
    with :func:`shutil.rmtree` (which unlinks the links inside it without following
    them), a remote one through its pyarrow filesystem."""
    import shutil

    path = _local(loc)
    if path is not None:
        if os.path.islink(path) or os.path.isfile(path):
            os.unlink(path)
        elif os.path.isdir(path):
            shutil.rmtree(path)
        return
    import pyarrow.fs as pafs

    fs, p = open_location(loc)
    kind = fs.get_file_info(p).type
    if kind == pafs.FileType.Directory:
        fs.delete_dir(p)
    elif kind != pafs.FileType.NotFound:
        fs.delete_file(p)


def remove_sweep(url: str, plan: SweepRemoval, *, stopped: bool = False) -> dict[str, int]:
    """Delete the files of ``plan`` (:func:`plan_removal`), then the sweep's rows, all
    inside one write transaction of the database at ``url`` that first checks again that
    nothing runs the sweep and that its rows are still those the plan listed (a sweep
    started or resumed while the prompt waited is refused).

    Files first: if one cannot be deleted the rows stay, so the same command can run
    again once the cause is fixed (paths already gone are skipped). Returns the rows
    deleted per table.
    """
    from qkgeom.store import open_store
    from qkgeom.store.liveness import sweep_liveness

    plan.check_stopped()
    with open_store(url, create=False) as store, store._write() as conn:
        store.lock_sweep(conn, plan.name)
        plan.check_stopped(_live(sweep_liveness(store, plan.name, conn), stopped))
        now = store.sweep_row_counts(plan.name, conn=conn)
        if now != plan.rows:
            raise QkgeomError(f"sweep {plan.name} changed since it was listed (rows then "
                              f"{plan.rows}, now {now}); nothing was deleted: run qkgeom "
                              f"sweep delete --name {plan.name} again")
        for loc, _ in plan.paths:
            try:
                _delete(loc)
            except OSError as e:
                raise QkgeomError(
                    f"cannot delete {loc}: {str(e).strip().splitlines()[0]}; the sweep's "
                    f"rows are kept: fix that and run qkgeom sweep delete --name {plan.name} "
                    "again") from None
        return store.delete_sweep(plan.name, conn=conn)
