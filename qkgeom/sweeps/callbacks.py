"""The driver's side of a running sweep: Tune's callbacks and the stop signals.

:class:`DbWriter` is the single database writer (safe for SQLite), in the driver: probe
rows and the trial lifecycle (pending -> running -> error | terminated, attempts, host,
device, checkpoints), through :class:`qkgeom.store.recorder.TrialRecorder` as ``qkgeom
train --db`` records its trial. With ``direct_writes`` (PostgreSQL only) the workers
write their own probe rows and the callback keeps the lifecycle, and the heartbeats of
the running trials (on every result and every ``heartbeat_s`` seconds,
:mod:`qkgeom.store.lifecycle`). :class:`ProgressReporter` prints one concise progress line.
SIGINT/SIGTERM in the driver are forwarded into Tune's graceful stop
(:func:`install_signal_handlers`).

Tune pickles the whole ``RunConfig`` (callbacks included) into the experiment state and
brings the callbacks back from that pickle on restore, so callbacks hold no engine and no
database URL (it may carry a password): what the driver shares with them is
:data:`qkgeom.sweeps.state.DRIVER_STATE`, which they read through its module and never
keep (it lives in the driver process only).
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ray.tune import Callback

from qkgeom.errors import QkgeomError
from qkgeom.plan.spec import SweepError
from qkgeom.store.lifecycle import duration_text
from qkgeom.sweeps.state import DRIVER_STATE
from qkgeom.sweeps.trainable import storage_location, trial_name

if TYPE_CHECKING:
    from qkgeom.store import Store
    from qkgeom.store.recorder import TrialRecorder

def _error_text(trial: Any) -> str:
    path = getattr(trial, "error_file", None)
    try:
        text = Path(path).read_text() if path else ""
    except OSError:
        text = ""
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return "trial failed (no error text from Ray)"
    # the exception line last, after a short traceback tail
    return "\n".join(lines[-12:])[-4000:]


def _recording(fn: Any) -> Any:
    """A qkgeom error in a callback (a database that fails, a trial row that is missing)
    ends Tune's whole fit with a TuneError around a traceback's text: keep the error's own
    message in the driver's state for :func:`qkgeom.sweeps.driver.run_sweep` to report in
    one line."""
    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except QkgeomError as e:
            if DRIVER_STATE.callback_error is None:
                DRIVER_STATE.callback_error = str(e)
            raise
    return wrapper


class DbWriter(Callback):
    """The single database writer, in the driver. Holds no engine when pickled.

    ``keep_recent_s``: the prune age (seconds) of superseded resume checkpoints, see
    :meth:`_prune`.
    """

    def __init__(self, sweep: str, direct_writes: bool = False, keep_last: int = 2,
                 keep_recent_s: float = 60.0) -> None:
        self.sweep = sweep
        self.direct_writes = direct_writes
        self.keep_last = keep_last
        self.keep_recent_s = keep_recent_s
        self.__dict__.update(self._transient())

    @staticmethod
    def _transient() -> dict[str, Any]:
        """The driver-only state: none of it is pickled into the experiment."""
        return {
            "_store": None,
            "_recorder": None,
            "_ids": {},  # trial key -> trials.id
            "_seen": set(),  # trials whose current attempt has reported
            "_ckpts": {},  # trial id -> [(time registered, step, location, Checkpoint)]
            "_sid": None,  # sweeps.id
            "_beat": -math.inf,  # monotonic time of the last heartbeat of all running trials
        }

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, **self._transient()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # fresh driver state, also for a state pickled by an older qkgeom
        self.__dict__.update({**state, **self._transient()})

    @property
    def store(self) -> Store:
        if self._store is None:
            from qkgeom.store import open_store

            if DRIVER_STATE.db_url is None:
                raise SweepError("internal: the sweep driver has no database URL")
            self._store = open_store(DRIVER_STATE.db_url)
        return self._store

    @property
    def recorder(self) -> TrialRecorder:
        if self._recorder is None:
            from qkgeom.store.recorder import TrialRecorder

            self._recorder = TrialRecorder(self.store, self.sweep_id)
        return self._recorder

    @property
    def sweep_id(self) -> int:
        if self._sid is None:
            self._sid = self.store.require_sweep(self.sweep)
        return self._sid

    def _tid(self, trial: Any) -> int:
        key = trial.config["trial"]["key"]
        if key not in self._ids:
            tid = self.store.trial_id(self.sweep_id, key)
            if tid is None:
                raise SweepError(f"trial {key} of sweep {self.sweep} is not in the database")
            self._ids[key] = tid
        return self._ids[key]

    @staticmethod
    def _finished(trial: Any) -> bool:
        return trial.config["trial"]["key"] in DRIVER_STATE.finished

    @_recording
    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if self._finished(trial):  # done before a driver crash; the trainable skips it
            return
        from qkgeom.sweeps.provenance import code_provenance

        self._seen.discard(trial.trial_id)
        # the checkpoint Tune restores this attempt from (None: it starts from scratch):
        # what an earlier attempt stored after it goes, in the write that starts this one
        latest = getattr(trial, "latest_checkpoint_result", None)
        step = (latest.metrics or {}).get("step") if latest is not None else None
        known = latest is None or step is not None  # else: which step is unknown, keep all
        # (with --direct-writes too: Tune calls this before it starts the training function
        # on the actor, so no write of the new attempt comes before this one)
        self.recorder.started(self._tid(trial), code_provenance(), restart=known,
                              restored_step=None if step is None else int(step))

    @_recording
    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict,
                        **info: Any) -> None:
        from qkgeom.records import ProbeRecord

        tid = self._tid(trial)
        if trial.trial_id not in self._seen:
            self._seen.add(trial.trial_id)
            prov = result.get("provenance")
            self.recorder.placed(tid, host=result.get("host"), device=result.get("device"),
                                 provenance=json.loads(prov) if prov else None)
        if "test_loss" in result:
            self.recorder.result(tid, test_loss=result["test_loss"])
        rec = result.get("record")
        self.recorder.reported(tid, ProbeRecord.from_dict(json.loads(rec)) if rec else None,
                               step=result.get("step"), saved=result.get("snapshot"),
                               kind="snapshot")

    @_recording
    def on_step_begin(self, iteration: int, trials: list, **info: Any) -> None:
        # between results too (a long probe interval): every heartbeat_s at most
        now = time.monotonic()
        if now - self._beat >= DRIVER_STATE.heartbeat_s:
            self._beat = now
            self.recorder.alive()

    @_recording
    def on_checkpoint(self, iteration: int, trials: list, trial: Any, checkpoint: Any,
                      **info: Any) -> None:
        step = (trial.last_result or {}).get("step")
        storage = getattr(trial, "storage", None)
        loc = storage_location(checkpoint.filesystem, str(checkpoint.path),
                               getattr(storage, "storage_fs_path", None),
                               DRIVER_STATE.storage)
        tid = self._tid(trial)
        self.recorder.checkpoint(tid, step, loc, kind="resume")
        self._prune(trial.trial_id, tid, step, loc, checkpoint)

    def _prune(self, trial_id: str, tid: int, step: int | None, loc: str,
               checkpoint: Any) -> None:
        """Delete superseded resume checkpoints, but only old ones, and their rows.

        Tune's own ``num_to_keep`` deletes a checkpoint as soon as newer ones exist, yet the
        experiment snapshot (taken every few seconds) may still name it: a driver killed
        then leaves a restore pointing at nothing. We keep the newest ``keep_last`` and
        every checkpoint younger than ``keep_recent_s``, far longer than the snapshot period.
        A deleted checkpoint's ``checkpoints`` row goes with it; one that could not be
        deleted keeps its row and is tried again at the next checkpoint.
        """
        now = time.monotonic()
        lst = self._ckpts.setdefault(trial_id, [])
        lst.append((now, step, loc, checkpoint))
        keep = lst[-self.keep_last:] if self.keep_last > 0 else []
        for item in list(lst):
            t, st, where, ck = item
            if any(ck is k[3] for k in keep) or now - t < self.keep_recent_s:
                continue
            try:
                ck.filesystem.delete_dir(ck.path)
            except Exception:  # already gone, or a storage hiccup: look before forgetting
                if _exists(ck.filesystem, ck.path):
                    continue
            self.recorder.dropped_checkpoint(tid, st, where, kind="resume")
            lst.remove(item)

    @_recording
    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._seen.discard(trial.trial_id)
        self.recorder.retrying(self._tid(trial), _error_text(trial))

    @_recording
    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.recorder.failed(self._tid(trial), _error_text(trial))

    @_recording
    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        # trial.status still reads RUNNING here: write the terminal state ourselves
        if self._finished(trial):
            return
        last = trial.last_result or {}
        if DRIVER_STATE.interrupted and last.get("step") != last.get("max_steps"):
            return  # stopped by a signal, not finished: run_sweep records it as interrupted
        self.recorder.finished(self._tid(trial))

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        if self._store is not None:
            self._store.close()
            self._store = self._recorder = self._sid = None


def _exists(fs: Any, path: str) -> bool:
    import pyarrow.fs as pafs

    try:
        return fs.get_file_info(path).type != pafs.FileType.NotFound
    except Exception:
        return True  # cannot tell: keep the row


class ProgressReporter(Callback):
    """A concise progress line (trials done/running/failed/pending, steps, ETA)."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._reset()

    def _reset(self) -> None:
        self._t0: float | None = None
        self._steps0: int | None = None
        self._last_line = ""
        self._last_t = 0.0

    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d.update(_t0=None, _steps0=None, _last_line="", _last_t=0.0)
        return d

    def line(self, trials: list) -> tuple[str, str]:
        """Counts over the whole plan (``DRIVER_STATE.plan_steps``: key -> max_steps), so the
        total is the same from the first line on: trials Tune has not created yet are
        pending, trials the database already holds as finished are done. A trial Tune
        calls TERMINATED short of its max_steps (a graceful stop, or a fit that an error
        ended) is counted as stopped, never as done."""
        counts = {"done": 0, "running": 0, "failed": 0, "pending": 0, "stopped": 0}
        steps = total = 0
        plan = dict(DRIVER_STATE.plan_steps)
        finished = set(DRIVER_STATE.finished_before) | set(DRIVER_STATE.finished)
        seen = set()
        for t in trials:
            key = t.config["trial"]["key"]
            seen.add(key)
            ms = int(t.config["trial"]["config"]["max_steps"])
            total += ms
            st = "TERMINATED" if key in finished else t.status
            step = int((t.last_result or {}).get("step", 0) or 0)
            if st == "TERMINATED" and (key in finished or step >= ms):
                counts["done"] += 1
                steps += ms
                continue
            steps += step
            if st == "TERMINATED":  # ended short of max_steps: stopped (a signal, an error
                counts["stopped"] += 1  # in the driver), not done; Tune calls it TERMINATED
            elif st == "ERROR":
                counts["failed"] += 1
            elif st == "RUNNING":
                counts["running"] += 1
            else:
                counts["pending"] += 1
        for key, ms in plan.items():
            if key in seen:
                continue
            total += ms
            if key in finished:
                counts["done"] += 1
                steps += ms
            else:
                counts["pending"] += 1
        n_trials = len(seen | set(plan))
        now = time.monotonic()
        if self._t0 is None:
            self._t0, self._steps0 = now, steps
        rate = (steps - self._steps0) / max(now - self._t0, 1e-9)
        eta = (total - steps) / rate if rate > 0 else math.inf
        state = (f"{counts['done']}/{n_trials} done, {counts['running']} running, "
                 f"{counts['failed']} failed, {counts['pending']} pending")
        if counts["stopped"]:
            state += f", {counts['stopped']} stopped"
        since = self._t0 if DRIVER_STATE.sweep_t0 is None else DRIVER_STATE.sweep_t0
        text = (f"[{duration_text(now - since):>6}] {state} | steps {steps}/{total} "
                f"({100 * steps / max(total, 1):.0f}%) | ETA {duration_text(eta)}")
        return state, text

    def _maybe_print(self, trials: list, force: bool = False) -> None:
        if not trials:
            return
        state, text = self.line(trials)
        now = time.monotonic()
        if force or state != self._last_line or now - self._last_t >= self.every_s:
            print(text, flush=True)
            self._last_line, self._last_t = state, now

    def on_step_begin(self, iteration: int, trials: list, **info: Any) -> None:
        if DRIVER_STATE.interrupted:
            forward_stop()  # a signal that came before Tune's own handler was installed

    def on_step_end(self, iteration: int, trials: list, **info: Any) -> None:
        self._maybe_print(trials)

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        last = _error_text(trial).splitlines()[-1]
        print(f"  {trial_name(trial)}: failed ({last}); retrying from its last checkpoint",
              flush=True)

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        last = _error_text(trial).splitlines()[-1]
        print(f"  {trial_name(trial)}: failed ({last}); no retries left", flush=True)

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        if DRIVER_STATE.interrupted:
            return  # Tune's view of stopped trials is not the record; the CLI prints that
        self._maybe_print(trials, force=True)



# ---------------------------------------------------------------------- signals
def _on_signal(signum: int, frame: Any) -> None:
    """SIGINT/SIGTERM in the driver: stop Tune gracefully (once), then record the truth.

    Inside ``fit`` the stop goes through Tune's own SIGUSR1 handler (the graceful path:
    trials stop, the experiment state is saved); :func:`run_sweep` then marks the trials
    that were running as ``interrupted``. A second signal, or one outside ``fit``, raises
    KeyboardInterrupt at once.
    """
    name = signal.Signals(signum).name
    if DRIVER_STATE.interrupted or not DRIVER_STATE.in_fit:
        DRIVER_STATE.interrupted = DRIVER_STATE.interrupted or name
        raise KeyboardInterrupt
    DRIVER_STATE.interrupted = name
    forward_stop(final=False)


def forward_stop(final: bool = True) -> None:
    """Ask Tune to stop, through the handler ``fit`` installs for SIGUSR1 (if it has).

    From the signal handler the installed one may still be an older ``fit``'s (the
    signal came before this one's setup), so it is called again from Tune's loop
    (``ProgressReporter.on_step_begin``, ``final=True``) once, where it is this ``fit``'s."""
    h = signal.getsignal(signal.SIGUSR1)
    if callable(h) and h is not _on_signal and not DRIVER_STATE.forwarded:
        DRIVER_STATE.forwarded = final
        h(signal.SIGUSR1, None)


@contextmanager
def signals_seen_during_ray_start() -> Iterator[None]:
    """``ray.init`` installs its own SIGTERM handler (``sys.exit``) for the time it starts.
    Its SystemExit, or our KeyboardInterrupt, raised while the main thread runs an at-fork
    hook (logging's lock release after Ray forks a helper) is printed as "Exception
    ignored" and lost, and the sweep would go on as if nothing came. So the handler Ray
    installs first records the signal in :data:`DRIVER_STATE` (as ours does), and the
    driver checks it once Ray is up (:func:`stop_if_signalled`)."""
    import ray._private.utils as ray_utils

    ray_set = getattr(ray_utils, "set_sigterm_handler", None)

    def set_recording(handler: Any) -> None:
        def recorded(signum: int, frame: Any) -> None:
            DRIVER_STATE.interrupted = (DRIVER_STATE.interrupted
                                        or signal.Signals(signum).name)
            handler(signum, frame)

        ray_set(recorded)

    if ray_set is not None:
        ray_utils.set_sigterm_handler = set_recording
    try:
        yield
    finally:
        if ray_set is not None:
            ray_utils.set_sigterm_handler = ray_set


def stop_if_signalled() -> None:
    """A stop signal that came while Ray was starting, whose exception an at-fork hook
    swallowed: stop now (:func:`qkgeom.sweeps.driver.run_sweep` records it)."""
    if DRIVER_STATE.interrupted:
        raise KeyboardInterrupt


def install_signal_handlers() -> dict[int, Any]:
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # ours forwards to Tune's SIGUSR1
    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        old[sig] = signal.getsignal(sig)
        signal.signal(sig, _on_signal)
    return old


def restore_signal_handlers(old: dict[int, Any]) -> None:
    for sig, h in old.items():
        signal.signal(sig, h)

