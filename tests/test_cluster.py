"""``qkgeom sweep --cluster``: offline validation of cluster files, and a real launch.

The end-to-end test starts a one-node cluster with Ray's cluster launcher (local provider,
SSH to 127.0.0.1:2222 set up by ``.ci/ssh.sh``), runs the smoke sweep's driver on the
head detached, and waits for the database to hold the finished sweep.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from ci_env import skip_or_fail
from sweep_fixtures import ROOT, assert_sweep_complete, cli_env, run_cli

CLUSTER = ROOT / "cluster"


def _write(tmp: Path, cfg: dict) -> Path:
    p = tmp / "c.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return p


@pytest.mark.parametrize("name", ["aws.yaml", "gcp.yaml", "local.yaml"])
def test_shipped_cluster_files_validate(name):
    from qkgeom.sweeps.cluster import validate_cluster_file

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
    from qkgeom.sweeps.cluster import ClusterConfigError, validate_cluster_file

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
    from qkgeom.sweeps.cluster import remote_sweep_command

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


NODE_VENV = Path.home() / "qkgeom-venv"  # the node's environment in cluster/local.yaml
SMALL = ["--set", "grid.depths=[1]", "--set", "grid.inits=[gaussian]", "--set",
         "interventions.depth=1", "--set", "interventions.arms=[hold]", "--set",
         "interventions.seeds=[0]"]


def _node(code: str) -> str:
    """Run ``code`` with the node's Python as a node would: no PYTHONPATH, cwd /."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([str(NODE_VENV / "bin" / "python"), "-c", code], cwd="/", env=env,
                       capture_output=True, text=True, timeout=60)
    return p.stdout.strip() if p.returncode == 0 else f"error: {p.stderr.strip()[-300:]}"


def _wait_for_sweep(db: str, name: str, timeout: float = 600) -> list[str]:
    from qkgeom.store import open_store

    deadline = time.monotonic() + timeout
    statuses: list[str] = []
    last_error = ""
    while time.monotonic() < deadline:
        if Path(db).exists():
            try:
                with open_store(db) as store:
                    df = store.trials(name)
                statuses = df["status"].to_list()
                last_error = "; ".join(f"{k}: {s}: {(e or '')[-300:]}" for k, s, e in zip(
                    df["trial_key"], df["status"], df["error"]) if s != "terminated")
            except Exception as e:  # not written yet; kept for the failure message
                statuses, last_error = [], str(e)
            if statuses and all(s in ("terminated", "error") for s in statuses):
                break
        time.sleep(1)
    log = Path.home() / "qkgeom-sweeps" / f"{name}.log"
    assert statuses and all(s == "terminated" for s in statuses), \
        (log.read_text()[-3000:] if log.exists() else statuses, last_error)
    return statuses


def _recorded_version(db: str, name: str) -> str:
    from qkgeom.store import open_store

    with open_store(db) as store:
        sw = store.sweeps()
    return sw.filter(sw["name"] == name)["code_version"][0]


def _kill_new_heads(before: set[int]) -> None:
    """End the head this test started (only its processes) and wait for its port to close."""
    for pid in _head_pids(6399) - before:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", 6399), timeout=1).close()
        except OSError:
            break
        time.sleep(0.5)
    time.sleep(2)  # the killed GCS's files and sockets


@pytest.mark.slow
@pytest.mark.ray
def test_cluster_ships_qkgeom_to_a_node_without_it(scratch, wikitext_dir):  # noqa: F811
    """`ray up` over SSH to 127.0.0.1 where the node's venv has torch and ray but no qkgeom:
    the setup commands of cluster/local.yaml install the wheel qkgeom sweep ships, the smoke
    study runs there into the database; then an edited copy of qkgeom runs on the node."""
    if not _sshd_ready():
        msg = "sshd on 127.0.0.1:2222 with ~/.ssh/qkgeom_ci_ed25519 missing: run .ci/ssh.sh"
        skip_or_fail(msg)
    from qkgeom.plan.spec import plan_from

    subprocess.run(["bash", str(ROOT / ".ci" / "node-venv.sh"), str(NODE_VENV)], check=True,
                   env={**os.environ, "QKGEOM_VENV": sys.prefix}, timeout=120)
    assert _node("import qkgeom").startswith("error:")  # the node starts without qkgeom
    before = _head_pids(6399)
    db = f"{scratch}/cluster.db"
    name = f"cl{os.getpid()}"
    try:
        # 1. the smoke study from this checkout, data shipped too
        p = run_cli(["sweep", "--cluster", str(CLUSTER / "local.yaml"), "--preset", "smoke",
                     "--name", name, "--data", str(wikitext_dir), "--db", db,
                     "--storage", str(scratch / "ray")], scratch, timeout=300)
        assert "running on the head node, detached" in p.stdout
        m = re.search(r"shipping qkgeom (\S+) \((\S+\.whl)\)", p.stdout)
        assert m, p.stdout
        version, wheel = m.group(1), Path(m.group(2)).name
        # what the head's autoscaler gives every worker it starts: the wheel and the install
        boot = yaml.safe_load((Path.home() / "ray_bootstrap_config.yaml").read_text())
        assert f"~/qkgeom-ship/{wheel}" in boot["file_mounts"]
        assert any(c.startswith(f"export QKGEOM_WHEEL=~/qkgeom-ship/{wheel}; ")
                   for c in boot["worker_setup_commands"]), boot["worker_setup_commands"]
        _wait_for_sweep(db, name)
        assert_sweep_complete(db, name, plan_from("smoke", name=name, data=str(wikitext_dir)))
        assert _recorded_version(db, name) == version
        # the node's qkgeom is a real install of that wheel, not this checkout
        purelib = _node("import sysconfig; print(sysconfig.get_paths()['purelib'])")
        assert _node("import importlib.metadata as m, qkgeom; "
                     "print(m.version('qkgeom'), qkgeom.__file__)") == \
            f"{version} {purelib}/qkgeom/__init__.py"
        # the corpus went through file_mounts and the trials read that copy
        shipped = Path.home() / "qkgeom-data" / wikitext_dir.name / "wiki.valid.raw"
        assert shipped.read_bytes() == (wikitext_dir / "wiki.valid.raw").read_bytes()
        from qkgeom.store import open_store

        with open_store(db) as store:
            configs = store.trials(name)["config"].to_list()
        assert all(str(shipped.parent) in str(c) for c in configs), configs[0]
        _kill_new_heads(before)  # pooled Ray workers must not keep the old code imported

        # 2. one line of qkgeom changed (its version) in a copy: the node runs the copy
        src = scratch / "src"
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        shutil.copytree(ROOT / "qkgeom", src / "qkgeom", ignore=ignore)
        shutil.copytree(ROOT / "migrations", src / "migrations", ignore=ignore)
        for f in ("pyproject.toml", "README.md"):
            shutil.copy2(ROOT / f, src / f)
        init = src / "qkgeom" / "__init__.py"
        text, n = re.subn(r'__version__ = "([^"+]+)"', r'__version__ = "\1.post7"',
                          init.read_text())
        assert n == 1
        init.write_text(text)
        env = {**cli_env(scratch), "PYTHONPATH": str(src)}
        p2 = subprocess.run(
            [sys.executable, "-c", "from qkgeom.cli import main; main()", "sweep", "--cluster",
             str(CLUSTER / "local.yaml"), "--preset", "smoke", *SMALL, "--name", name + "b",
             "--data", str(wikitext_dir), "--db", db, "--storage", str(scratch / "ray")],
            env=env, cwd=scratch, capture_output=True, text=True, timeout=300)
        assert p2.returncode == 0, p2.stdout[-3000:] + p2.stderr[-3000:]
        version2 = re.search(r"shipping qkgeom (\S+) ", p2.stdout).group(1)
        assert re.fullmatch(r"\d+\.\d+\.\d+\.post7\+h[0-9a-f]{16}", version2), version2
        assert version2.split("+")[1] != version.split("+")[1]
        _wait_for_sweep(db, name + "b")
        assert _recorded_version(db, name + "b") == version2
        assert _node("import qkgeom; print(qkgeom.__version__)").endswith(".post7")
    finally:
        _kill_new_heads(before)


def test_sqlite_fetch_hint_waits_for_the_end_of_the_sweep():
    """The hint to fetch a SQLite database from the head must not invite a copy of a live
    WAL database: the .db file alone misses what is still in its -wal file."""
    from qkgeom.sweeps.cluster import _print_follow, follow_commands

    lines: list[str] = []
    _print_follow("c.yaml", "s1", follow_commands("c.yaml", "s1", None), lines.append)
    text = "\n".join(lines)
    assert "ray rsync-down c.yaml ~/qkgeom-sweeps/qkgeom.db ./qkgeom.db" in text
    before = text[:text.index("ray rsync-down")]
    assert "once the sweep has ended" in before and "-wal" in before


@pytest.mark.parametrize("db, where", [
    (None, "~/qkgeom-sweeps/qkgeom.db"),  # the default file in the driver's directory
    ("runs/s1.db", "~/qkgeom-sweeps/runs/s1.db"),  # relative to that directory
    ("sqlite:///runs/s1.db", "~/qkgeom-sweeps/runs/s1.db"),
    ("sqlite:////data/s1.db", "/data/s1.db"),  # absolute
    ("postgresql://u:pw@db.example/q", None),  # nothing to fetch
])
def test_fetch_hint_names_the_database_the_head_writes(db, where):
    from qkgeom.sweeps.cluster import _print_follow, follow_commands, head_db_file

    assert head_db_file(db) == where
    lines: list[str] = []
    _print_follow("c.yaml", "s1", follow_commands("c.yaml", "s1", db), lines.append, where)
    text = "\n".join(lines)
    if where is None:
        assert "rsync-down" not in text and "query the PostgreSQL database" in text
    else:
        local = where.rsplit("/", 1)[-1]
        assert f"ray rsync-down c.yaml {where} ./{local}\n" in text
