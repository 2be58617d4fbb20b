"""Fixtures for the storage tests; test modules load them with
``pytest_plugins = ["store_fixtures"]`` (helpers live in tests/conftest_store.py).

PostgreSQL: the server named by ``$QKGEOM_TEST_PG_URL`` (``.ci/postgres.sh`` starts one
and prints it). Each test gets a fresh database on it, dropped afterwards. Without the
variable the PostgreSQL cases skip, except under CI (any truthy ``CI``) where they fail.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
from ci_env import skip_or_fail

PG_ENV = "QKGEOM_TEST_PG_URL"
BACKENDS = ["sqlite", "postgresql"]


def pg_server_url() -> str:
    url = os.environ.get(PG_ENV, "").strip()
    if not url:
        msg = (f"${PG_ENV} is not set; start a server with: "
               f'eval "$(bash .ci/postgres.sh | tail -1)"')
        skip_or_fail(msg)
    return url


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL schema for this test, dropped afterwards.

    A schema (selected through ``options=-csearch_path=...`` in the URL) rather than a
    database: CREATE DATABASE costs ~1 s a test, CREATE SCHEMA a few ms, and every table,
    view and alembic_version lands in it all the same.
    """
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    server = make_url(pg_server_url())
    name = f"qkgeom_t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE SCHEMA "{name}"'))
    try:
        yield server.update_query_dict({"options": f"-csearch_path={name}"}).render_as_string(
            hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
        admin.dispose()


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
