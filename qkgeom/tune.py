"""Sweeps on Ray Tune: the only module in qkgeom that imports Ray.

One function trainable runs :func:`qkgeom.train.train` per trial and reports every probe
through ``tune.report`` with a ``tune.Checkpoint``; a failed trial restarts from its last
checkpoint (``FailureConfig.max_failures``) and ``train(resume_from=...)`` continues with
exactly the numbers an uninterrupted run produces.

Two kinds of saved state, both in the trial's Tune storage and in the ``checkpoints``
table: *resume* checkpoints (Tune's, full training state; :class:`DbWriter` prunes
superseded ones and deletes their rows in the same callback) and weight *snapshots* at
probe steps (``<trial dir>/snapshots/step_NNNNNNN``, written by the worker through the
storage's ``pyarrow.fs`` filesystem before the step is reported; kept per the sweep's
``snapshots`` policy and never pruned).

Results reach the database through :class:`DbWriter`, a driver-side Tune callback that is
the single writer (safe for SQLite): probe rows and the trial lifecycle (pending ->
running -> error | terminated, attempts, host, device, checkpoints). With
``direct_writes`` (PostgreSQL only) the workers write their own probe rows and the
callback keeps the lifecycle.

Pitfalls settled here (see ../shared/RAY.md):

* Tune pickles the whole ``RunConfig`` (callbacks included) into the experiment state and
  brings the callbacks back from that pickle on restore, so callbacks hold no engine and
  no database URL (it may carry a password): the URL lives in :data:`_DRIVER`, set by
  :func:`run_sweep` in the driver process.
* In ``on_trial_complete`` the trial still reads RUNNING: the callback writes the
  terminal state itself.
* Importing this module imports Ray; ``qkgeom --help`` and :mod:`qkgeom.sweep` do not.
"""

from __future__ import annotations

import json
import logging
import math
import os
import posixpath
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune import Callback

from qkgeom.errors import QkgeomError
from qkgeom.sweep import SweepPlan, TrialSpec, baseline_metric, build_plan, fill_baseline_pr

# Driver-process state that must never be pickled into the experiment (see module doc).
_DRIVER: dict[str, Any] = {}
EXPERIMENT_PREFIX = "qkgeom-"
STORAGE_KEY = "_ray_storage"  # in the stored spec: the Tune storage of the sweep's run


class SweepError(QkgeomError):
    """A sweep that cannot start or resume; the message says what to do."""


# ---------------------------------------------------------------------- the trainable
def _trial_device(cfg_device: str) -> str:
    """The device for this trial: the GPU Ray assigned (as ``cuda``), else the CPU."""
    if cfg_device != "auto":
        return cfg_device
    import torch

    try:
        gpu_ids = ray.get_gpu_ids()
    except Exception:  # outside a Ray worker
        gpu_ids = []
    if not gpu_ids:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        gpu_ids = [g for g in visible.split(",") if g.strip()]
    # Ray sets CUDA_VISIBLE_DEVICES to the assigned GPU(s), so "cuda" is the right one
    return "cuda" if gpu_ids and torch.cuda.is_available() else "cpu"


def _where() -> tuple[str, str]:
    try:
        node = ray.get_runtime_context().get_node_id() or ""
    except Exception:
        node = ""
    return socket.gethostname(), node


_CORPORA: dict[str, Any] = {}  # per worker process (actors are reused between trials)


def _corpus(dataset: str) -> Any:
    from qkgeom.data import load_corpus

    if dataset not in _CORPORA:
        _CORPORA.clear()  # one corpus at a time: they can be large
        _CORPORA[dataset] = load_corpus(dataset)
    return _CORPORA[dataset]


def storage_location(fs: Any, fs_path: str, storage_fs_path: str | None,
                     root: str | None) -> str:
    """Where ``fs_path`` on a Tune storage filesystem lives, as the database records it.

    A URI under ``root`` when the sweep's storage was given as one (``s3://b/x``,
    ``file:///x``), else a plain path on a local filesystem, else ``scheme://path``.
    ``pyarrow.fs.FileSystem.from_uri`` reads every form back.
    """
    if root and "://" in root and storage_fs_path:
        base, _, query = root.partition("?")
        rel = posixpath.relpath(fs_path, storage_fs_path)
        if not rel.startswith(".."):
            return base.rstrip("/") + "/" + rel + (f"?{query}" if query else "")
    kind = getattr(fs, "type_name", "local")
    if kind == "local":
        return fs_path
    scheme = {"s3": "s3", "gcs": "gs", "hdfs": "hdfs"}.get(kind, kind)
    return f"{scheme}://{fs_path}"


def _upload_snapshot(local: Path, step: int, root: str | None) -> str:
    """Copy a local weight snapshot to ``<trial dir>/snapshots/step_NNNNNNN`` in Tune's
    storage (S3/GCS/NFS/local, as the sweep's ``--storage``); returns its location."""
    import pyarrow.fs as pafs

    storage = tune.get_context().get_storage()
    fs = storage.storage_filesystem
    dest = f"{storage.trial_fs_path}/snapshots/step_{step:07d}"
    fs.create_dir(dest)
    # no threads: pyarrow's threaded upload to S3 is unsafe (arrow issue 32372)
    pafs.copy_files(str(local), dest, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs, use_threads=False)
    return storage_location(fs, dest, storage.storage_fs_path, root)


def trainable(config: dict[str, Any], db_url: str | None = None,
              finished: frozenset = frozenset(), storage_root: str | None = None) -> None:
    """Tune function trainable: one qkgeom trial (``config["trial"]`` is a TrialSpec dict).

    ``db_url`` (worker-direct writes only) arrives through ``tune.with_parameters``, i.e.
    Ray's object store, so the URL and its password never enter the pickled experiment.
    ``finished``: trial keys the database already has as terminated. On resume, Tune's
    experiment snapshot (taken every few seconds) may be older than the database and
    still list such a trial as running; it returns at once instead of training again.
    ``storage_root``: the sweep's ``--storage`` as given (a snapshot's recorded location is
    a URI under it when it is one).
    """
    from qkgeom.config import TrialConfig
    from qkgeom.records import ProbeRecord
    from qkgeom.sweep import snapshot_every
    from qkgeom.train import train

    spec = TrialSpec.from_dict(config["trial"])
    if spec.key in finished:
        return
    cfg_dict = dict(spec.config)
    cfg_dict["device"] = _trial_device(cfg_dict.get("device", "auto"))
    cfg = TrialConfig.from_dict(cfg_dict)
    host, node = _where()
    gpu_ids = [str(g) for g in ray.get_gpu_ids()]
    device = cfg.device + (f" gpu={','.join(gpu_ids)}" if gpu_ids else "")
    where = {"host": f"{host}/{node[:12]}" if node else host, "node_id": node, "device": device}

    direct = None
    if db_url:
        from qkgeom.store import open_store

        direct = open_store(db_url)
        trial_id = direct.trial_id(direct.require_sweep(config["sweep"]), spec.key)

    scratch = Path(tempfile.mkdtemp(prefix="qkgeom-ckpt-"))
    every = snapshot_every(config.get("snapshots", "all"))
    snaps = dict(snapshot_dir=scratch / "snapshots", snapshot_every=every) \
        if every is not None else {}

    def report(rec: ProbeRecord, ckpt: str | None) -> None:
        metrics = {"step": rec.step, "max_steps": cfg.max_steps, "val_loss": rec.val_loss,
                   "train_loss": rec.train_loss, "tokens_per_s": rec.tokens_per_s, **where}
        snap = scratch / "snapshots" / f"step_{rec.step:07d}"
        metrics["snapshot"] = ""
        if snap.is_dir():  # in storage before the driver records it
            metrics["snapshot"] = _upload_snapshot(snap, rec.step, storage_root)
            shutil.rmtree(snap, ignore_errors=True)
        if direct is not None:
            direct.write_probe(trial_id, rec)
            metrics["record"] = ""
        else:
            metrics["record"] = json.dumps(rec.to_dict())
        checkpoint = tune.Checkpoint.from_directory(ckpt) if ckpt else None
        tune.report(metrics, checkpoint=checkpoint)
        if ckpt:  # persisted to the run's storage by report(); the local copy can go
            shutil.rmtree(ckpt, ignore_errors=True)

    corpus = _corpus(cfg.dataset)
    try:
        ckpt = tune.get_checkpoint()
        if ckpt is None:
            result = train(cfg, report, checkpoint_dir=scratch, corpus=corpus, **snaps)
        else:
            with ckpt.as_directory() as d:
                result = train(cfg, report, checkpoint_dir=scratch, resume_from=d,
                               corpus=corpus, **snaps)
        # one last result, no record: DbWriter stores the trial's final test loss
        tune.report({"step": cfg.max_steps, "max_steps": cfg.max_steps, "record": "",
                     "test_loss": result.test_loss, **where})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if direct is not None:
            direct.close()


def trial_dirname(trial: Any) -> str:
    return f"{trial.config['trial']['key']}_{trial.trial_id}"


def trial_name(trial: Any) -> str:
    return trial.config["trial"]["key"]


# ---------------------------------------------------------------------- callbacks
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
        self._store: Any = None
        self._ids: dict[str, int] = {}
        self._seen: set[str] = set()  # trials whose current attempt has reported
        # trial id -> [(time registered, step, location, Checkpoint)]
        self._ckpts: dict[str, list] = {}

    def __getstate__(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        d.update(_store=None, _ids={}, _seen=set(), _ckpts={})
        return d

    @property
    def store(self) -> Any:
        if self._store is None:
            from qkgeom.store import open_store

            if "db_url" not in _DRIVER:
                raise SweepError("internal: the sweep driver has no database URL")
            self._store = open_store(_DRIVER["db_url"])
        return self._store

    def _tid(self, trial: Any) -> int:
        key = trial.config["trial"]["key"]
        if key not in self._ids:
            sid = self.store.require_sweep(self.sweep)
            tid = self.store.trial_id(sid, key)
            if tid is None:
                raise SweepError(f"trial {key} of sweep {self.sweep} is not in the database")
            self._ids[key] = tid
        return self._ids[key]

    @staticmethod
    def _finished(trial: Any) -> bool:
        return trial.config["trial"]["key"] in _DRIVER.get("finished", ())

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if self._finished(trial):  # done before a driver crash; the trainable skips it
            return
        self._seen.discard(trial.trial_id)
        self.store.set_trial_status(self._tid(trial), "running", bump_attempts=True)

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict,
                        **info: Any) -> None:
        from qkgeom.records import ProbeRecord

        tid = self._tid(trial)
        if trial.trial_id not in self._seen:
            self._seen.add(trial.trial_id)
            self.store.set_trial_status(tid, "running", host=result.get("host"),
                                        device=result.get("device"))
        rec = result.get("record")
        if rec:
            self.store.write_probe(tid, ProbeRecord.from_dict(json.loads(rec)))
        if result.get("snapshot") and result.get("step") is not None:
            self.store.add_checkpoint(tid, int(result["step"]), result["snapshot"],
                                      kind="snapshot")
        if "test_loss" in result:
            self.store.set_trial_result(tid, test_loss=result["test_loss"])

    def on_checkpoint(self, iteration: int, trials: list, trial: Any, checkpoint: Any,
                      **info: Any) -> None:
        step = (trial.last_result or {}).get("step")
        storage = getattr(trial, "storage", None)
        loc = storage_location(checkpoint.filesystem, str(checkpoint.path),
                               getattr(storage, "storage_fs_path", None),
                               _DRIVER.get("storage"))
        tid = self._tid(trial)
        if step is not None:
            self.store.add_checkpoint(tid, int(step), loc, kind="resume")
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
            if st is not None:
                self.store.delete_checkpoint(tid, int(st), kind="resume", location=where)
            lst.remove(item)

    def on_trial_recover(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self._seen.discard(trial.trial_id)
        self.store.set_trial_status(self._tid(trial), "pending", error=_error_text(trial))

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        self.store.set_trial_status(self._tid(trial), "error", error=_error_text(trial))

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        # trial.status still reads RUNNING here: write the terminal state ourselves
        if self._finished(trial):
            return
        last = trial.last_result or {}
        if _DRIVER.get("interrupted") and last.get("step") != last.get("max_steps"):
            return  # stopped by a signal, not finished: run_sweep records it as interrupted
        self.store.set_trial_status(self._tid(trial), "terminated")

    def on_experiment_end(self, trials: list, **info: Any) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


def _exists(fs: Any, path: str) -> bool:
    import pyarrow.fs as pafs

    try:
        return fs.get_file_info(path).type != pafs.FileType.NotFound
    except Exception:
        return True  # cannot tell: keep the row


def _fmt_s(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(round(s))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class Progress(Callback):
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
        """Counts over the whole plan (``_DRIVER["plan_steps"]``: key -> max_steps), so the
        total is the same from the first line on: trials Tune has not created yet are
        pending, trials the database already holds as finished are done."""
        counts = {"done": 0, "running": 0, "failed": 0, "pending": 0}
        steps = total = 0
        plan: dict[str, int] = dict(_DRIVER.get("plan_steps") or {})
        finished = set(_DRIVER.get("finished_before") or ()) | set(_DRIVER.get("finished", ()))
        seen = set()
        for t in trials:
            key = t.config["trial"]["key"]
            seen.add(key)
            ms = int(t.config["trial"]["config"]["max_steps"])
            total += ms
            st = "TERMINATED" if key in finished else t.status
            if st == "TERMINATED":
                counts["done"] += 1
                steps += ms
                continue
            steps += int((t.last_result or {}).get("step", 0) or 0)
            if st == "ERROR":
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
        text = (f"[{_fmt_s(now - self._t0):>6}] {state} | steps {steps}/{total} "
                f"({100 * steps / max(total, 1):.0f}%) | ETA {_fmt_s(eta)}")
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
        if _DRIVER.get("interrupted"):
            _forward_stop()  # a signal that came before Tune's own handler was installed

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
        if _DRIVER.get("interrupted"):
            return  # Tune's view of stopped trials is not the record; the CLI prints that
        self._maybe_print(trials, force=True)


# ---------------------------------------------------------------------- the driver
@dataclass
class SweepOptions:
    """How to run a sweep (resources, where, resume); see ``qkgeom sweep --help``."""

    db_url: str | None = None
    address: str | None = None  # join a running Ray cluster ("auto" on a head node)
    storage: str | None = None  # Tune storage root; shared storage on a multi-node cluster
    resume: bool = False
    cpus_per_trial: float = 1.0
    gpus_per_trial: float | None = None  # None: 0.25 when the cluster has GPUs, else 0
    max_concurrent: int | None = None
    max_failures: int = 2
    direct_writes: bool = False
    # superseded resume checkpoints older than this are pruned (tests shorten it)
    prune_age_s: float = 60.0
    progress_every_s: float = 10.0
    num_cpus: int | None = None  # local Ray only (default: all cores)
    ray_temp_dir: str | None = None  # local Ray only (default: a fresh dir under /tmp)
    quiet: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)


def default_storage() -> str:
    return os.environ.get("QKGEOM_RAY_STORAGE") or str(Path.home() / "ray_results")


def experiment_path(name: str, storage: str | None = None) -> str:
    return _join(storage or default_storage(), f"{EXPERIMENT_PREFIX}{name}")


def _join(storage: str, name: str) -> str:
    """``storage/name`` for a path or a URI (``Path`` would turn ``s3://b`` into ``s3:/b``)."""
    if "://" in storage:
        base, _, query = storage.partition("?")
        return base.rstrip("/") + "/" + name + (f"?{query}" if query else "")
    return str(Path(storage).expanduser() / name)


def code_version() -> str:
    """``__version__+h<content hash>``: the shipped wheel's version on a cluster node."""
    from qkgeom.ship import code_version as shipped_version

    return shipped_version()


def _absolute_sqlite(url: str) -> str:
    """SQLite paths made absolute so that trials and later shells find the same file."""
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        path = url[len("sqlite:///"):]
        if path and path != ":memory:" and not path.startswith("/"):
            return "sqlite:///" + str(Path(path).resolve())
    return url


def _init_ray(opts: SweepOptions) -> None:
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")  # no TB/CSV/JSON spam
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")  # resume loses little after a kill
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # with verbose=0: no Ray tables
    for name in ("ray", "ray.train", "ray.data"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # Tune logs every trial failure with a full traceback; Progress prints one line
    # instead and the database keeps the error text
    logging.getLogger("ray.tune").setLevel(logging.CRITICAL)
    env = dict(opts.extra_env)
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = dict(logging_level=logging.ERROR, log_to_driver=False,
                                  include_dashboard=False, configure_logging=True)
    if env:
        kwargs["runtime_env"] = {"env_vars": env}
    if opts.address:
        ray.init(address=opts.address, **kwargs)
    else:
        tmp = opts.ray_temp_dir
        if tmp is None:  # ours: removed again by shutdown()
            tmp = _DRIVER["ray_tmp"] = tempfile.mkdtemp(prefix="qkray-", dir="/tmp")
        ray.init(num_cpus=opts.num_cpus or os.cpu_count() or 1, _temp_dir=tmp, **kwargs)
init_ray = _init_ray


def _local_gpus() -> int:
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:
        return 0


def check_resources(opts: SweepOptions) -> None:
    """Refuse a sweep whose trials can never be placed (they would wait forever).

    Local Ray: against this machine's CPUs (``num_cpus``) and GPUs. A running cluster
    (``--address``) may grow through its autoscaler, so it is only warned about, after
    connecting (:func:`_warn_unplaceable`); ``--cluster`` checks the cluster file's node
    types (:func:`check_cluster_resources`).
    """
    if opts.max_concurrent is not None and opts.max_concurrent < 1:
        raise SweepError("--max-concurrent must be at least 1 (leave it out for no limit)")
    if opts.address is not None:
        return
    cpus = opts.num_cpus or os.cpu_count() or 1
    if opts.cpus_per_trial > cpus:
        raise SweepError(f"--cpus-per-trial {opts.cpus_per_trial:g} is more than this "
                         f"machine's {cpus} CPUs: no trial could ever start; use at most {cpus}")
    gpus = opts.gpus_per_trial or 0.0
    if gpus > 0:
        have = _local_gpus()
        if gpus > have:
            raise SweepError(f"--gpus-per-trial {gpus:g} is more than this machine's {have} "
                             f"GPU(s): no trial could ever start; use at most {have}"
                             + (" (or drop it: CPU trials)" if have == 0 else ""))


def _warn_unplaceable(cpus: float, gpus: float, say: Any) -> None:
    """Warn when no live node of a running cluster fits one trial right now."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if nodes and not any(r.get("CPU", 0) >= cpus and r.get("GPU", 0) >= gpus for r in nodes):
        say(f"warning: no node of the cluster has {cpus:g} CPU and {gpus:g} GPU free for one "
            "trial now; trials stay pending until the autoscaler adds such a node")


def check_cluster_resources(cfg: dict[str, Any], where: str, cpus: float,
                            gpus: float | None) -> None:
    """Refuse per-trial resources that no node type of a cluster file declares."""
    types = cfg.get("available_node_types") or {}
    head = cfg.get("head_node_type")
    declared = [t.get("resources") for n, t in types.items()
                if n != head or len(types) == 1]
    if not declared or any(r is None or "CPU" not in r for r in declared):
        return  # some node type's size is detected at launch: cannot know in advance
    fits = [r for r in declared if float(r.get("CPU", 0)) >= cpus
            and float(r.get("GPU", 0)) >= (gpus or 0)]
    if not fits:
        most_c = max(float(r.get("CPU", 0)) for r in declared)
        most_g = max(float(r.get("GPU", 0)) for r in declared)
        raise SweepError(f"{where}: no node type has {cpus:g} CPU and {gpus or 0:g} GPU for "
                         f"one trial (the largest: {most_c:g} CPU, {most_g:g} GPU); lower "
                         "--cpus-per-trial/--gpus-per-trial or declare a larger node type")


def _gpus_per_trial(opts: SweepOptions) -> float:
    if opts.gpus_per_trial is not None:
        return float(opts.gpus_per_trial)
    return 0.25 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0


def _plain_spec(spec: dict | None) -> dict | None:
    """A stored spec without the run bookkeeping (:data:`STORAGE_KEY`)."""
    if spec is None:
        return None
    return {k: v for k, v in spec.items() if k != STORAGE_KEY}


def stored_storage(db_url: str, name: str) -> str | None:
    """The Tune storage the sweep's last run used, as recorded in the database."""
    from qkgeom.store import open_store

    store = open_store(db_url, create=False, readonly=True)
    try:
        spec = store.sweep_spec(name)
    finally:
        store.close()
    return None if spec is None else spec.get(STORAGE_KEY)


def prepare_db(plan: SweepPlan, db_url: str, *, resume: bool, threads: int,
               storage: str | None = None) -> tuple[int, int]:
    """Insert the sweep and every trial (pending) before anything runs.

    Returns ``(sweep_id, n_interrupted)``; on resume, rows a dead driver left ``running``
    become ``interrupted`` first. ``storage`` (the Tune storage root of this run) is
    recorded in the stored spec under :data:`STORAGE_KEY`, for later resumes.
    """
    from qkgeom.store import open_store

    store = open_store(db_url)
    try:
        raw = store.sweep_spec(plan.name)
        stored = _plain_spec(raw)
        storage = storage or (raw or {}).get(STORAGE_KEY)  # keep the recorded one
        if stored is not None and not resume:
            raise SweepError(
                f"sweep {plan.name!r} already exists in {store.safe_url}; continue it with "
                f"qkgeom sweep --resume --name {plan.name} (or pick another --name: "
                "rerunning into it would mix the old and new runs' probes)")
        if stored is not None and stored != json.loads(json.dumps(plan.spec)):
            raise SweepError(
                f"sweep {plan.name!r} in {store.safe_url} was started with a different spec; "
                f"resume it as stored with qkgeom sweep --resume --name {plan.name} (no "
                "--preset/--spec/--set), or start a new --name")
        spec = dict(plan.spec, **({STORAGE_KEY: storage} if storage else {}))
        sid = store.ensure_sweep(plan.name, spec, code_version())
        n_int = store.mark_running_interrupted(sid) if resume else 0
        for t in plan.trials:
            cfg = dict(t.config, threads=threads)
            store.ensure_trial(sid, t.key, cfg, depth=t.depth, init=t.init, arm=t.arm,
                               seed=t.seed, status="pending")
        return sid, n_int
    finally:
        store.close()


def plan_for_resume(name: str, db_url: str) -> SweepPlan:
    """Rebuild the plan of sweep ``name`` from the spec stored in the database.

    Opens the database without creating it: a resume of a sweep that is not there
    leaves no new file or schema behind.
    """
    from qkgeom.store import open_store
    from qkgeom.store.engine import sqlite_path

    path = sqlite_path(db_url) if db_url.startswith("sqlite") else None
    if path is not None and not Path(path).exists():
        raise SweepError(f"no sweep named {name!r} to resume: there is no database at {path} "
                         "(check --db; start a new sweep without --resume)")
    store = open_store(db_url, create=False, readonly=True)
    try:
        sweeps = store.sweeps()
        row = sweeps.filter(sweeps["name"] == name)
        if row.height == 0:
            names = ", ".join(sweeps["name"].to_list()) or "none"
            raise SweepError(f"no sweep named {name!r} in {store.safe_url} (sweeps: {names}); "
                             "start it without --resume")
        spec = _plain_spec(json.loads(row["spec"][0]))
    finally:
        store.close()
    return build_plan(spec, name=name)


def _with_threads(t: TrialSpec, threads: int) -> dict[str, Any]:
    d = t.to_dict()
    d["config"] = dict(t.config, threads=threads)
    return d


def _baseline_prs(db_url: str, sweep: str, plan: SweepPlan) -> dict[tuple[str, str], list]:
    """(baseline key, metric) -> layer-level rows (step, layer, value) that the arms need
    (metric: :func:`qkgeom.sweep.baseline_metric` of the arm's config)."""
    from qkgeom.store import open_store

    keys = sorted({(t.baseline_key, baseline_metric(t.config)) for t in plan.trials
                   if t.needs_baseline and t.baseline_key})
    out: dict[tuple[str, str], list] = {}
    store = open_store(db_url)
    try:
        sid = store.require_sweep(sweep)
        for k, metric in keys:
            tid = store.trial_id(sid, k)
            df = store.sql(
                "SELECT step, layer, value FROM probe_metrics WHERE trial_id = :t "
                "AND metric = :m AND head IS NULL ORDER BY step, layer", {"t": tid, "m": metric})
            out[(k, metric)] = list(df.iter_rows())
    finally:
        store.close()
    return out


def _run_phase(plan: SweepPlan, trials: list[TrialSpec], exp_name: str, opts: SweepOptions,
               storage: str, threads: int, gpus: float) -> Any:
    path = _join(storage, exp_name)
    resources = {"cpu": opts.cpus_per_trial, "gpu": gpus}
    direct_url = _DRIVER["db_url"] if opts.direct_writes else None
    restore = tune.Tuner.can_restore(path)
    if restore and not opts.resume:
        raise SweepError(f"sweep {plan.name!r} already has a Ray experiment at {path}; "
                         f"continue it with: qkgeom sweep --resume --name {plan.name} "
                         "(or pick another --name)")
    finished = frozenset()
    if opts.resume:  # the database, not Tune's snapshot, decides what is finished
        statuses = trial_statuses(_DRIVER["db_url"], plan.name)
        finished = frozenset(k for k, v in statuses.items() if v == "terminated")
    if opts.resume and not restore:
        # no Tune experiment here (another --storage, or it was deleted): run only what
        # the database does not hold as finished, from scratch, in a new experiment
        todo = [t for t in trials if t.key not in finished]
        say = _DRIVER.get("say", print)
        if not todo:
            say(f"no Ray experiment at {path}, and the database holds all {len(trials)} "
                "trial(s) as finished: nothing to run")
            return None
        if len(todo) < len(trials):
            say(f"no Ray experiment at {path}: running the {len(todo)} unfinished trial(s) "
                f"of {len(trials)} afresh; the {len(trials) - len(todo)} finished stay as "
                "stored")
        trials = todo
        finished = frozenset()
    _DRIVER["finished"] = finished
    fn = tune.with_resources(
        tune.with_parameters(trainable, db_url=direct_url, finished=finished,
                             storage_root=storage), resources)
    if restore:
        tuner = tune.Tuner.restore(path, fn, resume_unfinished=True, resume_errored=True)
    else:
        space = {"trial": tune.grid_search([_with_threads(t, threads) for t in trials]),
                 "sweep": plan.name, "snapshots": plan.snapshots}
        tuner = tune.Tuner(
            fn,
            param_space=space,
            tune_config=tune.TuneConfig(
                max_concurrent_trials=opts.max_concurrent or None,
                trial_dirname_creator=trial_dirname,
                trial_name_creator=trial_name,
                # one process per concurrent slot: torch/ray imports (~7 s) paid once
                reuse_actors=True,
            ),
            run_config=tune.RunConfig(
                name=exp_name,
                storage_path=storage,
                failure_config=tune.FailureConfig(max_failures=opts.max_failures),
                # Tune keeps every checkpoint; DbWriter prunes them safely (see _prune)
                checkpoint_config=tune.CheckpointConfig(num_to_keep=None),
                callbacks=[DbWriter(plan.name, opts.direct_writes,
                                    keep_recent_s=opts.prune_age_s),
                           Progress(opts.progress_every_s)],
                verbose=0,
            ),
        )
    _DRIVER["in_fit"], _DRIVER["forwarded"] = True, False
    try:
        return tuner.fit()
    finally:
        _DRIVER["in_fit"] = False


# ---------------------------------------------------------------------- signals
def _on_signal(signum: int, frame: Any) -> None:
    """SIGINT/SIGTERM in the driver: stop Tune gracefully (once), then record the truth.

    Inside ``fit`` the stop goes through Tune's own SIGUSR1 handler (the graceful path:
    trials stop, the experiment state is saved); :func:`run_sweep` then marks the trials
    that were running as ``interrupted``. A second signal, or one outside ``fit``, raises
    KeyboardInterrupt at once.
    """
    if _DRIVER.get("interrupted") or not _DRIVER.get("in_fit"):
        _DRIVER.setdefault("interrupted", signal.Signals(signum).name)
        raise KeyboardInterrupt
    _DRIVER["interrupted"] = signal.Signals(signum).name
    _forward_stop(final=False)


def _forward_stop(final: bool = True) -> None:
    """Ask Tune to stop, through the handler ``fit`` installs for SIGUSR1 (if it has).

    From the signal handler the installed one may still be an older ``fit``'s (the
    signal came before this one's setup), so it is called again from Tune's loop
    (``Progress.on_step_begin``, ``final=True``) once, where it is this ``fit``'s."""
    h = signal.getsignal(signal.SIGUSR1)
    if callable(h) and h is not _on_signal and not _DRIVER.get("forwarded"):
        _DRIVER["forwarded"] = final
        h(signal.SIGUSR1, None)


def _install_signal_handlers() -> dict[int, Any]:
    import threading

    if threading.current_thread() is not threading.main_thread():
        return {}
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # ours forwards to Tune's SIGUSR1
    old = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        old[sig] = signal.getsignal(sig)
        signal.signal(sig, _on_signal)
    return old


def _restore_signal_handlers(old: dict[int, Any]) -> None:
    for sig, h in old.items():
        signal.signal(sig, h)


def mark_interrupted(db_url: str, sweep: str, why: str) -> int:
    """Trials of ``sweep`` still ``running`` -> ``interrupted``, the step they reached
    (their last probe) in the error column. Returns how many."""
    from qkgeom.store import open_store

    store = open_store(db_url)
    try:
        sid = store.require_sweep(sweep)
        trials = store.trials(sweep).filter(status="running")
        if trials.height == 0:
            return 0
        last = dict(store.sql(
            "SELECT p.trial_id, MAX(p.step) AS step FROM probes p JOIN trials t "
            "ON t.id = p.trial_id WHERE t.sweep_id = :s GROUP BY p.trial_id",
            {"s": sid}).iter_rows())
        for tid, cfg in zip(trials["id"], trials["config"]):
            ms = json.loads(cfg).get("max_steps")
            step = last.get(tid)
            at = "before its first probe" if step is None else \
                f"at step {step} of {ms} (its last probe)"
            store.set_trial_status(int(tid), "interrupted",
                                   error=f"interrupted by {why} {at}")
        return trials.height
    finally:
        store.close()


def run_sweep(plan: SweepPlan, opts: SweepOptions) -> dict[str, Any]:
    """Run (or resume) ``plan`` on Ray Tune, writing results to ``opts.db_url``.

    Returns a summary: ``{"name", "wall_s", "trials": {key: status}, "errors": n}``.
    """
    from qkgeom.store import resolve_url

    t0 = time.perf_counter()
    db_url = _absolute_sqlite(resolve_url(opts.db_url))
    if opts.direct_writes and not db_url.startswith("postgresql"):
        raise SweepError("--direct-writes needs a PostgreSQL database: SQLite cannot take "
                         "concurrent writers from many Ray workers; drop --direct-writes to "
                         "let the driver write (the default)")
    storage = str(Path(opts.storage or default_storage()).expanduser().resolve()
                  if "://" not in (opts.storage or "") else opts.storage)
    threads = max(1, int(opts.cpus_per_trial))
    path = experiment_path(plan.name, storage)
    if opts.resume and opts.storage is None:  # no --storage: the one the sweep ran with
        try:
            storage = stored_storage(db_url, plan.name) or storage
        except QkgeomError:
            pass
        path = experiment_path(plan.name, storage)
    if opts.resume:
        _check_resume_storage(plan.name, db_url, storage)
    if not opts.resume and tune.Tuner.can_restore(path):  # refuse before starting Ray
        raise SweepError(f"sweep {plan.name!r} already has a Ray experiment at {path}; "
                         f"continue it with: qkgeom sweep --resume --name {plan.name} "
                         "(or pick another --name)")
    check_resources(opts)  # before anything is created or started
    # local Ray: the corpus is downloaded and encoded here, once, before any trial starts (a
    # bad --data fails here). On a cluster the first trial on each node does it and the
    # node's other trials wait on the cache's lock (qkgeom.data), then open the result.
    if opts.address is None:
        for dataset in sorted({t.config.get("dataset", "default") for t in plan.trials}):
            _corpus(dataset)
    sid, n_int = prepare_db(plan, db_url, resume=opts.resume, threads=threads,
                            storage=storage)
    say = (lambda *a: None) if opts.quiet else (lambda *a: print(*a, flush=True))
    if n_int:
        say(f"marked {n_int} trial(s) left running by a dead driver as interrupted")
    _DRIVER["db_url"] = db_url
    _DRIVER["storage"] = storage
    _DRIVER["say"] = say
    for k in ("interrupted", "forwarded"):
        _DRIVER.pop(k, None)
    _DRIVER["plan_steps"] = {t.key: int(t.config["max_steps"]) for t in plan.trials}
    _DRIVER["finished_before"] = frozenset(
        k for k, v in trial_statuses(db_url, plan.name).items() if v == "terminated")
    try:
        return _run(plan, opts, db_url, storage, threads, sid, t0, say)
    except KeyboardInterrupt:
        why = _DRIVER.get("interrupted") or "SIGINT"
        try:
            mark_interrupted(db_url, plan.name, why)
        except Exception:  # the record is best effort on a hard stop; resume fixes it
            pass
        raise
    finally:
        _restore_signal_handlers(_DRIVER.pop("old_handlers", {}))


def _check_resume_storage(name: str, db_url: str, storage: str) -> None:
    """Refuse a resume pointed at the wrong Tune storage while the sweep's experiment
    exists at the storage its last run recorded (it would lose the trials' checkpoints)."""
    try:
        first = stored_storage(db_url, name)
    except QkgeomError:
        return  # no database or no sweep yet: nothing recorded
    if not first or first == storage or tune.Tuner.can_restore(experiment_path(name, storage)):
        return
    try:
        there = tune.Tuner.can_restore(experiment_path(name, first))
    except Exception:  # unreachable storage: resume here, from the database
        there = False
    if there:
        raise SweepError(f"sweep {name!r} ran with --storage {first}, where its Ray "
                         f"experiment is; resume it with: qkgeom sweep --resume --name {name} "
                         f"--storage {first}")


def _run(plan: SweepPlan, opts: SweepOptions, db_url: str, storage: str, threads: int,
         sid: int, t0: float, say: Any) -> dict[str, Any]:
    from qkgeom.store import safe_url

    _init_ray(opts)
    # after ray.init, whose core worker installs its own SIGTERM handler (it logs and dies)
    _DRIVER["old_handlers"] = _install_signal_handlers()
    gpus = _gpus_per_trial(opts)
    if opts.address is not None:
        _warn_unplaceable(opts.cpus_per_trial, gpus, say)
    say(f"sweep {plan.name}: {len(plan.trials)} trials, {opts.cpus_per_trial:g} CPU and "
        f"{gpus:g} GPU per trial, database {safe_url(db_url)}, Ray storage "
        f"{experiment_path(plan.name, storage)}")
    first = [t for t in plan.trials if not t.needs_baseline]
    later = [t for t in plan.trials if t.needs_baseline]
    _run_phase(plan, first, f"{EXPERIMENT_PREFIX}{plan.name}", opts, storage, threads, gpus)
    if later and not _DRIVER.get("interrupted"):
        # arms whose target is a fraction of the paired baseline's W_K PR: fill it from the
        # baselines that just finished, then run them as a second experiment
        prs = _baseline_prs(db_url, plan.name, plan)
        filled = []
        for t in later:
            cfg = fill_baseline_pr(t.config,
                                   prs.get((t.baseline_key or "", baseline_metric(t.config)), []))
            filled.append(TrialSpec.from_dict(dict(t.to_dict(), config=cfg)))
        _store_configs(db_url, plan.name, filled, threads)
        say(f"sweep {plan.name}: {len(filled)} arm trial(s) with baseline-relative targets")
        _run_phase(plan, filled, f"{EXPERIMENT_PREFIX}{plan.name}-arms", opts, storage,
                   threads, gpus)
    why = _DRIVER.get("interrupted")
    if why:
        mark_interrupted(db_url, plan.name, why)
    statuses = trial_statuses(db_url, plan.name)
    return {"name": plan.name, "wall_s": time.perf_counter() - t0, "trials": statuses,
            "errors": sum(1 for s in statuses.values() if s != "terminated"),
            "db_url": db_url, "sweep_id": sid, "interrupted": why}


def _store_configs(db_url: str, sweep: str, trials: list[TrialSpec], threads: int) -> None:
    from qkgeom.store import open_store

    store = open_store(db_url)
    try:
        sid = store.require_sweep(sweep)
        for t in trials:
            store.ensure_trial(sid, t.key, dict(t.config, threads=threads), depth=t.depth,
                               init=t.init, arm=t.arm, seed=t.seed)
    finally:
        store.close()


def trial_statuses(db_url: str, sweep: str) -> dict[str, str]:
    from qkgeom.store import open_store

    store = open_store(db_url)
    try:
        df = store.trials(sweep)
        return dict(zip(df["trial_key"].to_list(), df["status"].to_list()))
    finally:
        store.close()


def shutdown() -> None:
    """Disconnect from Ray (stopping a local instance) and remove our scratch dir.

    A local instance's processes (GCS, raylet, workers: all descendants of this driver)
    are waited for and, if still there after a few seconds, killed: none outlives us.
    """
    procs = []
    if ray.is_initialized():
        if "ray_tmp" in _DRIVER:
            try:
                import psutil

                procs = psutil.Process().children(recursive=True)
            except Exception:
                procs = []
        ray.shutdown()
    if procs:
        import psutil

        _, alive = psutil.wait_procs(procs, timeout=15)
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=5)
    tmp = _DRIVER.pop("ray_tmp", None)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use: qkgeom sweep --help")


# ---------------------------------------------------------------------- clusters
class ClusterConfigError(QkgeomError):
    """An invalid cluster file; the message names the key."""


# where each cloud's node_config names the machine (Ray leaves node_config free-form)
INSTANCE_KEYS = {"aws": ("InstanceType",), "gcp": ("machineType",),
                 "azure": ("azure_arm_parameters", "vmSize")}
_COMMAND_KEYS = ("setup_commands", "head_setup_commands", "worker_setup_commands",
                 "initialization_commands")


def _schema_path(err: Any) -> str:
    return ".".join(str(p) for p in err.absolute_path) or "(top level)"


def validate_cluster_file(path: str | Path) -> dict[str, Any]:
    """Validate a Ray cluster launcher file offline; return it (as read) or raise.

    Three layers: Ray's JSON schema (types, unknown keys), our own checks (head_node_type,
    instance types, qkgeom installed, GPU workers, a head without trials), then Ray's own
    ``prepare_config`` + ``validate_config`` (node types, worker counts).
    """
    import jsonschema
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ClusterConfigError(f"cluster file {str(p)!r} not found")
    try:
        cfg = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ClusterConfigError(f"{p}: cannot parse YAML: {e}") from None
    if not isinstance(cfg, dict):
        raise ClusterConfigError(f"{p}: expected a mapping at the top level")
    where = str(p)

    schema_file = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    schema = json.loads(schema_file.read_text())
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(cfg),
                    key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        raise ClusterConfigError(f"{where}: {_schema_path(e)}: {e.message}")

    provider = cfg.get("provider") or {}
    ptype = provider.get("type")
    if not ptype:
        raise ClusterConfigError(f"{where}: provider.type: missing (aws, gcp, local, ...)")
    from ray.autoscaler._private.providers import _NODE_PROVIDERS

    known = sorted(set(_NODE_PROVIDERS) - {"fake_multinode_docker"})
    if ptype not in _NODE_PROVIDERS:
        import difflib

        near = difflib.get_close_matches(str(ptype), known, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise ClusterConfigError(f"{where}: provider.type: unknown cloud {ptype!r}; {hint}"
                                 f"use one of {', '.join(known)}")
    types = cfg.get("available_node_types")
    if ptype != "local" and not types:
        raise ClusterConfigError(f"{where}: available_node_types: missing; declare a head "
                                 "node type and GPU worker node types")
    if types:
        head = cfg.get("head_node_type")
        if not head:
            raise ClusterConfigError(f"{where}: head_node_type: missing; name one of "
                                     f"available_node_types ({', '.join(types)})")
        if head not in types:
            raise ClusterConfigError(f"{where}: head_node_type: {head!r} is not in "
                                     f"available_node_types ({', '.join(types)})")
        for name, nt in types.items():
            keys = INSTANCE_KEYS.get(ptype)
            if keys:
                node = nt.get("node_config") or {}
                for k in keys:
                    node = node.get(k) if isinstance(node, dict) else None
                if not node:
                    raise ClusterConfigError(
                        f"{where}: available_node_types.{name}.node_config."
                        f"{'.'.join(keys)}: missing (the {ptype} instance type)")
        workers = {n: t for n, t in types.items() if n != head and t.get("max_workers", 1)}
        for name, nt in workers.items():
            if float((nt.get("resources") or {}).get("GPU", 0)) <= 0:
                raise ClusterConfigError(
                    f"{where}: available_node_types.{name}.resources.GPU: missing; declare "
                    "the worker's GPUs (e.g. resources: {CPU: 4, GPU: 1}) so that the "
                    "autoscaler can place GPU trials")
        head_res = types[head].get("resources") or {}
        if workers and head_res.get("CPU", 1) != 0:
            raise ClusterConfigError(
                f"{where}: available_node_types.{head}.resources: the head must run no "
                "trials: set resources: {CPU: 0, GPU: 0} (the driver and database live there)")
    from qkgeom.ship import ShipError, check_installs

    try:
        check_installs(cfg, where)
    except ShipError as e:
        raise ClusterConfigError(str(e)) from None

    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        prepared = prepare_config(json.loads(json.dumps(cfg)))
        validate_config(prepared)
    except Exception as e:  # Ray raises ValueError/jsonschema errors with its own text
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ClusterConfigError(f"{where}: rejected by Ray's cluster launcher: {msg}") \
            from None
    return cfg


def check_ssh_keys(cfg: dict[str, Any], where: str) -> None:
    """Refuse SSH key files the cluster file names but this machine lacks (checked at
    launch, not by :func:`validate_cluster_file`: a file valid here may name keys that
    exist only on the machine that launches it)."""
    auth = cfg.get("auth") or {}
    for key in ("ssh_private_key", "ssh_public_key"):
        if auth.get(key) and not Path(str(auth[key])).expanduser().is_file():
            raise ClusterConfigError(
                f"{where}: auth.{key}: {auth[key]} does not exist; create the key pair "
                f"(ssh-keygen -t ed25519 -f {auth[key]}) or fix the path")


def _q(s: str) -> str:
    import shlex

    return shlex.quote(s)


def remote_sweep_command(name: str, *, spec_remote: str | None, preset: str | None,
                         data: str | None, sets: tuple[str, ...] | list[str],
                         db: str | None, resume: bool, gpus_per_trial: float | None,
                         cpus_per_trial: float, max_concurrent: int | None,
                         max_failures: int, direct_writes: bool, storage: str | None,
                         logdir: str = "~/qkgeom-sweeps", address: str = "auto",
                         snapshots: str | None = None) -> str:
    """The shell line that starts the sweep driver on the head, detached from SSH."""
    args = ["sweep", "--address", address, "--name", name]
    if spec_remote:
        args += ["--spec", spec_remote]
    elif preset:
        args += ["--preset", preset]
    for k, v in (("--data", data), ("--db", db), ("--storage", storage),
                 ("--snapshots", snapshots)):
        if v:
            args += [k, v]
    for s in sets:
        args += ["--set", s]
    if resume:
        args.append("--resume")
    if direct_writes:
        args.append("--direct-writes")
    if gpus_per_trial is not None:
        args += ["--gpus-per-trial", f"{gpus_per_trial:g}"]
    if max_concurrent:
        args += ["--max-concurrent", str(max_concurrent)]
    args += ["--cpus-per-trial", f"{cpus_per_trial:g}", "--max-failures", str(max_failures),
             "--progress-every", "30"]
    line = " ".join(_q(a) for a in args)
    log = f"{logdir}/{name}.log"
    # the cluster files install qkgeom into ~/qkgeom-venv; other nodes find it on PATH
    return (f'export PATH="$HOME/qkgeom-venv/bin:$PATH"; mkdir -p {logdir} && '
            f"cd {logdir} && (setsid nohup qkgeom {line} > {log} 2>&1 < /dev/null &) && "
            f"echo started: {log}")


def head_address(cfg: dict[str, Any]) -> str:
    """The address the driver on the head uses: the head's own GCS via localhost.

    ``auto`` can pick the wrong interface (or another Ray instance on a shared machine);
    the port comes from ``ray start --head --port=N`` in head_start_ray_commands.
    """
    import re

    for c in cfg.get("head_start_ray_commands") or []:
        m = re.search(r"ray start[^;&|]*--head[^;&|]*?--port[= ](\d+)", str(c))
        if m:
            return f"127.0.0.1:{m.group(1)}"
    return "127.0.0.1:6379"


def launch_on_cluster(cluster_file: str, *, plan: SweepPlan | None, name: str,
                      spec_file: str | None, preset: str | None, data: str | None,
                      sets: tuple[str, ...] | list[str], db: str | None, resume: bool,
                      gpus_per_trial: float | None, cpus_per_trial: float,
                      max_concurrent: int | None, max_failures: int, direct_writes: bool,
                      storage: str | None, dry_run: bool = False,
                      out: Any = print, snapshots: str | None = None) -> dict[str, Any]:
    """Validate the cluster file, ship qkgeom, start/update the cluster, run the driver.

    The spec is validated here first (``plan``), so a bad spec never starts machines.
    What is launched is a derived copy of the file (:mod:`qkgeom.ship`): the running
    qkgeom as a wheel (and a local ``--data``) in ``file_mounts``. ``dry_run`` prints that
    file and the remote command and starts nothing.
    """
    import tempfile

    import yaml

    from qkgeom import ship

    cfg = validate_cluster_file(cluster_file)
    types = cfg.get("available_node_types") or {}
    has_gpu_workers = any(float((t.get("resources") or {}).get("GPU", 0)) > 0
                          for n, t in types.items() if n != cfg.get("head_node_type"))
    if gpus_per_trial is None and has_gpu_workers:
        gpus_per_trial = 0.25  # the autoscaler sees no GPU before a worker exists
    check_cluster_resources(cfg, cluster_file, cpus_per_trial, gpus_per_trial)
    check_ssh_keys(cfg, cluster_file)
    if has_gpu_workers and not (storage and "://" in storage):
        out("warning: a multi-node cluster needs shared Tune storage; pass --storage "
            "s3://... or gs://... (a head-local path fails once trials run on workers)")
    if db and db.startswith("sqlite") or (db and "://" not in db):
        out(f"note: the SQLite database {db} lives on the head node")
    local_data = ship.data_to_ship(data)  # a too-large corpus is refused before any build
    tmp = Path(tempfile.mkdtemp(prefix="qkgeom-cluster-"))
    shipped = None
    if ship.ships_wheel(cfg):
        shipped = ship.build_wheel(tmp)
        out(f"shipping qkgeom {shipped.version} ({shipped.wheel})")
    else:
        out(f"note: {cluster_file} installs qkgeom itself (no $QKGEOM_WHEEL): the nodes run "
            "that qkgeom, not this one")
    derived, remote_data = ship.derive_cluster_config(cfg, shipped, local_data)
    derived_file = str(ship.write_cluster_file(derived, tmp, Path(cluster_file).stem))
    spec_remote = f"~/qkgeom-sweeps/{name}{Path(spec_file).suffix}" if spec_file else None
    cmd = remote_sweep_command(
        name, spec_remote=spec_remote, preset=preset if not spec_file else None,
        data=remote_data or data, sets=sets, db=db, resume=resume,
        gpus_per_trial=gpus_per_trial, cpus_per_trial=cpus_per_trial,
        max_concurrent=max_concurrent, max_failures=max_failures,
        direct_writes=direct_writes, storage=storage, address=head_address(cfg),
        snapshots=snapshots)
    if dry_run:
        out(f"dry run: nothing started. derived cluster file {derived_file}:\n"
            f"{yaml.safe_dump(derived, sort_keys=False)}\nremote command (on the head):\n{cmd}")
        return {"command": cmd, "cluster_file": derived_file, "shipped": shipped}

    from ray.autoscaler import sdk

    out(f"starting/updating the Ray cluster of {cluster_file} (ray up {derived_file}) ...")
    t0 = time.perf_counter()
    try:
        sdk.create_or_update_cluster(derived_file, no_restart=False, restart_only=False,
                                     no_config_cache=True)
    except Exception as e:
        msg = ship.credentials_error(e, cluster_file)
        if msg is None:
            raise
        raise ClusterConfigError(msg) from None
    out(f"cluster up in {time.perf_counter() - t0:.0f} s")
    if spec_file:
        sdk.run_on_cluster(derived_file, cmd="mkdir -p ~/qkgeom-sweeps")
        sdk.rsync(derived_file, source=str(Path(spec_file).resolve()),
                  target=spec_remote, down=False)
    sdk.run_on_cluster(derived_file, cmd=cmd)
    db_arg = f" --db {_q(db)}" if db else ""
    venv = 'export PATH="$HOME/qkgeom-venv/bin:$PATH"; '
    follow = {
        "log": f"ray exec {cluster_file} 'tail -f ~/qkgeom-sweeps/{name}.log'",
        "status": f"ray exec {cluster_file} '{venv}cd ~/qkgeom-sweeps && "
                  f"qkgeom status --name {name}{db_arg}'",
        "attach": f"ray attach {cluster_file}",
        "resume": f"qkgeom sweep --cluster {cluster_file} --resume --name {name}{db_arg}",
    }
    out(f"sweep {name} is running on the head node, detached (it outlives this shell).\n"
        f"  follow its log:   {follow['log']}\n"
        f"  trial progress:   {follow['status']}\n"
        f"  a shell there:    {follow['attach']}\n"
        f"  after a failure:  {follow['resume']}\n"
        "results: with PostgreSQL, query it from anywhere (qkgeom query/stats --db URL); with "
        "SQLite on the head, fetch the file:\n"
        f"  ray rsync-down {cluster_file} ~/qkgeom-sweeps/qkgeom.db ./qkgeom.db\n"
        f"stop the cluster when done: ray down {cluster_file}")
    return {"command": cmd, "follow": follow, "cluster_file": derived_file,
            "shipped": shipped}
