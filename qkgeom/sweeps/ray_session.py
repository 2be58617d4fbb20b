"""The local Ray instance, or a running cluster joined: starting it, stopping it with
every process it started, and reaping the instances of killed drivers
(:func:`reap_orphaned_ray`).

The one place Ray is started and stopped: the sweep driver (:mod:`qkgeom.sweeps.driver`)
and the pretrained probes over Ray (:mod:`qkgeom.pretrained.ray_probe`) both go through
:func:`init_ray` and :func:`shutdown` (or :func:`ray_running`, which starts Ray only if
it is not running yet and then stops only what it started). What a local instance this
process started needs for its clean-up is in :data:`LOCAL_RAY`; it is not a sweep's
state (an instance may serve several sweeps, or none).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray


@dataclass
class LocalRay:
    """The local Ray instance this process started, for :func:`shutdown`."""

    tmp: str | None = None  # its temp dir when we made it (removed again), else None
    # its own processes (GCS, raylet, ...; the workers are the raylet's children)
    pids: list[int] = field(default_factory=list)


LOCAL_RAY = LocalRay()


def init_ray(address: str | None = None, *, num_cpus: int | None = None,
             temp_dir: str | None = None, env: dict[str, str] | None = None,
             say: Callable[[str], Any] = print) -> None:
    """Start a local Ray instance (``address`` None) or join the cluster at ``address``
    ("auto" on a head node); nothing when Ray is already initialised in this process.

    ``num_cpus``: the local instance's CPUs (default: all cores); ``temp_dir``: its temp
    dir (default: a fresh ``/tmp/qkray-*``, removed by :func:`shutdown`); ``env``:
    environment variables of the workers; ``say``: where the orphan reaper reports.
    """
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")  # no TB/CSV/JSON spam
    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", "2")  # resume loses little after a kill
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")  # with verbose=0: no Ray tables
    for name in ("ray", "ray.train", "ray.data"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # Tune logs every trial failure with a full traceback; ProgressReporter prints one line
    # instead and the database keeps the error text
    logging.getLogger("ray.tune").setLevel(logging.CRITICAL)
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = dict(logging_level=logging.ERROR, log_to_driver=False,
                                  include_dashboard=False, configure_logging=True)
    if env:
        kwargs["runtime_env"] = {"env_vars": dict(env)}
    if address:
        ray.init(address=address, **kwargs)
        return
    reap_orphaned_ray(say)
    tmp = temp_dir
    if tmp is None:  # ours: removed again by shutdown()
        tmp = LOCAL_RAY.tmp = tempfile.mkdtemp(prefix="qkray-", dir="/tmp")
    before = _child_pids()
    ray.init(num_cpus=num_cpus or os.cpu_count() or 1, _temp_dir=tmp, **kwargs)
    # shutdown() waits for these, never for other children of this process
    LOCAL_RAY.pids = sorted(_child_pids() - before)


@contextmanager
def ray_running(address: str | None = None, *, num_cpus: int | None = None,
                say: Callable[[str], Any] = print) -> Iterator[None]:
    """Ray for the block: started (or joined) as :func:`init_ray` does, and stopped again
    at its end only when the block started it (a caller's running Ray stays up)."""
    started_here = not ray.is_initialized()
    init_ray(address, num_cpus=num_cpus, say=say)
    try:
        yield
    finally:
        if started_here:
            shutdown()


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


def local_gpus() -> int:
    """This machine's GPUs as torch sees them (0 without CUDA or torch)."""
    try:
        import torch

        return int(torch.cuda.device_count())
    except Exception:
        return 0


def warn_unplaceable(cpus: float, gpus: float, say: Any) -> None:
    """Warn when no live node of a running cluster fits one trial right now."""
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    if nodes and not any(r.get("CPU", 0) >= cpus and r.get("GPU", 0) >= gpus for r in nodes):
        say(f"warning: no node of the cluster has {cpus:g} CPU and {gpus:g} GPU free for one "
            "trial now; trials stay pending until the autoscaler adds such a node")


def cluster_gpus() -> float:
    """The GPUs of the Ray instance this process is connected to."""
    return float(ray.cluster_resources().get("GPU", 0))


def shutdown() -> None:
    """Disconnect from Ray (stopping a local instance) and remove our scratch dir.

    The processes of a local instance this process started (GCS, raylet and the workers
    below them) are waited for and, if still there after a few seconds, killed: none
    outlives us. Other children of this process (a notebook's, a test's) are left alone.
    """
    import psutil

    pids, procs = LOCAL_RAY.pids, []
    LOCAL_RAY.pids = []
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
    tmp, LOCAL_RAY.tmp = LOCAL_RAY.tmp, None
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
