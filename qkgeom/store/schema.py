"""Schema revisions: where the migrations live, upgrading, and the check on every open.

The alembic scripts are the top-level ``migrations/`` folder of a checkout, installed as
the package ``qkgeom.migrations`` from a wheel; :func:`migrations_dir` finds either.
Every open compares the database's ``alembic_version`` with this qkgeom's head:

* equal: fine;
* older (a revision we know): refused, the message names ``qkgeom db upgrade --db URL``;
* unknown (written by a newer qkgeom): refused, and never downgraded;
* no version table and none of our tables: a new database, created at head.

Upgrades hold a lock for their whole transaction (SQLite ``BEGIN IMMEDIATE``; PostgreSQL
``pg_advisory_xact_lock``), so processes that open one new database together create it
once.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkgeom.errors import QkgeomError
from qkgeom.store.engine import (
    DatabaseError,
    connect_error,
    make_engine,
    safe_url,
)

ADVISORY_LOCK_ID = 0x716B67656F6D  # "qkgeom": serialises migrations on PostgreSQL


class SchemaError(QkgeomError):
    """The database's schema revision does not match this qkgeom."""


@dataclass(frozen=True)
class SchemaState:
    """Where a database stands: its revision(s), this qkgeom's head, and a verdict."""

    current: tuple[str, ...]  # revisions in alembic_version; () for a new database
    head: str
    verdict: str  # "head" | "empty" | "outdated" | "newer" | "foreign"

    @property
    def revision(self) -> str | None:
        return self.current[0] if self.current else None


def migrations_dir() -> Path:
    """The alembic script folder: ``qkgeom.migrations`` if installed, else the checkout's."""
    spec = importlib.util.find_spec("qkgeom.migrations")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    import qkgeom

    here = Path(qkgeom.__file__).resolve().parent.parent / "migrations"
    if (here / "env.py").exists():
        return here
    raise QkgeomError(
        "qkgeom's database migrations are missing from this installation "
        "(expected the package qkgeom.migrations); reinstall qkgeom"
    )


def alembic_config(connection: Any = None) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()).replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


@functools.lru_cache(maxsize=1)
def _script() -> Any:
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    heads = _script().get_heads()
    if len(heads) != 1:
        raise QkgeomError(f"qkgeom's migrations have {len(heads)} heads; expected one")
    return heads[0]


def known_revisions() -> list[str]:
    """Every revision this qkgeom knows, oldest first."""
    return [s.revision for s in reversed(list(_script().walk_revisions()))]


def _ours(tables: set[str]) -> bool:
    from qkgeom.store.models import TABLES

    return bool(tables & set(TABLES))


def inspect_state(conn: Any) -> SchemaState:
    """Read the schema state through an open connection (changes nothing)."""
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import inspect

    head = head_revision()
    current = tuple(MigrationContext.configure(conn).get_current_heads())
    known = set(known_revisions())
    if not current:
        tables = set(inspect(conn).get_table_names())
        verdict = "foreign" if _ours(tables) else "empty"
    elif any(r not in known for r in current):
        verdict = "newer"
    elif current == (head,):
        verdict = "head"
    else:
        verdict = "outdated"
    return SchemaState(current=current, head=head, verdict=verdict)


def refusal(state: SchemaState, url: str) -> SchemaError | None:
    """The error to raise for a state no command may use as is (None when usable)."""
    from qkgeom import __version__

    shown = safe_url(url)
    rev = ", ".join(state.current)
    if state.verdict == "newer":
        return SchemaError(
            f"database {shown} has schema revision {rev}, which this qkgeom {__version__} "
            f"does not know (its newest is {state.head}): it was written by a newer qkgeom; "
            "upgrade qkgeom to use it (qkgeom never downgrades a database)"
        )
    if state.verdict == "outdated":
        return SchemaError(
            f"database {shown} has schema revision {rev}, older than this qkgeom's "
            f"{state.head}; run: qkgeom db upgrade --db {shown}"
        )
    if state.verdict == "foreign":
        return SchemaError(
            f"database {shown} holds qkgeom tables but no alembic_version (not created by "
            "qkgeom, or damaged); refusing to touch it"
        )
    return None


def _lock(conn: Any) -> None:
    if conn.dialect.name == "postgresql":
        from sqlalchemy import text

        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": ADVISORY_LOCK_ID})


def _migrate(url: str, action: Any, engine: Any = None) -> tuple[SchemaState, SchemaState]:
    """Run ``action(cfg, state)`` in one locked transaction; return (before, after).

    ``engine``: migrate through this engine (an in-memory SQLite database exists only in
    its own engine) instead of a fresh one with foreign keys off.
    """
    from sqlalchemy.exc import SQLAlchemyError

    own = engine is None
    if own:
        engine = make_engine(url, create=True, foreign_keys=False)
    try:
        with engine.connect() as conn:
            conn.execution_options(qkgeom_write=True)
            with conn.begin():
                _lock(conn)
                before = inspect_state(conn)
                action(alembic_config(conn), before)
                after = inspect_state(conn)
                if conn.dialect.name == "sqlite":
                    from sqlalchemy import text

                    bad = conn.execute(text("PRAGMA foreign_key_check")).fetchall()
                    if bad:
                        raise DatabaseError(
                            f"migration left {len(bad)} foreign-key violations; rolled back"
                        )
            return before, after
    except QkgeomError:
        raise
    except SQLAlchemyError as e:
        raise connect_error(e, url) from None
    finally:
        if own:
            engine.dispose()


def upgrade(url: str, revision: str = "head", *,
            engine: Any = None) -> tuple[SchemaState, SchemaState]:
    """Create or upgrade the database to ``revision``; refuses a newer or foreign one."""

    def act(cfg: Any, state: SchemaState) -> None:
        from alembic import command

        if state.verdict in ("newer", "foreign"):
            raise refusal(state, url)  # type: ignore[misc]
        if state.verdict != "head" or revision != "head":
            command.upgrade(cfg, revision)

    return _migrate(url, act, engine)


def downgrade(url: str, revision: str) -> tuple[SchemaState, SchemaState]:
    """Downgrade to ``revision`` (``"base"`` drops everything). For tests and recovery."""

    def act(cfg: Any, state: SchemaState) -> None:
        from alembic import command

        if state.verdict in ("newer", "foreign"):
            raise refusal(state, url)  # type: ignore[misc]
        command.downgrade(cfg, revision)

    return _migrate(url, act)


def current(url: str) -> SchemaState:
    """The schema state of an existing database (creates and changes nothing)."""
    from sqlalchemy.exc import SQLAlchemyError

    engine = make_engine(url, create=False, readonly=True)
    try:
        with engine.connect() as conn:
            return inspect_state(conn)
    except SQLAlchemyError as e:
        raise connect_error(e, url) from None
    finally:
        engine.dispose()
