"""The CI rule of tests/conftest.py, run on a throwaway test file in a child pytest: under
any truthy ``CI`` a skip fails the run unless the test is marked ``gpu``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
HERE = Path(__file__).resolve().parent

CASES = '''
import pytest

def test_plain_skip():
    pytest.skip("no frobnicator")

@pytest.mark.skipif(True, reason="static skip")
def test_skipif():
    pass

@pytest.fixture
def service():
    pytest.skip("no service")

def test_fixture_skip(service):
    pass

@pytest.mark.gpu
def test_gpu_skip():
    pytest.skip("no CUDA")

@pytest.mark.xfail(strict=True)
def test_xfail():
    assert False

def test_pass():
    pass
'''


def run_child(pytester: pytest.Pytester, monkeypatch, ci: str | None):
    pytester.makeconftest((HERE / "conftest.py").read_text())
    pytester.makepyfile(ci_env=(HERE / "ci_env.py").read_text(), test_cases=CASES)
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "test_cases.py")


@pytest.mark.parametrize("value, truthy", [
    (None, False), ("", False), ("0", False), ("false", False), ("No", False), ("off", False),
    ("true", True), ("1", True), ("yes", True), ("TRUE", True), ("on", True)])
def test_any_truthy_ci_counts(monkeypatch, value, truthy):
    from ci_env import under_ci

    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert under_ci() is truthy


def test_skips_fail_under_ci(pytester, monkeypatch):
    r = run_child(pytester, monkeypatch, "1")
    # plain skip -> failed; skipif and a fixture's skip happen in setup -> errors;
    # the gpu-marked skip stays a skip; xfail is not a skip
    r.assert_outcomes(passed=1, failed=1, errors=2, skipped=1, xfailed=1)
    assert "only tests marked for hardware" in r.stdout.str()
    assert r.ret != 0


def test_skips_are_skips_without_ci(pytester, monkeypatch):
    r = run_child(pytester, monkeypatch, "false")
    r.assert_outcomes(passed=1, skipped=4, xfailed=1)
    assert r.ret == 0
