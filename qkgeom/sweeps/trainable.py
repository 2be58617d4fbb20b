"""The Tune trainable: one qkgeom trial in a Ray worker (see :mod:`qkgeom.sweeps.driver`).

:func:`trainable` runs :func:`qkgeom.engine.train.train` and reports every probe through
``tune.report`` with a ``tune.Checkpoint``; a failed trial restarts from its last
checkpoint and ``train(resume_from=...)`` continues with exactly the numbers an
uninterrupted run produces. Weight snapshots at probe steps are copied to
``<trial dir>/snapshots/step_NNNNNNN`` through the storage's ``pyarrow.fs`` filesystem
before the step is reported.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

import ray
from ray import tune

from qkgeom.plan.spec import TrialSpec


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


def worker_corpus(dataset: str) -> Any:
    """The encoded corpus ``dataset``, loaded once per process (one at a time)."""
    from qkgeom.engine.data import load_corpus

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


FAULTS_ENV = "QKGEOM_TEST_FAULTS"  # fault injection for the tests: see :func:`fault_point`


def fault_point(key: str, point: str, step: int | None = None) -> None:
    """Where the tests kill a worker: with ``$QKGEOM_TEST_FAULTS`` set to
    ``{"dir": D, "faults": {trial key: [[point, step], ...]}}`` the worker SIGKILLs itself
    at the first listed ``(point, step)`` it reaches that has not fired yet (each fires
    once: a marker file in D). Points: ``written`` (after a worker's own database write of
    a probe, before its ``tune.report``), ``report`` (before ``tune.report``: the snapshot
    is uploaded, nothing reported), ``reported`` (after ``tune.report`` returned: the
    checkpoint is saved and the driver has the result), ``restored`` (an attempt that
    restored a checkpoint, before it trains; ``step`` null). A no-op unless set."""
    raw = os.environ.get(FAULTS_ENV)
    if not raw:
        return
    plan = json.loads(raw)
    for i, (p, st) in enumerate(plan.get("faults", {}).get(key, [])):
        if p != point or (st is not None and st != step):
            continue
        marker = Path(plan["dir"]) / f"{key}.{i}"
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue  # fired in an earlier attempt
        os.close(fd)
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


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
    from qkgeom.engine.train import train
    from qkgeom.plan.spec import snapshot_every
    from qkgeom.records import ProbeRecord
    from qkgeom.sweeps.provenance import provenance

    spec = TrialSpec.from_dict(config["trial"])
    if spec.key in finished:
        return
    cfg_dict = dict(spec.config)
    cfg_dict["device"] = _trial_device(cfg_dict.get("device", "auto"))
    cfg = TrialConfig.from_dict(cfg_dict)
    host, node = _where()
    gpu_ids = [str(g) for g in ray.get_gpu_ids()]
    device = cfg.device + (f" gpu={','.join(gpu_ids)}" if gpu_ids else "")
    where = {"host": f"{host}/{node[:12]}" if node else host, "node_id": node, "device": device,
             # what this attempt runs on, measured here (not in the driver): trial_attempts
             "provenance": json.dumps(provenance(device, node_id=node or None), default=str)}

    with contextlib.ExitStack() as cleanup:  # on exit: scratch removed, then store closed
        direct = trial_id = None
        if db_url:
            from qkgeom.store import open_store

            direct = cleanup.enter_context(open_store(db_url))
            trial_id = direct.trial_id(direct.require_sweep(config["sweep"]), spec.key)
        scratch = Path(tempfile.mkdtemp(prefix="qkgeom-ckpt-"))
        cleanup.callback(shutil.rmtree, scratch, ignore_errors=True)
        every = snapshot_every(config.get("snapshots", "all"))
        snaps = dict(snapshot_dir=scratch / "snapshots", snapshot_every=every) \
            if every is not None else {}

        def report(rec: ProbeRecord, ckpt: str | None) -> None:
            metrics = {"step": rec.step, "max_steps": cfg.max_steps, "val_loss": rec.val_loss,
                       "train_loss": rec.train_loss, "tokens_per_s": rec.tokens_per_s,
                       **where}
            snap = scratch / "snapshots" / f"step_{rec.step:07d}"
            metrics["snapshot"] = ""
            if snap.is_dir():  # in storage before the driver records it
                metrics["snapshot"] = _upload_snapshot(snap, rec.step, storage_root)
                shutil.rmtree(snap, ignore_errors=True)
            if direct is not None:
                direct.write_probe(trial_id, rec)
                metrics["record"] = ""
                fault_point(spec.key, "written", rec.step)
            else:
                metrics["record"] = json.dumps(rec.to_dict())
            checkpoint = tune.Checkpoint.from_directory(ckpt) if ckpt else None
            fault_point(spec.key, "report", rec.step)
            tune.report(metrics, checkpoint=checkpoint)
            fault_point(spec.key, "reported", rec.step)
            if ckpt:  # persisted to the run's storage by report(); the local copy can go
                shutil.rmtree(ckpt, ignore_errors=True)

        corpus = worker_corpus(cfg.dataset)
        ckpt = tune.get_checkpoint()
        if ckpt is None:
            result = train(cfg, report, checkpoint_dir=scratch, corpus=corpus, **snaps)
        else:
            fault_point(spec.key, "restored")
            with ckpt.as_directory() as d:
                result = train(cfg, report, checkpoint_dir=scratch, resume_from=d,
                               corpus=corpus, **snaps)
        # one last result, no record: DbWriter stores the trial's final test loss
        tune.report({"step": cfg.max_steps, "max_steps": cfg.max_steps, "record": "",
                     "test_loss": result.test_loss, **where})


def trial_dirname(trial: Any) -> str:
    return f"{trial.config['trial']['key']}_{trial.trial_id}"


def trial_name(trial: Any) -> str:
    return trial.config["trial"]["key"]
