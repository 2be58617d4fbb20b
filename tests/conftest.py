"""Every fixture of the tests (where the real WikiText files are, a private data cache,
scratch directories, SQLite and PostgreSQL databases) and the
CI rule: under CI (any truthy ``CI``: true, 1, yes, on) a skipped test fails the run unless
it carries a marker for hardware the machine lacks (``@pytest.mark.gpu``); see
tests/ci_env.py."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from ci_env import HARDWARE_MARKERS, skip_or_fail, under_ci

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


# --------------------------------------------------------------------------- CI: no skips


def _ci_skip_message(reason: str) -> str:
    marks = ", ".join(f"@pytest.mark.{m}" for m in HARDWARE_MARKERS)
    return (f"skipped under CI={os.environ.get('CI')!r}: {reason}. CI runs every test; only "
            f"tests marked for hardware the machine lacks ({marks}) may skip")


def _skip_reason(longrepr) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    rep = outcome.get_result()
    if not (rep.skipped and under_ci()) or hasattr(rep, "wasxfail"):
        return
    if any(item.get_closest_marker(m) for m in HARDWARE_MARKERS):
        return
    rep.outcome = "failed"
    rep.longrepr = _ci_skip_message(_skip_reason(rep.longrepr))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    # a whole module skipped at import (pytest.skip(allow_module_level=True), importorskip)
    outcome = yield
    rep = outcome.get_result()
    if rep.skipped and under_ci():
        rep.outcome = "failed"
        rep.longrepr = _ci_skip_message(_skip_reason(rep.longrepr))


@pytest.fixture(scope="session")
def wikitext_dir() -> Path:
    """The real WikiText raw validation/test files (QKGEOM_DATA or ../shared/data/wikitext).

    Under CI (any truthy ``CI``) their absence fails the run instead of skipping.
    """
    d = _data_dir()
    if d is None:
        msg = "WikiText files not found: set QKGEOM_DATA to a directory with wiki.valid.raw"
        skip_or_fail(msg)
    return d


@pytest.fixture(scope="session")
def corpus(wikitext_dir: Path):
    from qkgeom.engine.data import load_corpus

    return load_corpus(str(wikitext_dir))


@pytest.fixture
def tiny_cfg(wikitext_dir: Path):
    """A 2-layer, n_embd 32 trial that trains in a couple of seconds."""
    from qkgeom.config import preset

    return preset("smoke").with_overrides({"dataset": str(wikitext_dir)})


# --------------------------------------------------------------------------- databases
# PostgreSQL: the server named by ``$QKGEOM_TEST_PG_URL`` (``.ci/postgres.sh`` starts one
# and prints it). Without the variable the PostgreSQL cases skip, except under CI (any
# truthy ``CI``) where they fail.

PG_ENV = "QKGEOM_TEST_PG_URL"
BACKENDS = ["sqlite", "postgresql"]


def pg_server_url() -> str:
    url = os.environ.get(PG_ENV, "").strip()
    if not url:
        msg = (f"${PG_ENV} is not set; start a server with: "
               f'eval "$(bash .ci/postgres.sh | tail -1)"')
        skip_or_fail(msg)
    return url


DDL = {"schema": ('CREATE SCHEMA "{}"', 'DROP SCHEMA IF EXISTS "{}" CASCADE'),
       "database": ('CREATE DATABASE "{}"', 'DROP DATABASE IF EXISTS "{}" WITH (FORCE)')}


def _pg_scratch(kind: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL schema or database on the test server, dropped after."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    server = make_url(pg_server_url())
    name = f"qkgeom_t_{uuid.uuid4().hex[:12]}"
    create, drop = DDL[kind]
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(create.format(name)))
    try:
        url = (server.update_query_dict({"options": f"-csearch_path={name}"})
               if kind == "schema" else server.set(database=name))
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(drop.format(name)))
        admin.dispose()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL schema for this test, dropped afterwards.

    A schema (selected through ``options=-csearch_path=...`` in the URL) rather than a
    database: CREATE DATABASE costs ~1 s a test, CREATE SCHEMA a few ms, and every table,
    view and alembic_version lands in it all the same.
    """
    yield from _pg_scratch("schema")


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'results.db'}"


@pytest.fixture(params=BACKENDS)
def db_url(request) -> str:
    """A URL of a new, empty database, once for SQLite and once for PostgreSQL."""
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_url")
    return request.getfixturevalue("pg_url")


@pytest.fixture
def store(db_url):
    from qkgeom.store import open_store

    s = open_store(db_url)
    yield s
    s.close()


@pytest.fixture
def pg_database_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test (sweeps whose Ray workers connect
    on their own), dropped afterwards."""
    yield from _pg_scratch("database")


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A short scratch directory under /tmp (Unix socket paths must stay short)."""
    d = Path(tempfile.mkdtemp(prefix="qksw-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
