"""URL resolution and password masking (no database needed)."""

from __future__ import annotations

import pytest

from qkgeom.errors import QkgeomError
from qkgeom.store import DEFAULT_URL, resolve_url, safe_url


def test_explicit_env_default(monkeypatch):
    monkeypatch.delenv("QKGEOM_DB", raising=False)
    assert resolve_url(None) == DEFAULT_URL == "sqlite:///qkgeom.db"
    monkeypatch.setenv("QKGEOM_DB", "sqlite:///from_env.db")
    assert resolve_url(None) == "sqlite:///from_env.db"
    assert resolve_url("sqlite:///explicit.db") == "sqlite:///explicit.db"


def test_bare_paths_are_sqlite():
    assert resolve_url("runs/x.db") == "sqlite:///runs/x.db"
    assert resolve_url("/tmp/x.db") == "sqlite:////tmp/x.db"


def test_postgres_urls_use_psycopg3():
    assert resolve_url("postgresql://u:p@h/db") == "postgresql+psycopg://u:p@h/db"
    assert resolve_url("postgres://u:p@h:5433/db") == "postgresql+psycopg://u:p@h:5433/db"
    assert resolve_url("postgresql+psycopg://u@h/db") == "postgresql+psycopg://u@h/db"


@pytest.mark.parametrize("bad, why", [
    ("postgresql+psycopg://u:secret@h:notaport/db", "port is not a number"),
    ("mysql://u:secret@h/db", "unsupported database 'mysql'"),
    ("postgresql+psycopg2://u:secret@h/db", "psycopg 3"),
    ("sqlite:/x.db", "missing '://'"),
    ("://nothing", "malformed"),
])
def test_malformed_urls_name_the_problem(bad, why):
    with pytest.raises(QkgeomError) as e:
        resolve_url(bad)
    msg = str(e.value)
    assert why in msg
    assert "secret" not in msg
    assert "\n" not in msg
    assert "e.g." in msg or "write postgresql+psycopg://" in msg


def test_safe_url_masks_passwords():
    assert safe_url("postgresql+psycopg://u:secret@h/db") == "postgresql+psycopg://u:***@h/db"
    assert "secret" not in safe_url("postgresql+psycopg://u:secret@h:bad/db")
    assert safe_url("sqlite:///x.db") == "sqlite:///x.db"
