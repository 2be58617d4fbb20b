"""Session-wide fixtures: where the real WikiText files are, and a private data cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _data_dir() -> Path | None:
    for cand in (os.environ.get("QKGEOM_DATA"), ROOT.parent / "shared" / "data" / "wikitext"):
        if cand and (Path(cand) / "wiki.valid.raw").exists():
            return Path(cand).resolve()
    return None


def pytest_configure(config: pytest.Config) -> None:
    # A private encoded-corpus cache per test session (workers inherit the environment).
    if "QKGEOM_CACHE" not in os.environ:
        cache = Path(config.rootpath) / ".pytest_cache" / "qkgeom-data"
        cache.mkdir(parents=True, exist_ok=True)
        os.environ["QKGEOM_CACHE"] = str(cache)


@pytest.fixture(scope="session")
def wikitext_dir() -> Path:
    """The real WikiText raw validation/test files (QKGEOM_DATA or ../shared/data/wikitext).

    Under CI (``CI=true``) their absence fails the run instead of skipping.
    """
    d = _data_dir()
    if d is None:
        msg = "WikiText files not found: set QKGEOM_DATA to a directory with wiki.valid.raw"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return d


@pytest.fixture(scope="session")
def corpus(wikitext_dir: Path):
    from qkgeom.data import load_corpus

    return load_corpus(str(wikitext_dir))


@pytest.fixture
def tiny_cfg(wikitext_dir: Path):
    """A 2-layer, n_embd 32 trial that trains in a couple of seconds."""
    from qkgeom.config import preset

    return preset("smoke").with_overrides({"dataset": str(wikitext_dir)})
