"""One driver per sweep: the lease in ``sweep_leases``, and whether a sweep is live.

A driver (``qkgeom sweep``, a resume, ``qkgeom train --db``) takes its sweep's lease
before it changes any trial, and renews it every ``heartbeat_s`` seconds from a thread of
its own (:class:`LeaseKeeper`), so a driver busy in Ray, blocked on a lock or encoding a
corpus still shows as alive. Times come from the database's own clock (SQLite
``CURRENT_TIMESTAMP``, PostgreSQL ``now()``): the hosts' clocks never enter.

A lease is *live* while its last heartbeat is at most ``stale_after_s`` old, unless its
driver is provably gone: it ran on this host and its pid no longer exists. A driver may
take a lease that is free, stale, or provably gone; a live one is refused with its holder
named (:class:`LeaseHeld`). Taking is one write transaction (SQLite ``BEGIN IMMEDIATE``;
PostgreSQL a row lock or the primary key), so of two drivers at once one wins.

:mod:`qkgeom.store.liveness` is what the destructive commands ask (``sweep delete``,
``db merge``): the lease first, then, for runs without one, the trials' heartbeats.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from qkgeom.errors import QkgeomError

if TYPE_CHECKING:
    from qkgeom.store import Store


class LeaseHeld(QkgeomError):
    """Another live driver holds the sweep."""


def this_host() -> str:
    return socket.gethostname()


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (a permission error means it does)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def db_now(conn: Any) -> datetime:
    """The database's clock, as an aware UTC datetime."""
    if conn.dialect.name == "postgresql":
        v = conn.exec_driver_sql("SELECT now()").scalar_one()
    else:
        v = conn.exec_driver_sql("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')").scalar_one()
        v = datetime.fromisoformat(v)
    return _utc(v)


def _utc(v: datetime) -> datetime:
    return v.replace(tzinfo=timezone.utc) if v.tzinfo is None else v.astimezone(timezone.utc)


@dataclass(frozen=True)
class Lease:
    """A ``sweep_leases`` row, with its age on the database's clock."""

    sweep_id: int
    token: str
    host: str
    pid: int
    command: str | None
    taken_at: datetime
    heartbeat_at: datetime
    stale_after_s: float
    age_s: float  # seconds since the last heartbeat, on the database's clock

    def gone(self) -> str | None:
        """Why the holder is known to be gone (None: it may be alive)."""
        if self.host == this_host() and not pid_alive(self.pid):
            return f"pid {self.pid} no longer runs on {self.host}"
        if self.age_s > self.stale_after_s:
            return (f"no heartbeat for {self.age_s:.0f} s (stale after "
                    f"{self.stale_after_s:.0f} s)")
        return None

    @property
    def live(self) -> bool:
        return self.gone() is None

    def holder(self) -> str:
        what = f" ({self.command})" if self.command else ""
        return (f"pid {self.pid} on {self.host}{what}, last heartbeat {self.age_s:.0f} s ago "
                f"by the database's clock")


def _read(conn: Any, sweep_id: int, *, lock: bool = False) -> Lease | None:
    from sqlalchemy import select

    from qkgeom.store.models import SweepLease

    tab = SweepLease.__table__
    q = select(tab).where(tab.c.sweep_id == sweep_id)
    if lock and conn.dialect.name == "postgresql":
        q = q.with_for_update()
    row = conn.execute(q).first()
    if row is None:
        return None
    now = db_now(conn)
    hb = _utc(row.heartbeat_at)
    return Lease(sweep_id=row.sweep_id, token=row.token, host=row.host, pid=row.pid,
                 command=row.command, taken_at=_utc(row.taken_at), heartbeat_at=hb,
                 stale_after_s=float(row.stale_after_s),
                 age_s=max(0.0, (now - hb).total_seconds()))


def read_lease(store: Store, sweep_id: int) -> Lease | None:
    """The lease of sweep ``sweep_id`` (None: nobody holds it)."""
    with store._read() as conn:
        return _read(conn, sweep_id)


def read_lease_in(conn: Any, sweep_id: int) -> Lease | None:
    """:func:`read_lease` through an open connection (inside its transaction)."""
    return _read(conn, sweep_id)


def takeover_advice(lease: Lease, name: str) -> str:
    """How to continue a sweep whose lease ``lease`` is live."""
    same = lease.host == this_host()
    stop = (f"stop it (kill {lease.pid}, or Ctrl-C in its terminal)" if same else
            f"stop it on {lease.host} (kill {lease.pid} there)")
    return (f"sweep {name} is being run by another driver: {lease.holder()}. Wait for it, "
            f"or {stop}; once it is gone (on {lease.host} a dead pid is proof; elsewhere "
            f"after {lease.stale_after_s:.0f} s without a heartbeat) "
            f"qkgeom sweep --resume --name {name} takes over")


def refuse_beside_live_driver(url: str, name: str) -> None:
    """A read-only early check (the lease is taken later, in one write): raise
    :class:`LeaseHeld` when a live driver holds sweep ``name``."""
    from qkgeom.store import open_store

    try:
        store = open_store(url, create=False, readonly=True)
    except QkgeomError:
        return  # no database or no schema yet: nothing holds it
    with store:
        sid = store.sweep_id(name)
        lease = None if sid is None else read_lease(store, sid)
    if lease is not None and lease.live:
        raise LeaseHeld(takeover_advice(lease, name))


def acquire(store: Store, sweep_id: int, name: str, *, stale_after_s: float,
            command: str | None = None, conn: Any = None) -> tuple[str, Lease | None]:
    """Take the lease of sweep ``sweep_id`` for this process. Returns ``(token, the lease
    it replaced or None)``; raises :class:`LeaseHeld` when a live driver holds it.
    ``conn``: an open write transaction to take it in (else one of its own)."""
    if conn is None:
        with store._write() as c:
            return acquire(store, sweep_id, name, stale_after_s=stale_after_s,
                           command=command, conn=c)
    from sqlalchemy.exc import IntegrityError

    from qkgeom.store.models import SweepLease

    tab = SweepLease.__table__
    old = _read(conn, sweep_id, lock=True)
    if old is not None and old.live:
        raise LeaseHeld(takeover_advice(old, name))
    now = db_now(conn)
    token = uuid.uuid4().hex
    values = dict(token=token, host=this_host(), pid=os.getpid(),
                  command=(command or "")[:200] or None, taken_at=now, heartbeat_at=now,
                  stale_after_s=float(stale_after_s))
    if old is None:
        try:
            with conn.begin_nested():
                conn.execute(tab.insert().values(sweep_id=sweep_id, **values))
        except IntegrityError:  # PostgreSQL: another driver inserted it first
            raise LeaseHeld(f"sweep {name} was taken by another driver a moment ago; "
                            f"qkgeom sweep status --name {name} shows it") from None
    else:
        n = conn.execute(tab.update().where(tab.c.sweep_id == sweep_id,
                                            tab.c.token == old.token).values(**values)).rowcount
        if n != 1:
            raise LeaseHeld(f"sweep {name} was taken by another driver a moment ago")
    return token, old


def renew(store: Store, sweep_id: int, token: str) -> bool:
    """A heartbeat of the lease; False when it is no longer ours (taken over or gone)."""
    from qkgeom.store.models import SweepLease

    tab = SweepLease.__table__
    with store._write() as conn:
        now = db_now(conn)
        n = conn.execute(tab.update().where(tab.c.sweep_id == sweep_id, tab.c.token == token)
                         .values(heartbeat_at=now)).rowcount
    return n == 1


def release(store: Store, sweep_id: int, token: str) -> bool:
    """Give the lease back (only if still ours)."""
    from qkgeom.store.models import SweepLease

    tab = SweepLease.__table__
    with store._write() as conn:
        n = conn.execute(tab.delete().where(tab.c.sweep_id == sweep_id,
                                            tab.c.token == token)).rowcount
    return n == 1


class Beater:
    """Calls ``beat(store)`` every ``every_s`` seconds from a daemon thread with a
    connection of its own, until :meth:`stop`: a heartbeat that does not depend on what
    the main thread is doing. ``beat`` returning False ends it (:attr:`lost`) and calls
    ``on_lost`` once; a beat that fails (a locked or unreachable database) is tried again
    at the next tick."""

    def __init__(self, url: str, every_s: float, beat: Callable[[Store], bool],
                 on_lost: Callable[[], None] | None = None) -> None:
        self.url, self.beat = url, beat
        self.every_s = max(0.05, float(every_s))
        self.on_lost = on_lost
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="qkgeom-heartbeat",
                                        daemon=True)

    def start(self) -> Beater:
        self._thread.start()
        return self

    def _run(self) -> None:
        from qkgeom.store import open_store

        store = None
        try:
            while not self._stop.wait(self.every_s):
                try:
                    if store is None:
                        store = open_store(self.url, create=False)
                    if not self.beat(store):
                        self.lost = True
                        if self.on_lost is not None:
                            self.on_lost()
                        return
                except QkgeomError:
                    continue  # locked or unreachable: try again at the next tick
        finally:
            if store is not None:
                store.close()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=max(5.0, 2 * self.every_s))

    def __enter__(self) -> Beater:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LeaseKeeper(Beater):
    """Renews a taken lease every ``every_s`` seconds (a :class:`Beater`) until
    :meth:`stop`, which releases it. A renewal that finds the lease taken by another
    driver sets :attr:`lost`, says so, and calls ``on_lost``."""

    def __init__(self, url: str, sweep_id: int, token: str, every_s: float,
                 on_lost: Callable[[], None] | None = None) -> None:
        self.sweep_id, self.token = sweep_id, token
        self._lost_hook = on_lost
        super().__init__(url, every_s, lambda store: renew(store, sweep_id, token),
                         on_lost=self._said_lost)

    def _said_lost(self) -> None:
        print("qkgeom: another driver took over this sweep's lease; stopping this one",
              file=sys.stderr, flush=True)
        if self._lost_hook is not None:
            self._lost_hook()

    def stop(self, *, release_it: bool = True) -> None:
        super().stop()
        if release_it and not self.lost:
            from qkgeom.store import open_store

            try:
                with open_store(self.url, create=False) as store:
                    release(store, self.sweep_id, self.token)
            except QkgeomError:
                pass  # left behind: stale after its interval, or a dead pid on this host


# ---------------------------------------------------------------------- identity
def database_identity(store: Store, *, conn: Any = None) -> str | None:
    """The database's ``database_info.identity`` (None in a database without one)."""
    if conn is None:
        with store._read() as c:
            return database_identity(store, conn=c)
    from sqlalchemy import select

    from qkgeom.store.models import DatabaseInfo

    tab = DatabaseInfo.__table__
    return conn.execute(select(tab.c.value).where(tab.c.key == "identity")).scalar()
