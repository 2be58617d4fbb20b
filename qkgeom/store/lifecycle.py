"""The trial lifecycle in the database: one writer for every way a trial runs.

``pending -> running -> terminated | error | interrupted``, with ``pending`` again when a
failed attempt is retried. Each start of an attempt counts in ``attempts`` and has a row in
``trial_attempts`` with its provenance (:mod:`qkgeom.sweeps.provenance`). Both the
sweep's driver-side Tune callback (:class:`qkgeom.sweeps.callbacks.DbWriter`) and
``qkgeom train --db`` (:mod:`qkgeom.cli.train`) move trials through here, by way of one
:class:`qkgeom.store.recorder.TrialRecorder` each, so the two record a trial the same way;
:func:`mark_interrupted` records a sweep that stopped short. No Ray, no torch: a thin layer over :meth:`qkgeom.store.Store.set_trial_status`.

Heartbeats: while a sweep runs, its driver refreshes ``trials.heartbeat_at`` of the
running trials on every result and at least every ``sweeps.heartbeat_s`` seconds
(:data:`HEARTBEAT_S` unless the sweep sets another). A ``running`` trial whose heartbeat
is older than :data:`STALE_AFTER` intervals has lost its driver (killed, its machine
gone): :func:`no_heartbeat_s` tells, and :func:`stale_note` says so in the words
``qkgeom status`` and the live page show. The writer's and the reader's clocks are
assumed to agree within seconds (NTP).
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qkgeom.store import Store
    from qkgeom.store.lease import Lease

HEARTBEAT_S = 30.0  # seconds between a running sweep's heartbeats (default)
STALE_AFTER = 3  # heartbeat intervals without one before a running trial counts as stale


class TrialLifecycle:
    """Status transitions of the trials of one open :class:`~qkgeom.store.Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def started(self, trial_id: int, provenance: dict | None = None, *,
                restart: bool = False, restored_step: int | None = None) -> int:
        """An attempt starts: ``running``, one more attempt, and its row in
        ``trial_attempts`` with what is known of it yet (``provenance``: fields of
        :func:`qkgeom.sweeps.provenance.provenance`). Returns the attempt's number.

        ``restart``: the attempt continues from the checkpoint at ``restored_step`` (from
        scratch when None), and the rows earlier attempts wrote after it are deleted in the
        same transaction (:meth:`qkgeom.store.Store.start_attempt`)."""
        if restart:
            return self.store.start_attempt(trial_id, provenance,
                                            restored_step=restored_step)[0]
        self.store.set_trial_status(trial_id, "running", bump_attempts=True)
        return self.store.record_attempt(trial_id, provenance or {})

    def alive(self, sweep_id: int, trial_id: int | None = None) -> None:
        """A heartbeat for the sweep's running trials (only ``trial_id``, when given)."""
        self.store.heartbeat(sweep_id, trial_id)

    def placed(self, trial_id: int, *, host: str | None, device: str | None,
               provenance: dict | None = None) -> None:
        """The running attempt reported where it runs (its first result), and the
        provenance measured there, which completes its ``trial_attempts`` row."""
        self.store.set_trial_status(trial_id, "running", host=host, device=device)
        if provenance:
            self.store.record_attempt(trial_id, provenance)

    def retrying(self, trial_id: int, error: str) -> None:
        """The attempt failed and another one is due: ``pending``, with the error text."""
        self.store.set_trial_status(trial_id, "pending", error=error)

    def failed(self, trial_id: int, error: str) -> None:
        """The attempt failed and no retry is left: ``error``."""
        self.store.set_trial_status(trial_id, "error", error=error)

    def interrupted(self, trial_id: int, error: str) -> None:
        """Stopped by a signal (or a dead driver) before the end: ``interrupted``."""
        self.store.set_trial_status(trial_id, "interrupted", error=error)

    def result(self, trial_id: int, *, test_loss: float) -> None:
        """The trial's final test loss (nats/char), before it is marked finished."""
        self.store.set_trial_result(trial_id, test_loss=test_loss)

    def finished(self, trial_id: int, *, host: str | None = None,
                 device: str | None = None) -> None:
        """Training ran to its last step: ``terminated``."""
        self.store.set_trial_status(trial_id, "terminated", host=host, device=device)


def mark_interrupted(db_url: str, sweep: str, why: str) -> int:
    """Trials of ``sweep`` still ``running`` -> ``interrupted``, the step they reached
    (their last probe) in the error column. Returns how many."""
    from qkgeom.store import open_store

    with open_store(db_url) as store:
        sid = store.require_sweep(sweep)
        trials = store.trials(sweep).filter(status="running")
        if trials.height == 0:
            return 0
        last = {tid: step for tid, (step, _) in store.last_probes(sid).items()}
        lifecycle = TrialLifecycle(store)
        for tid, cfg in zip(trials["id"], trials["config"]):
            ms = json.loads(cfg).get("max_steps")
            step = last.get(tid)
            at = "before its first probe" if step is None else \
                f"at step {step} of {ms} (its last probe)"
            lifecycle.interrupted(int(tid), f"interrupted by {why} {at}")
        return trials.height


def duration_text(s: float) -> str:
    """``45s``, ``2m10s``, ``1h05m``; ``?`` for an unknown (non-finite) duration."""
    if not math.isfinite(s):
        return "?"
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def no_heartbeat_s(status: str, heartbeat_at: datetime | None, started_at: datetime | None,
                   heartbeat_s: float | None, now: datetime | None = None) -> float | None:
    """Seconds since a ``running`` trial's last heartbeat (its start when it has none),
    when that is more than :data:`STALE_AFTER` x ``heartbeat_s``: its driver is gone.
    None for a live or a not-running trial, and when the sweep promises no heartbeat
    (``heartbeat_s`` None). Naive datetimes (SQLite's) are UTC."""
    last = heartbeat_at or started_at
    if status != "running" or heartbeat_s is None or last is None:
        return None
    if last.tzinfo is None:
        last = last.replace(tzinfo=timezone.utc)
    age = ((now or datetime.now(timezone.utc)) - last).total_seconds()
    return age if age > STALE_AFTER * heartbeat_s else None


def stale_note(age_s: float, sweep: str, lease: Lease | None = None) -> str:
    """What ``qkgeom status`` and the live page show of a stale running trial. With the
    sweep's ``lease`` (:mod:`qkgeom.store.lease`) still live, its driver is alive (only
    slow, or blocked): a resume would be refused, so the note says to wait instead."""
    late = f"running, no heartbeat for {duration_text(age_s)}"
    if lease is not None and lease.live:
        return (f"{late}, but its driver still holds the sweep's lease ({lease.holder()}): "
                "it is alive; wait, or stop that driver to resume")
    gone = f" ({lease.gone()})" if lease is not None else ""
    return (f"{late}: the driver is gone?{gone} qkgeom sweep --resume --name {sweep} "
            "takes the sweep over and marks it interrupted")
