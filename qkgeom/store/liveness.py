"""Which sweeps of a database are live: one rule for every command that must not act
beside a running sweep (``qkgeom db merge`` into a SQLite file today).

A sweep is live while at least one of its trials is ``running`` and that trial is not
provably abandoned: either the sweep records no heartbeat interval (``sweeps.heartbeat_s``
NULL: ``qkgeom train --db``, rows of databases older than revision 0006), so nothing can
show that its process is gone, or its last sign of life (``heartbeat_at``, else
``started_at``) is no more than :data:`~qkgeom.store.lifecycle.STALE_AFTER` intervals old
(:func:`~qkgeom.store.lifecycle.no_heartbeat_s` says None). A running trial whose
heartbeat is older than that has lost its driver and does not make its sweep live.

The check reads through a given connection when one is passed, so a command repeats it
inside its own write transaction (where, on SQLite, no writer can start a trial
meanwhile). Extend :func:`live_details` (e.g. with the driver lease of a later revision)
and every caller follows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from qkgeom.store.lifecycle import duration_text, no_heartbeat_s


@dataclass(frozen=True)
class LiveSweep:
    """A live sweep: its name, how many of its trials run, its heartbeat interval (None:
    none recorded) and the age of the newest sign of life of its running trials (None:
    none recorded)."""

    name: str
    running: int
    heartbeat_s: float | None
    last_seen_s: float | None

    def describe(self) -> str:
        """``'e96' (2 trials running, last heartbeat 4s ago)``."""
        if self.heartbeat_s is None:
            how = ("with no heartbeat interval recorded (qkgeom train --db, or an older "
                   "database), so qkgeom cannot tell that its process is gone")
        elif self.last_seen_s is None:
            how = "no heartbeat yet"
        else:
            how = f"last heartbeat {duration_text(self.last_seen_s)} ago"
        return f"{self.name!r} ({self.running} trial(s) running, {how})"


def live_details(store: Any, conn: Any = None) -> list[LiveSweep]:
    """The live sweeps of ``store`` (rule: the module's doc), by name; read through
    ``conn`` when given (e.g. inside the caller's write transaction)."""
    from sqlalchemy import select

    from qkgeom.store.models import Sweep, Trial

    s, t = Sweep.__table__, Trial.__table__
    q = (select(s.c.name, s.c.heartbeat_s, t.c.heartbeat_at, t.c.started_at)
         .join(t, t.c.sweep_id == s.c.id).where(t.c.status == "running"))
    if conn is None:
        with store._read() as c:
            rows = c.execute(q).all()
    else:
        rows = conn.execute(q).all()
    now = datetime.now(timezone.utc)
    running: dict[str, int] = {}
    every_of: dict[str, float | None] = {}
    ages: dict[str, list[float]] = {}
    for name, every, beat, started in rows:
        if every is not None and no_heartbeat_s("running", beat, started, every, now) \
                is not None:
            continue  # stale: its driver is gone
        running[name] = running.get(name, 0) + 1
        every_of[name] = None if every is None else float(every)
        last = beat or started
        if last is not None:
            last = last if last.tzinfo else last.replace(tzinfo=timezone.utc)
            ages.setdefault(name, []).append((now - last).total_seconds())
    return [LiveSweep(n, running[n], every_of[n], min(ages[n]) if n in ages else None)
            for n in sorted(running)]


def live_sweeps(store: Any, conn: Any = None) -> list[str]:
    """The names of the live sweeps of ``store`` (rule: the module's doc), sorted."""
    return [d.name for d in live_details(store, conn)]
