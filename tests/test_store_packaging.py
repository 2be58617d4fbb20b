"""The migrations ship inside the wheel: ``qkgeom db upgrade`` works from an install."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10: tomli is a dev dependency there
        import tomli as tomllib
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_subpackage_is_listed_in_pyproject():
    from setuptools import find_packages

    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = set(find_packages(str(ROOT), include=["qkgeom", "qkgeom.*"]))
    missing = found - listed
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"
    assert {"qkgeom.migrations", "qkgeom.migrations.versions"} <= listed


def test_wheel_ships_migrations_and_upgrades_outside_the_checkout(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "-w", str(wheels),
                    "--no-deps", "--no-build-isolation", "-q"], check=True,
                   capture_output=True, cwd=tmp_path, timeout=300)
    [whl] = wheels.glob("qkgeom-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert "qkgeom/migrations/env.py" in names
    assert "qkgeom/migrations/script.py.mako" in names
    assert "qkgeom/migrations/versions/0001_initial.py" in names
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("QKGEOM_DB", "PYTHONPATH")}
    env["PYTHONPATH"] = str(site)
    code = ("import sys, qkgeom; from qkgeom.store.schema import migrations_dir; "
            "print(qkgeom.__file__); print(migrations_dir()); "
            "from qkgeom.cli import main; sys.argv = ['qkgeom'] + sys.argv[1:]; main()")
    r = subprocess.run([sys.executable, "-c", code, "db", "upgrade", "--db", "fresh.db"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith(str(site)) and lines[1].startswith(str(site)), lines
    assert "upgraded empty ->" in lines[2]
    assert (work / "fresh.db").exists()
