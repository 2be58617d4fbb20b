"""A Ray cluster of two node processes on this machine (fake GPUs) runs a sweep via --address.

Each node declares one (fake) GPU and each trial asks for a whole one, so the trials must
spread over both nodes; every trial's host column names the node it ran on. Ray only sets
CUDA_VISIBLE_DEVICES for a fake GPU, so the trials fall back to the CPU.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sweep_fixtures import assert_sweep_complete, run_cli

pytestmark = [pytest.mark.ray, pytest.mark.slow]
RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_started_under(temp_dir: Path) -> None:
    """End the Ray processes this test started: those whose command line names its dir."""
    import psutil

    me = os.getpid()
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.info["pid"] != me and str(temp_dir) in " ".join(p.info["cmdline"] or []):
                os.kill(p.info["pid"], signal.SIGKILL)
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass


def test_sweep_on_two_nodes(scratch, wikitext_dir):  # noqa: F811
    from qkgeom.plan.spec import plan_from
    from qkgeom.store import open_store

    port = _free_port()
    tmp = scratch / "r"
    # token auth (on by default in 2.60 once ~/.ray/auth_token exists) would need the token
    # on every node; a throwaway local cluster goes without
    env = dict(os.environ, RAY_DEDUP_LOGS="1", RAY_AUTH_MODE="disabled")
    common = ["--num-cpus=1", "--num-gpus=1", "--disable-usage-stats"]
    try:
        subprocess.run([RAY, "start", "--head", f"--port={port}", f"--temp-dir={tmp}",
                        "--include-dashboard=false", "--node-ip-address=127.0.0.1", *common],
                       check=True, capture_output=True, env=env, timeout=120)
        subprocess.run([RAY, "start", f"--address=127.0.0.1:{port}",
                        "--node-ip-address=127.0.0.1", *common],
                       check=True, capture_output=True, env=env, timeout=120)
        time.sleep(1)
        sets = ["--set", "grid.depths=[1,2]", "--set", "interventions.seeds=[0]",
                "--set", "max_steps=60"]
        p = run_cli(["sweep", "--preset", "smoke", "--name", "two", "--db",
                     f"{scratch}/two.db", "--data", str(wikitext_dir),
                     "--address", f"127.0.0.1:{port}", "--gpus-per-trial", "1",
                     "--cpus-per-trial", "1", "--storage", str(scratch / "shared"), *sets],
                    scratch, timeout=400, env={"RAY_AUTH_MODE": "disabled"})
        assert "terminated" in p.stdout
    finally:
        _kill_started_under(tmp)
    plan = plan_from("smoke", name="two", data=str(wikitext_dir),
                     sets=["grid.depths=[1,2]", "interventions.seeds=[0]", "max_steps=60"])
    assert_sweep_complete(f"{scratch}/two.db", "two", plan)
    with open_store(f"{scratch}/two.db") as store:
        trials = store.trials("two")
    nodes = {h.split("/")[-1] for h in trials["host"].to_list()}
    assert len(nodes) == 2, trials.select("trial_key", "host").to_dicts()
    assert all(d.startswith("cpu gpu=") for d in trials["device"].to_list())
