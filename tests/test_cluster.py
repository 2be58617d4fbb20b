"""``qkgeom sweep --cluster``: offline validation of cluster files, and a real launch.

The end-to-end test starts a one-node cluster with Ray's cluster launcher (local provider,
SSH to 127.0.0.1:2222 set up by ``.ci/ssh.sh``), runs the smoke sweep's driver on the
head detached, and waits for the database to hold the finished sweep.
"""

from __future__ import annotations

import copy
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import yaml
from sweep_fixtures import ROOT, assert_sweep_complete, run_cli, scratch  # noqa: F401

CLUSTER = ROOT / "cluster"


def _write(tmp: Path, cfg: dict) -> Path:
    p = tmp / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml", "local.yaml"])
def test_shipped_cluster_files_validate(name):
    from qkgeom.tune import validate_cluster_file

    cfg = validate_cluster_file(CLUSTER / name)
    assert cfg["cluster_name"]


def _aws() -> dict:
    return yaml.safe_load((CLUSTER / "aws.yaml").read_text())


def _drop_head(c: dict) -> None:
    del c["head_node_type"]


def _wrong_type(c: dict) -> None:
    c["max_workers"] = "four"


def _no_instance(c: dict) -> None:
    del c["available_node_types"]["gpu_worker"]["node_config"]["InstanceType"]


def _misspelt_instance(c: dict) -> None:
    nc = c["available_node_types"]["gpu_worker"]["node_config"]
    nc["InstnceType"] = nc.pop("InstanceType")


def _no_gpu(c: dict) -> None:
    c["available_node_types"]["gpu_worker"]["resources"] = {"CPU": 4}


def _head_trials(c: dict) -> None:
    c["available_node_types"]["head"]["resources"] = {"CPU": 2}


def _no_install(c: dict) -> None:
    c["setup_commands"] = ["echo hi"]
    c["head_setup_commands"] = c["worker_setup_commands"] = ["pip install torch"]


def _venv_named_qkgeom_is_no_install(c: dict) -> None:
    c["setup_commands"] = ["python3 -m venv ~/qkgeom-venv"]
    c["head_setup_commands"] = c["worker_setup_commands"] = ["~/qkgeom-venv/bin/pip install torch"]


def _no_install_on_workers(c: dict) -> None:
    c["worker_setup_commands"] = ["~/qkgeom-venv/bin/pip install torch"]


def _unknown_key(c: dict) -> None:
    c["max_wrokers"] = 3


def _bad_head_name(c: dict) -> None:
    c["head_node_type"] = "boss"


@pytest.mark.parametrize("mutate, needle", [
    (_drop_head, "head_node_type: missing"),
    (_wrong_type, "max_workers: 'four' is not of type 'integer'"),
    (_no_instance, "gpu_worker.node_config.InstanceType: missing"),
    (_misspelt_instance, "gpu_worker.node_config.InstanceType: missing"),
    (_no_gpu, "gpu_worker.resources.GPU: missing"),
    (_head_trials, "head.resources: the head must run no trials"),
    (_no_install, "setup_commands: nothing installs qkgeom"),
    (_venv_named_qkgeom_is_no_install, "setup_commands: nothing installs qkgeom"),
    (_no_install_on_workers, "worker_setup_commands: nothing installs qkgeom on the workers"),
    (_unknown_key, "max_wrokers"),
    (_bad_head_name, "'boss' is not in available_node_types"),
])
def test_invalid_cluster_files_name_the_key(tmp_path, mutate, needle):
    from qkgeom.tune import ClusterConfigError, validate_cluster_file

    cfg = copy.deepcopy(_aws())
    mutate(cfg)
    with pytest.raises(ClusterConfigError) as e:
        validate_cluster_file(_write(tmp_path, cfg))
    assert needle in str(e.value)


def test_cli_refuses_invalid_cluster_before_starting_anything(tmp_path):
    cfg = _aws()
    del cfg["head_node_type"]
    p = run_cli(["sweep", "--preset", "smoke", "--cluster", str(_write(tmp_path, cfg))],
                tmp_path, check=False)
    assert p.returncode != 0
    assert "head_node_type: missing" in p.stderr and "Traceback" not in p.stderr
    # a bad spec is refused before the cluster file is even read
    p = run_cli(["sweep", "--preset", "smoke", "--set", "grid.dephts=[1]", "--cluster",
                 str(CLUSTER / "aws.yaml")], tmp_path, check=False)
    assert p.returncode != 0 and "did you mean 'depths'" in p.stderr


def test_remote_command_is_detached_and_quoted():
    from qkgeom.tune import remote_sweep_command

    cmd = remote_sweep_command("s1", spec_remote=None, preset="smoke", data="/d ata",
                               sets=["max_steps=5"], db=None, resume=True,
                               gpus_per_trial=0.25, cpus_per_trial=1, max_concurrent=None,
                               max_failures=2, direct_writes=False, storage=None,
                               address="127.0.0.1:6379")
    assert "setsid nohup qkgeom sweep --address 127.0.0.1:6379 --name s1" in cmd
    assert "'/d ata'" in cmd and "--resume" in cmd and "--gpus-per-trial 0.25" in cmd
    assert "> ~/qkgeom-sweeps/s1.log 2>&1 < /dev/null &" in cmd


def _sshd_ready() -> bool:
    key = Path.home() / ".ssh" / "qkgeom_ci_ed25519"
    if not key.exists():
        return False
    try:
        with socket.create_connection(("127.0.0.1", 2222), timeout=2):
            return True
    except OSError:
        return False


def _head_pids(port: int) -> set[int]:
    import psutil

    out = set()
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if f":{port}" in cmd or f"port={port}" in cmd:
            out.add(p.info["pid"])
    return out


@pytest.mark.slow
@pytest.mark.ray
def test_cluster_launcher_end_to_end(scratch, wikitext_dir):  # noqa: F811
    if not _sshd_ready():
        msg = "sshd on 127.0.0.1:2222 with ~/.ssh/qkgeom_ci_ed25519 missing: run .ci/ssh.sh"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    from qkgeom.store import open_store
    from qkgeom.sweep import plan_from

    before = _head_pids(6399)
    db = f"{scratch}/cluster.db"
    name = f"cl{os.getpid()}"
    try:
        p = run_cli(["sweep", "--cluster", str(CLUSTER / "local.yaml"), "--preset", "smoke",
                     "--name", name, "--data", str(wikitext_dir), "--db", db,
                     "--storage", str(scratch / "ray")], scratch, timeout=300)
        assert "running on the head node, detached" in p.stdout
        assert "ray exec" in p.stdout and "qkgeom status" in p.stdout
        deadline = time.monotonic() + 300
        statuses: list[str] = []
        while time.monotonic() < deadline:
            if Path(db).exists():
                try:
                    with open_store(db) as store:
                        statuses = store.trials(name)["status"].to_list()
                except Exception:
                    statuses = []
                if statuses and all(s in ("terminated", "error") for s in statuses):
                    break
            time.sleep(1)
        log = Path.home() / "qkgeom-sweeps" / f"{name}.log"
        assert statuses and all(s == "terminated" for s in statuses), \
            log.read_text()[-3000:] if log.exists() else statuses
    finally:
        for pid in _head_pids(6399) - before:  # only the head this test started
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert_sweep_complete(db, name, plan_from("smoke", name=name, data=str(wikitext_dir)))
