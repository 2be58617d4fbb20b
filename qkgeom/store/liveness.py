"""Which sweeps of a database are live: one rule for every command that must not act
beside a running sweep (``qkgeom sweep delete``, ``qkgeom db merge`` into a SQLite file).

A sweep is live while its driver holds a live lease (:mod:`qkgeom.store.lease`: renewed
within its interval, and not provably gone). Without a live lease it is live while at
least one of its trials is ``running`` and that trial is not provably abandoned:

* a lease that went stale, or whose pid no longer runs on this host, proves its trials
  orphaned: not live;
* with no lease at all (``qkgeom train --db`` runs, sweeps of older qkgeom versions):
  when the sweep records no heartbeat interval (``sweeps.heartbeat_s`` NULL) nothing can
  show that its process is gone, so it is live; otherwise its last sign of life
  (``heartbeat_at``, else ``started_at``) must be no more than
  :data:`~qkgeom.store.lifecycle.STALE_AFTER` intervals old
  (:func:`~qkgeom.store.lifecycle.no_heartbeat_s` says None).

The check reads through a given connection when one is passed, so a command repeats it
inside its own write transaction (where, on SQLite, no writer can start a trial
meanwhile). Ages are read on the database's clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qkgeom.store.lease import Lease, db_now, read_lease_in
from qkgeom.store.lifecycle import duration_text, no_heartbeat_s


@dataclass(frozen=True)
class LiveSweep:
    """A live sweep: its name, how many of its trials run, its heartbeat interval (None:
    none recorded), the age of the newest sign of life of its running trials (None: none
    recorded), and the live lease of its driver (None: it has none)."""

    name: str
    running: int
    heartbeat_s: float | None
    last_seen_s: float | None
    lease: Lease | None = None

    @property
    def provable(self) -> bool:
        """Whether it is known to run (a live lease), not only not known to have stopped."""
        return self.lease is not None

    def describe(self) -> str:
        """``'e96' (2 trials running, last heartbeat 4s ago)``."""
        if self.lease is not None:
            how = f"its driver holds the lease: {self.lease.holder()}"
        elif self.heartbeat_s is None:
            how = ("with no heartbeat interval recorded (qkgeom train --db, or an older "
                   "database), so qkgeom cannot tell that its process is gone")
        elif self.last_seen_s is None:
            how = "no heartbeat yet"
        else:
            how = f"last heartbeat {duration_text(self.last_seen_s)} ago"
        return f"{self.name!r} ({self.running} trial(s) running, {how})"


def live_details(store: Any, conn: Any = None, *, name: str | None = None) -> list[LiveSweep]:
    """The live sweeps of ``store`` (rule: the module's doc), by name (only ``name``, when
    given); read through ``conn`` when given (e.g. inside the caller's write transaction)."""
    if conn is None:
        with store._read() as c:
            return live_details(store, c, name=name)
    from sqlalchemy import func, select

    from qkgeom.store.models import Sweep, Trial

    s, t = Sweep.__table__, Trial.__table__
    q = select(s.c.id, s.c.name, s.c.heartbeat_s)
    if name is not None:
        q = q.where(s.c.name == name)
    sweeps = conn.execute(q.order_by(s.c.name)).all()
    n_running = dict(conn.execute(select(t.c.sweep_id, func.count()).where(
        t.c.status == "running").group_by(t.c.sweep_id)).all())
    now = db_now(conn)
    out = []
    for sid, n, every in sweeps:
        lease = read_lease_in(conn, sid)
        if lease is not None:
            if lease.live:
                out.append(LiveSweep(n, int(n_running.get(sid, 0)), every, lease.age_s,
                                     lease))
            continue  # a stale or dead lease: its trials are orphaned
        if not n_running.get(sid):
            continue
        ages = []
        for beat, started in conn.execute(select(t.c.heartbeat_at, t.c.started_at).where(
                t.c.sweep_id == sid, t.c.status == "running")).all():
            if every is not None and no_heartbeat_s("running", beat, started, every,
                                                    now) is not None:
                continue  # stale: its driver is gone
            last = beat or started
            ages.append(None if last is None else (now - _utc(last)).total_seconds())
        if ages:
            seen = [a for a in ages if a is not None]
            out.append(LiveSweep(n, len(ages), None if every is None else float(every),
                                 min(seen) if seen else None))
    return out


def _utc(v: Any) -> Any:
    from datetime import timezone

    return v.replace(tzinfo=timezone.utc) if v.tzinfo is None else v


def live_sweeps(store: Any, conn: Any = None) -> list[str]:
    """The names of the live sweeps of ``store`` (rule: the module's doc), sorted."""
    return [d.name for d in live_details(store, conn)]


def sweep_liveness(store: Any, name: str, conn: Any = None) -> LiveSweep | None:
    """Sweep ``name`` when it is live (rule: the module's doc), else None."""
    got = live_details(store, conn, name=name)
    return got[0] if got else None
