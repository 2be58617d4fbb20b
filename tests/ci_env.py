"""Whether this run is a CI run, and the skip-or-fail rule for missing data and services.

``CI`` counts as set when it holds any truthy value (``true``, ``1``, ``yes``, ``on``, any
case), as CI services set it. Under CI a missing dataset, service or dependency fails the
test instead of skipping it; tests/conftest.py also turns any other skip into a failure,
except for tests marked for hardware the machine lacks (``@pytest.mark.gpu``).
"""

from __future__ import annotations

import os

import pytest

FALSY = ("", "0", "false", "no", "off")

# markers that name hardware a CI machine may lack: a skip of such a test stays a skip
HARDWARE_MARKERS = ("gpu",)


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in FALSY


def skip_or_fail(msg: str) -> None:
    """Skip the test locally; under CI fail it (CI must run everything it installs)."""
    if under_ci():
        pytest.fail(f"{msg} (CI={os.environ.get('CI')}: this test must run under CI)")
    pytest.skip(msg)


def require(module: str):
    """Import a dependency the test needs: under CI a plain import (a missing package is an
    error, since CI installs every extra), locally a skip naming the extra to install."""
    import importlib

    if under_ci():
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"{module} not installed: pip install -e '.[hf]'")
