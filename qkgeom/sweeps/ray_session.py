"""The Ray instance a sweep runs on: starting a local one (or joining a cluster),
checking that trials fit it, stopping it with every process it started, and reaping the
instances of drivers that were killed before they could stop theirs
(:func:`reap_orphaned_ray`).

Part of the driver (:mod:`qkgeom.sweeps.driver`); what it shares with the rest of the driver
(the local instance's scratch directory and processes) lives in
:data:`qkgeom.sweeps.callbacks.DRIVER`.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from qkgeom.plan.spec import SweepError
from qkgeom.sweeps.callbacks import DRIVER

if TYPE_CHECKING:
    from qkgeom.sweeps.driver import SweepOptions


def init_ray(opts: SweepOptions) -> None:
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")  # no TB/CSV/JSON spam
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")  # resume loses little after a kill
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # with verbose=0: no Ray tables
    for name in ("ray", "ray.train", "ray.data"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # Tune logs every trial failure with a full traceback; ProgressReporter prints one line
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
        reap_orphaned_ray(DRIVER.get("say", print))
        tmp = opts.ray_temp_dir
        if tmp is None:  # ours: removed again by shutdown()
            tmp = DRIVER["ray_tmp"] = tempfile.mkdtemp(prefix="qkray-", dir="/tmp")
        before = _child_pids()
        ray.init(num_cpus=opts.num_cpus or os.cpu_count() or 1, _temp_dir=tmp, **kwargs)
        # the local instance's own processes (GCS, raylet, ...; workers are the raylet's
        # children): shutdown() waits for these, never for other children of this process
        DRIVER["ray_pids"] = sorted(_child_pids() - before)


RAY_TMP_GLOB = "qkray-*"  # the local instances' temp dirs, under /tmp


def reap_orphaned_ray(say: Any = print, root: str = "/tmp") -> int:
    """Stop the local Ray instances that killed qkgeom drivers left behind, and remove
    their temp dirs. Returns how many processes were stopped.

    A driver killed by SIGKILL cannot run :func:`shutdown`, and some of Ray's helpers
    (the dashboard agent, the runtime-env agent, ...) outlive it. An instance is
    orphaned when the driver named in its session dir (``session_<time>_<pid>``) is gone,
    or its pid now belongs to a process started after the session. Instances of live
    drivers (another sweep on this machine) are left alone.
    """
    import psutil

    stopped = 0
    for tmp in sorted(Path(root).glob(RAY_TMP_GLOB)):
        sessions = [d for d in tmp.glob("session_*") if not d.is_symlink() and d.is_dir()]
        if not sessions:
            continue
        alive = False
        for d in sessions:
            try:
                pid = int(d.name.rsplit("_", 1)[-1])
                born = d.stat().st_ctime
            except (ValueError, OSError):
                alive = True  # not ours to judge
                break
            try:
                if psutil.Process(pid).create_time() <= born + 5:
                    alive = True
            except psutil.Error:
                pass
        if alive:
            continue
        procs = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(str(tmp) in a for a in (p.info["cmdline"] or [])):
                    procs.append(p)
            except psutil.Error:
                continue
        for p in procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        _wait_then_kill(procs, 5)
        shutil.rmtree(tmp, ignore_errors=True)
        stopped += len(procs)
        say(f"removed {tmp}, the temp dir of a local Ray instance left by a killed "
            f"qkgeom driver" + (f", and stopped {len(procs)} of its processes" if procs
                                else ""))
    return stopped


def _wait_then_kill(procs: list, timeout: float) -> None:
    """Wait up to ``timeout`` s for ``procs`` to exit, then SIGKILL those left."""
    import psutil

    _, left = psutil.wait_procs(procs, timeout=timeout)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=5)


def _child_pids() -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process().children()}


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
    connecting (:func:`warn_unplaceable`); ``--cluster`` checks the cluster file's node
    types (:func:`qkgeom.sweeps.cluster.check_cluster_resources`).
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


def warn_unplaceable(cpus: float, gpus: float, say: Any) -> None:
    """Warn when no live node of a running cluster fits one trial right now."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if nodes and not any(r.get("CPU", 0) >= cpus and r.get("GPU", 0) >= gpus for r in nodes):
        say(f"warning: no node of the cluster has {cpus:g} CPU and {gpus:g} GPU free for one "
            "trial now; trials stay pending until the autoscaler adds such a node")


def gpus_per_trial(opts: SweepOptions) -> float:
    if opts.gpus_per_trial is not None:
        return float(opts.gpus_per_trial)
    return 0.25 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0


def shutdown() -> None:
    """Disconnect from Ray (stopping a local instance) and remove our scratch dir.

    The processes of a local instance this process started (GCS, raylet and the workers
    below them) are waited for and, if still there after a few seconds, killed: none
    outlives us. Other children of this process (a notebook's, a test's) are left alone.
    """
    import psutil

    pids, procs = DRIVER.pop("ray_pids", None) or [], []
    for pid in pids if ray.is_initialized() else []:
        try:
            p = psutil.Process(pid)
            if p.ppid() == os.getpid():  # still ours, not a reused pid
                procs += [p, *p.children(recursive=True)]
        except psutil.Error:
            pass
    if ray.is_initialized():
        ray.shutdown()
    _wait_then_kill(procs, 15)
    tmp = DRIVER.pop("ray_tmp", None)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
