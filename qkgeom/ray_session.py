"""The local Ray instance of a qkgeom process: starting it, stopping it, and cleaning up
after a killed one.

:func:`init_ray` starts (or joins, with an address) Ray with qkgeom's settings; a local
instance gets its own temp dir ``/tmp/qkray-*``, which :func:`shutdown` removes with the
instance's processes, and which :func:`reap_orphaned_ray` removes for drivers that were
killed before they could. Sweeps (:mod:`qkgeom.tune`) and the pretrained fan-out
(:mod:`qkgeom.pretrained.ray_probe`) both start Ray here.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray

from qkgeom.tune_callbacks import DRIVER

if TYPE_CHECKING:
    from qkgeom.tune import SweepOptions


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
        _, left = psutil.wait_procs(procs, timeout=5)
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(left, timeout=5)
        shutil.rmtree(tmp, ignore_errors=True)
        stopped += len(procs)
        say(f"removed {tmp}, the temp dir of a local Ray instance left by a killed "
            f"qkgeom driver" + (f", and stopped {len(procs)} of its processes" if procs
                                else ""))
    return stopped


def _child_pids() -> set[int]:
    import psutil

    return {c.pid for c in psutil.Process().children()}


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
    _, alive = psutil.wait_procs(procs, timeout=15)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    tmp = DRIVER.pop("ray_tmp", None)
    if tmp:
        shutil.rmtree(tmp, ignore_errors=True)
