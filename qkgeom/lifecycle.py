"""The trial lifecycle in the database: one writer for every way a trial runs.

``pending -> running -> terminated | error | interrupted``, with ``pending`` again when a
failed attempt is retried. Each start of an attempt counts in ``attempts``. Both the
sweep's driver-side Tune callback (:class:`qkgeom.tune_callbacks.DbWriter`) and
``qkgeom train --db`` (:mod:`qkgeom.cli.train`) move trials through here, so the two
record a trial the same way; :func:`mark_interrupted` records a sweep that stopped
short. No Ray, no torch: a thin layer over :meth:`qkgeom.store.Store.set_trial_status`.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qkgeom.store import Store


class TrialLifecycle:
    """Status transitions of the trials of one open :class:`~qkgeom.store.Store`."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def started(self, trial_id: int) -> None:
        """An attempt starts: ``running`` and one more attempt."""
        self.store.set_trial_status(trial_id, "running", bump_attempts=True)

    def placed(self, trial_id: int, *, host: str | None, device: str | None) -> None:
        """The running attempt reported where it runs (its first result)."""
        self.store.set_trial_status(trial_id, "running", host=host, device=device)

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
