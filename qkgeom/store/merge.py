"""``qkgeom db merge``: copy sweeps from one results database into another.

A study's cells often run on different machines or at different times, each into its own
SQLite file; comparing them in one report, or in one SQL query, needs them in one database.
:func:`merge_sweeps` copies whole sweeps, with every row of their trials (attempts, probes,
metric values, training history, checkpoint locations), from a source database (SQLite or
PostgreSQL, opened read-only) into a target one:

* rows are copied as stored; only the surrogate keys change (the target gives the sweep and
  its trials new ids, and every ``trial_id`` follows them), and a sweep may be renamed on
  the way (``--rename OLD=NEW``);
* every sweep is checked before anything is written: a name already in the target, a
  trial still ``running`` in the source (its rows are still arriving), or source and target
  being the same database (SQLite: the same file, also through a hard or symbolic link)
  are refused with what to do;
* a SQLite target that holds a live sweep (:func:`qkgeom.store.liveness.live_sweeps`) is
  refused, checked before and again inside the write transaction: the merge holds
  SQLite's only write lock for its whole copy, and the sweep's driver would have to wait
  it out (it does, :meth:`qkgeom.store.base.StoreBase._write`; ``beside_running`` merges
  anyway). A PostgreSQL merge takes no lock that a sweep's writes need (it inserts the
  rows of new sweeps only) and runs beside live sweeps;
* everything is written in one target transaction, and the copied row counts are compared
  with the source's inside it, so a merge lands whole or not at all.

The source is never changed: SQLite files are read without a byte of them changing
(:func:`qkgeom.store.engine.connect_sqlite_readonly`), and a source at an older schema
revision is read through a temporary copy (SQLite's backup API: consistent even while
the source is written) upgraded to this qkgeom's schema. A PostgreSQL source at an older
revision is refused with the ways to copy it first.

Checkpoint locations are paths on the machine that ran the sweep: a merged sweep is read
(report, stats, query, serve) where it lands, and resumed where it ran.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from qkgeom.errors import QkgeomError
from qkgeom.names import check_sweep_name
from qkgeom.store.engine import backend_of, resolve_url, safe_url, sqlite_path
from qkgeom.store.models import TRIAL_TABLES, Sweep, Trial
from qkgeom.store.store import Store, open_store

CHUNK = 5_000  # rows per INSERT batch


class MergeError(QkgeomError):
    """A merge that was refused before anything was written."""


@dataclass(frozen=True)
class MergedSweep:
    """One copied sweep: its name in the source and the target, and the rows copied per
    table (as :meth:`Store.sweep_row_counts` counts them)."""

    source_name: str
    name: str
    rows: dict[str, int]


def parse_renames(pairs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``["OLD=NEW", ...]`` -> ``{OLD: NEW}``; a malformed pair is refused."""
    out: dict[str, str] = {}
    for p in pairs:
        old, sep, new = p.partition("=")
        old, new = old.strip(), new.strip()
        if not sep or not old or not new:
            raise MergeError(f"--rename {p!r}: give OLD=NEW (a source sweep's name and its "
                             "name in the target)")
        if old in out:
            raise MergeError(f"--rename {old}: given twice")
        out[old] = check_sweep_name(new, what="--rename NEW")
    return out


def same_database(a: str, b: str) -> bool:
    """Whether two URLs name the same database (SQLite: the same file, whatever the path:
    symbolic links followed, hard links by device and inode)."""
    if backend_of(a) != backend_of(b):
        return False
    pa, pb = sqlite_path(a), sqlite_path(b)
    if pa is not None and pb is not None:
        try:
            sa, sb = os.stat(pa), os.stat(pb)
            return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
        except OSError:  # one does not exist (yet): the same path or none
            pass
        try:
            return Path(pa).resolve() == Path(pb).resolve()
        except OSError:
            return pa == pb
    from sqlalchemy.engine import make_url

    ua, ub = make_url(a), make_url(b)
    return ((ua.host or "localhost"), ua.port, ua.database) == (
        (ub.host or "localhost"), ub.port, ub.database)


def merge_sweeps(source: str, target: str, sweeps: list[str] | None = None,
                 rename: dict[str, str] | None = None, *,
                 running_ok: bool = False, beside_running: bool = False,
                 say: Callable[[str], None] | None = None) -> list[MergedSweep]:
    """Copy ``sweeps`` (all of the source's when None) from database ``source`` into
    database ``target`` (created when new), renaming per ``rename``. Returns what was
    copied; raises :class:`MergeError` (nothing written) when the merge is refused.
    ``running_ok`` copies sweeps with running trials as they are now (for a scratch copy
    that is read once, like :func:`gathered`'s). ``beside_running`` merges into a SQLite
    target even while it holds a live sweep (whose writes then wait for the merge).
    ``say`` gets a line when the source is read through an upgraded copy."""
    source, target = resolve_url(source), resolve_url(target)
    if same_database(source, target):
        raise MergeError("source and target are the same database; give the database to "
                         "copy from with --from and the one to copy into with --db")
    rename = dict(rename or {})
    with _readable(source, say) as readable, \
            open_store(readable, create=False, readonly=True) as src, \
            open_store(target) as dst:
        src.safe_url = safe_url(source)  # messages name the source, not a scratch copy
        names = _chosen(src, sweeps, rename)
        plan = [(n, rename.get(n, n)) for n in names]
        _check(src, dst, plan, running_ok)
        guard = dst.dialect == "sqlite" and not beside_running
        if guard:
            _refuse_live(dst)
        counts = {n: src.sweep_row_counts(n) for n, _ in plan}
        with dst._write() as conn:  # one transaction over every sweep
            if guard:  # again, under the write lock: no trial can start meanwhile
                _refuse_live(dst, conn)
            out = [_copy(src, conn, n, new, counts[n]) for n, new in plan]
    return out


def _refuse_live(dst: Store, conn: Any = None) -> None:
    from qkgeom.store.liveness import live_details

    live = live_details(dst, conn)
    if not live:
        return
    first = live[0].name
    raise MergeError(
        f"{dst.safe_url} holds a live sweep: {'; '.join(d.describe() for d in live)}. A "
        "merge holds this SQLite file's write lock for its whole copy, and the sweep's "
        f"writes would wait for it; nothing was copied. Wait until it ends (qkgeom status "
        f"--name {first} --db {dst.safe_url}) or stop its driver (Ctrl-C), then merge; or "
        "give --beside-running to merge now (its driver waits while the merge writes)")


@contextlib.contextmanager
def _readable(source: str, say: Callable[[str], None] | None) -> Iterator[str]:
    """The URL to read ``source`` through: itself at this qkgeom's schema revision; at an
    older one (SQLite), a temporary copy upgraded to it, deleted afterwards. Any other
    state is left to :func:`open_store` to refuse."""
    from qkgeom.store.schema import current, upgrade

    state = current(source)
    if state.verdict != "outdated":
        yield source
        return
    shown = safe_url(source)
    path = sqlite_path(source)
    if backend_of(source) != "sqlite" or path is None:
        raise MergeError(
            f"{shown} has schema revision {state.revision}, older than this qkgeom's "
            f"{state.head}. qkgeom db merge reads an older SQLite source through an "
            "upgraded temporary copy, but does not copy a PostgreSQL database: copy it "
            "into a scratch database first (pg_dump URL | psql SCRATCH_URL; qkgeom db "
            "upgrade --db SCRATCH_URL; then merge --from SCRATCH_URL), or upgrade it in "
            f"place (qkgeom db upgrade --db {shown}: every qkgeom that writes it must then "
            "be this one or newer)")
    import sqlite3

    from qkgeom.store.engine import connect_sqlite_readonly

    with tempfile.TemporaryDirectory(prefix="qkgeom-merge-") as tmp:
        copy = Path(tmp) / "source.db"
        src = connect_sqlite_readonly(path)
        try:
            src.execute("PRAGMA query_only=ON")
            dst = sqlite3.connect(copy)
            try:
                src.backup(dst)  # one read transaction: a consistent snapshot
            finally:
                dst.close()
        finally:
            src.close()
        url = f"sqlite:///{copy}"
        upgrade(url)
        if say is not None:
            say(f"{shown} is at schema revision {state.revision}: read through a "
                f"temporary copy upgraded to {state.head} (the source is not changed)")
        yield url


def _chosen(src: Store, sweeps: list[str] | None, rename: dict[str, str]) -> list[str]:
    have = src.sweep_names()
    if not have:
        raise MergeError(f"{src.safe_url} has no sweeps to merge")
    names = list(dict.fromkeys(sweeps)) if sweeps else have
    missing = [n for n in names if n not in have]
    if missing:
        raise MergeError(f"no sweep named {', '.join(map(repr, missing))} in {src.safe_url}; "
                         f"sweeps: {', '.join(have)}")
    stray = [o for o in rename if o not in names]
    if stray:
        raise MergeError(f"--rename {stray[0]}=...: {stray[0]!r} is not among the sweeps "
                         f"being merged ({', '.join(names)})")
    return names


def _check(src: Store, dst: Store, plan: list[tuple[str, str]], running_ok: bool) -> None:
    """Every refusal, before anything is written."""
    news = [new for _, new in plan]
    twice = sorted({n for n in news if news.count(n) > 1})
    if twice:
        raise MergeError(f"two sweeps would be called {twice[0]!r} in the target; rename one "
                         "with --rename OLD=NEW")
    taken = set(dst.sweep_names())
    for old, new in plan:
        if new in taken:
            hint = f"--rename {old}={old}-2" if old == new else f"another --rename {old}=..."
            raise MergeError(f"sweep {new!r} already exists in {dst.safe_url}; nothing was "
                             f"copied. Give {hint}, or delete it there first "
                             f"(qkgeom sweep delete --name {new} --db {dst.safe_url})")
    for old, _ in [] if running_ok else plan:
        trials = src.trials(old)
        running = trials.filter(trials["status"] == "running").height if trials.height else 0
        if running:
            raise MergeError(f"sweep {old!r} has {running} trial(s) still running in "
                             f"{src.safe_url}; merge it once they end (qkgeom sweep status "
                             f"--name {old} shows them; a dead driver's trials become "
                             "'interrupted' when the sweep resumes)")


def _utc(v: Any) -> Any:
    """SQLite hands back timestamps without a zone; qkgeom writes them in UTC."""
    if isinstance(v, datetime) and v.tzinfo is None:
        return v.replace(tzinfo=timezone.utc)
    return v


def _row(r: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    return {k: _utc(v) for k, v in r._mapping.items() if k not in skip}


def _copy(src: Store, conn: Any, old: str, new: str, expected: dict[str, int]) -> MergedSweep:
    """Copy one sweep through the target connection ``conn`` (inside its transaction)."""
    from sqlalchemy import func, select

    s, t = Sweep.__table__, Trial.__table__
    sid = src.require_sweep(old)
    with src._read() as rc:
        sweep = _row(rc.execute(select(s).where(s.c.id == sid)).one(), ("id",))
        sweep["name"] = new
        # its files stay the origin's: the database whose driver made them (a sweep
        # recorded before revision 0009 has none: then the source's own identity)
        if not sweep.get("origin"):
            from qkgeom.store.lease import database_identity

            sweep["origin"] = database_identity(src, conn=rc)
        new_sid = conn.execute(s.insert().values(**sweep).returning(s.c.id)).scalar_one()
        ids: dict[int, int] = {}
        for r in rc.execute(select(t).where(t.c.sweep_id == sid).order_by(t.c.id)).all():
            row = _row(r, ("id",))
            row["sweep_id"] = new_sid
            ids[r.id] = conn.execute(t.insert().values(**row).returning(t.c.id)).scalar_one()
        old_ids = list(ids)
        for tab in TRIAL_TABLES:
            q = (select(tab).where(tab.c.trial_id.in_(old_ids))
                 .order_by(*tab.primary_key.columns))
            batch: list[dict[str, Any]] = []
            for r in rc.execution_options(yield_per=CHUNK).execute(q):
                row = _row(r)
                row["trial_id"] = ids[row["trial_id"]]
                batch.append(row)
                if len(batch) >= CHUNK:
                    conn.execute(tab.insert(), batch)
                    batch = []
            if batch:
                conn.execute(tab.insert(), batch)
    got = {"trials": int(conn.execute(select(func.count()).select_from(t)
                                      .where(t.c.sweep_id == new_sid)).scalar_one())}
    new_ids = select(t.c.id).where(t.c.sweep_id == new_sid).scalar_subquery()
    for tab in TRIAL_TABLES:
        got[tab.name] = int(conn.execute(select(func.count()).select_from(tab)
                                         .where(tab.c.trial_id.in_(new_ids))).scalar_one())
    if got != expected:
        diff = {k: (expected[k], got.get(k)) for k in expected if got.get(k) != expected[k]}
        raise QkgeomError(f"merging {old!r}: copied row counts differ from the source's "
                          f"(table: (source, copied)) {diff}; nothing was written")
    return MergedSweep(old, new, got)


@contextlib.contextmanager
def gathered(base: str, refs: Sequence[tuple[str, str | None]]) -> Iterator[tuple[Store,
                                                                                 list[str]]]:
    """One store that holds every sweep of ``refs``, each ``(name, database or None)``
    (None: ``base``), for a report that compares sweeps of several databases; yields the
    store and each ref's sweep name in it. With every ref in ``base`` that is ``base``
    itself, opened read-only; otherwise a scratch SQLite file (deleted afterwards) into
    which the sweeps are copied as they are now (:func:`merge_sweeps`), a name that two
    databases share getting ``@FILE`` appended."""
    base = resolve_url(base)
    dbs = [base if db is None else resolve_url(db) for _, db in refs]
    if all(same_database(d, base) for d in dbs):
        with open_store(base, create=False, readonly=True) as store:
            yield store, [n for n, _ in refs]
        return
    names: list[str] = []
    with tempfile.TemporaryDirectory(prefix="qkgeom-compare-") as tmp:
        url = f"sqlite:///{Path(tmp) / 'compare.db'}"
        for (name, _), db in zip(refs, dbs):
            new = name if name not in names else f"{name}@{Path(sqlite_path(db) or db).stem}"
            if new in names:
                raise MergeError(f"sweep {name!r} of {db} is named twice in the comparison")
            # the scratch file is ours: sweeps copied into it with running trials are not
            # live there, and nothing else writes it
            merge_sweeps(db, url, [name], {name: new} if new != name else None,
                         running_ok=True, beside_running=True)
            names.append(new)
        with open_store(url) as store:
            yield store, names
