"""qkgeom.sweeps.ship: the wheel of the running code, the derived cluster file, ``--dry-run``.

All offline (``PIP_NO_INDEX=1``): a researcher on a plane can still see what would be
launched. The real launch is in test_cluster.py.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from sweep_fixtures import ROOT, run_cli

OFFLINE = {"PIP_NO_INDEX": "1", "HTTPS_PROXY": "http://127.0.0.1:9",
           "HTTP_PROXY": "http://127.0.0.1:9"}


def _copy_source(dst: Path) -> Path:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "qkgeom", dst / "qkgeom", ignore=ignore)
    shutil.copytree(ROOT / "migrations", dst / "migrations", ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def test_content_hash_follows_the_sources_only(tmp_path):
    from qkgeom.sweeps.ship import content_hash

    a = _copy_source(tmp_path / "a")
    h = content_hash(a)
    assert re.fullmatch(r"[0-9a-f]{16}", h)
    assert content_hash(ROOT) == h  # the checkout and its copy
    (a / "qkgeom" / "__pycache__").mkdir(exist_ok=True)
    (a / "qkgeom" / "__pycache__" / "x.pyc").write_bytes(b"junk")
    (a / "qkgeom" / "_shipped.py").write_text("CONTENT_HASH = 'x'\n")
    assert content_hash(a) == h  # caches and the stamp do not count
    f = a / "migrations" / "env.py"
    f.write_text(f.read_text() + "\n")
    assert content_hash(a) != h  # one byte of a migration does


def test_wheel_installed_elsewhere_reports_the_same_code_version(tmp_path):
    from qkgeom.sweeps.driver import code_version
    from qkgeom.sweeps.ship import build_wheel

    shipped = build_wheel(tmp_path)
    assert shipped.version == code_version()
    assert shipped.wheel.name == f"qkgeom-{shipped.version}-py3-none-any.whl"
    with zipfile.ZipFile(shipped.wheel) as z:
        names = set(z.namelist())
        stamp = z.read("qkgeom/_shipped.py").decode()
    assert {"qkgeom/engine/train.py", "qkgeom/migrations/env.py", "qkgeom/cli/sweep.py"} <= names
    assert f'CONTENT_HASH = "{shipped.content_hash}"' in stamp
    assert not any(n.startswith(("build/", "src/")) for n in names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(shipped.wheel)], check=True,
                   env={**os.environ, **OFFLINE})
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", "import qkgeom; from qkgeom.sweeps.driver import "
                          "code_version; print(qkgeom.__file__); print(code_version()); "
                          "from qkgeom.sweeps.provenance import provenance as p; d = p(); "
                          "print(d['git_commit'], d['git_dirty'])"],
                         cwd="/", env=env, capture_output=True, text=True, check=True)
    where, version, commit, dirty = out.stdout.split()
    assert where == str(site / "qkgeom" / "__init__.py")
    assert version == shipped.version
    # the node has no checkout: it reports the commit the wheel was built from (git's own
    # answer for this checkout), and whether the shipped sources differed from it
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "qkgeom",
                              "migrations", "pyproject.toml"], capture_output=True, text=True,
                             check=True).stdout.strip()
    assert (commit, dirty) == (head, str(bool(changed)))


def test_derived_file_adds_mounts_and_leaves_the_users_file_alone(tmp_path):
    from qkgeom.sweeps.ship import Shipped, derive_cluster_config

    cfg = yaml.safe_load((ROOT / "cluster" / "aws.yaml").read_text())
    before = yaml.safe_dump(cfg)
    wheel = tmp_path / "qkgeom-0.1.0+habc-py3-none-any.whl"
    derived, remote_data = derive_cluster_config(cfg, Shipped(wheel, "0.1.0+habc", "abc"),
                                                 tmp_path)
    assert yaml.safe_dump(cfg) == before
    assert derived["file_mounts"] == {
        f"~/qkgeom-ship/{wheel.name}": str(wheel),
        f"~/qkgeom-data/{tmp_path.name}": str(tmp_path)}
    assert remote_data == f"~/qkgeom-data/{tmp_path.name}"
    for key in ("head_setup_commands", "worker_setup_commands"):
        installs = [c for c in derived[key] if "QKGEOM_WHEEL" in c]
        assert installs == [f"export QKGEOM_WHEEL=~/qkgeom-ship/{wheel.name}; "
                            '~/qkgeom-venv/bin/pip install -q "$QKGEOM_WHEEL"']
    assert derived["setup_commands"] == cfg["setup_commands"]


def _dry_run(tmp_path: Path, data: Path, cluster: str = "aws.yaml"):
    return run_cli(["sweep", "--cluster", str(ROOT / "cluster" / cluster), "--preset", "smoke",
                    "--data", str(data), "--dry-run"], tmp_path, check=False, env=OFFLINE,
                   timeout=120)


def test_dry_run_shows_the_derived_file_and_starts_nothing(tmp_path, wikitext_dir):
    from qkgeom.sweeps.cluster import validate_cluster_file

    user_file = (ROOT / "cluster" / "aws.yaml").read_bytes()
    p = _dry_run(tmp_path, wikitext_dir)
    assert p.returncode == 0, p.stderr
    assert "dry run: nothing started" in p.stdout and "starting/updating" not in p.stdout
    m = re.search(r"derived cluster file (\S+):\n(.*)\nremote command \(on the head\):\n(.*)",
                  p.stdout, re.S)
    assert m, p.stdout
    derived_file, printed, cmd = m.group(1), yaml.safe_load(m.group(2)), m.group(3).strip()
    assert yaml.safe_load(Path(derived_file).read_text()) == printed
    validate_cluster_file(derived_file)  # what would be launched is itself valid
    mounts = printed["file_mounts"]
    (wheel_remote, wheel_local), = [(k, v) for k, v in mounts.items() if k.endswith(".whl")]
    assert Path(wheel_local).is_file() and wheel_remote.startswith("~/qkgeom-ship/qkgeom-")
    assert mounts[f"~/qkgeom-data/{wikitext_dir.name}"] == str(wikitext_dir.resolve())
    assert f"--data '~/qkgeom-data/{wikitext_dir.name}'" in cmd
    assert "setsid nohup qkgeom sweep --address 127.0.0.1:6379" in cmd
    assert (ROOT / "cluster" / "aws.yaml").read_bytes() == user_file


def test_too_large_data_is_refused_with_the_download_option(tmp_path):
    from qkgeom.sweeps.ship import MAX_DATA_BYTES

    big = tmp_path / "corpus"
    big.mkdir()
    with open(big / "wiki.train.raw", "wb") as f:  # sparse: no disk used
        f.truncate(MAX_DATA_BYTES + 1)
    p = _dry_run(tmp_path, big)
    assert p.returncode != 0
    lines = [x for x in p.stderr.strip().splitlines() if "INFO" not in x]  # Ray's own logging
    assert len(lines) == 1 and "Traceback" not in p.stderr
    assert "--data wikitext-103" in lines[0] and "256 MiB" in lines[0]
    assert "shipping qkgeom" not in p.stdout  # refused before building anything


def test_ray_up_without_cloud_credentials_is_one_line(tmp_path):
    """The AWS launcher here: no boto3, or (with boto3) no credentials. Never a traceback."""
    env = {**OFFLINE, "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
           "AWS_CONFIG_FILE": "/nonexistent", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_PROFILE": ""}
    env = {k: v for k, v in env.items() if v or not k.startswith("AWS_")}
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("AWS_") or k in env}
    p = subprocess.run([str(Path(sys.executable).with_name("qkgeom")), "sweep", "--cluster",
                        str(ROOT / "cluster" / "aws.yaml"), "--preset", "smoke",
                        "--storage", "s3://b/p"],
                       env={**clean, **env}, cwd=tmp_path, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode != 0
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: ray up ") and (
        "pip install boto3" in last or "aws credentials" in last), last


@pytest.mark.parametrize("cluster", ["aws.yaml", "gcp.yaml", "local.yaml"])
def test_shipped_cluster_files_install_only_what_is_shipped(cluster):
    text = (ROOT / "cluster" / cluster).read_text()
    assert "github.com/qkgeom" not in text
    cfg = yaml.safe_load(text)
    from qkgeom.sweeps.ship import installs_qkgeom, ships_wheel

    assert ships_wheel(cfg)
    cmds = [c for k in ("setup_commands", "head_setup_commands", "worker_setup_commands")
            for c in cfg.get(k) or []]
    assert [c for c in cmds if installs_qkgeom(c)] == [c for c in cmds if "QKGEOM_WHEEL" in c]
