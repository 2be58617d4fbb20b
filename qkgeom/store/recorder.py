"""What a running trial leaves in the database, written the same way by every runner.

``qkgeom train --db`` (:mod:`qkgeom.cli.train`, one trial) and the sweep's driver-side
callback (:class:`qkgeom.sweeps.callbacks.DbWriter`, every trial of the sweep) both hold a
:class:`TrialRecorder`: an attempt starts with its provenance, each report stores the
probe's rows, the checkpoint or snapshot saved at its step and a heartbeat, and the status
moves through :class:`~qkgeom.store.lifecycle.TrialLifecycle`. Provenance arrives as data
(:func:`qkgeom.sweeps.provenance.provenance` measures it): the store measures nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkgeom.store.lifecycle import TrialLifecycle

if TYPE_CHECKING:
    from qkgeom.records import ProbeRecord
    from qkgeom.store import Store


class TrialRecorder:
    """The writes of the trials of sweep ``sweep_id`` in one open store, by trial id."""

    def __init__(self, store: Store, sweep_id: int) -> None:
        self.store = store
        self.sweep_id = sweep_id
        self.lifecycle = TrialLifecycle(store)

    # ------------------------------------------------------------------ attempts
    def started(self, trial_id: int, provenance: dict | None = None, *,
                restart: bool = False, restored_step: int | None = None) -> int:
        """An attempt starts (``running``, its ``trial_attempts`` row with ``provenance``);
        returns its number. ``restart``: it continues from the checkpoint at
        ``restored_step`` (None: from scratch), and what earlier attempts stored after that
        step is deleted with the same write (:meth:`TrialLifecycle.started`)."""
        return self.lifecycle.started(trial_id, provenance, restart=restart,
                                      restored_step=restored_step)

    def placed(self, trial_id: int, *, host: str | None, device: str | None,
               provenance: dict | None = None) -> None:
        """The attempt's first report said where it runs, and the provenance measured there."""
        self.lifecycle.placed(trial_id, host=host, device=device, provenance=provenance)

    # ------------------------------------------------------------------ reports
    def reported(self, trial_id: int, record: ProbeRecord | None = None, *,
                 step: int | None = None, saved: str | None = None,
                 kind: str = "resume") -> None:
        """One report of a running trial: the probe's rows (``record``; None when the
        worker wrote them itself, or for a report without a probe), the checkpoint or
        snapshot (``kind``) saved at ``step`` (the record's step when not given) at
        location ``saved``, and the trial's heartbeat."""
        if record is not None:
            self.store.write_probe(trial_id, record)
            step = record.step if step is None else step
        if saved:
            self.checkpoint(trial_id, step, saved, kind=kind)
        self.alive(trial_id)

    def checkpoint(self, trial_id: int, step: int | None, location: str, *,
                   kind: str = "resume") -> None:
        """A checkpoint or snapshot of ``kind`` saved at ``step``; one reported without a
        step (before the first probe) has no row."""
        if step is not None:
            self.store.add_checkpoint(trial_id, int(step), location, kind=kind)

    def dropped_checkpoint(self, trial_id: int, step: int | None, location: str, *,
                           kind: str = "resume") -> None:
        """The checkpoint at ``step`` was deleted: its row goes (if it still names
        ``location``: a newer save of the same step keeps its row)."""
        if step is not None:
            self.store.delete_checkpoint(trial_id, int(step), kind=kind, location=location)

    def alive(self, trial_id: int | None = None) -> None:
        """A heartbeat for the sweep's running trials (only ``trial_id``, when given)."""
        self.lifecycle.alive(self.sweep_id, trial_id)

    # ------------------------------------------------------------------ endings
    def result(self, trial_id: int, *, test_loss: float) -> None:
        """The trial's final test loss (nats/char), before it is marked finished."""
        self.lifecycle.result(trial_id, test_loss=test_loss)

    def finished(self, trial_id: int, *, host: str | None = None,
                 device: str | None = None) -> None:
        """Training ran to its last step: ``terminated``."""
        self.lifecycle.finished(trial_id, host=host, device=device)

    def retrying(self, trial_id: int, error: str) -> None:
        """The attempt failed and another one is due: ``pending``, with the error text."""
        self.lifecycle.retrying(trial_id, error)

    def failed(self, trial_id: int, error: str) -> None:
        """The attempt failed and no retry is left: ``error``."""
        self.lifecycle.failed(trial_id, error)

    def interrupted(self, trial_id: int, error: str) -> None:
        """Stopped by a signal before the end: ``interrupted``."""
        self.lifecycle.interrupted(trial_id, error)
