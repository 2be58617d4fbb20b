"""What every part of the :class:`~qkgeom.store.Store` shares: the engine, managed
connections (one transaction per write, errors mapped to one-line messages), cached
upsert statements, and the float and status conventions of storage."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from qkgeom.errors import QkgeomError
from qkgeom.store.engine import DatabaseError, describe_db_error, safe_url
from qkgeom.store.models import CHECKPOINT_KINDS, STATUSES

if TYPE_CHECKING:
    from qkgeom.store.store import Store


class ReadOnlyError(QkgeomError):
    """A statement tried to modify a database opened read-only."""


def now_utc() -> datetime:
    return datetime.now(timezone.utc)


def stored_float(x: Any) -> float | None:
    """A float for storage: NaN -> NULL (SQLite cannot hold NaN); +-inf kept."""
    if x is None:
        return None
    x = float(x)
    return None if x != x else x


def loaded_float(x: float | None) -> float:
    """A stored float back: NULL -> NaN."""
    return math.nan if x is None else float(x)


def check_status(status: str) -> None:
    if status not in STATUSES:
        raise QkgeomError(f"unknown trial status {status!r}; choose from {', '.join(STATUSES)}")


def check_kind(kind: str) -> None:
    if kind not in CHECKPOINT_KINDS:
        raise QkgeomError(f"unknown checkpoint kind {kind!r}; choose from "
                          f"{', '.join(CHECKPOINT_KINDS)}")


def is_readonly_error(msg: str) -> bool:
    low = msg.lower()
    return ("readonly database" in low or "read-only transaction" in low
            or "read only" in low and "transaction" in low)


class StoreBase:
    """The plumbing of :class:`~qkgeom.store.Store` (see there)."""

    def __init__(self, engine: Any, url: str, *, revision: str, readonly: bool = False):
        self.engine = engine
        self.url = url  # with password: never print it; use safe_url
        self.safe_url = safe_url(url)
        self.revision = revision
        self.readonly = readonly
        self.dialect = engine.dialect.name
        self._stmts: dict[str, Any] = {}

    # ------------------------------------------------------------------ plumbing
    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.safe_url!r}, revision={self.revision!r})"

    def __reduce__(self) -> Any:
        raise TypeError(
            "a qkgeom Store holds a database engine and cannot be pickled; pass the URL "
            "and call qkgeom.store.open_store(url) where it is needed"
        )

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        from sqlalchemy.exc import SQLAlchemyError

        try:
            yield
        except SQLAlchemyError as e:
            msg = describe_db_error(e, self.url)
            if is_readonly_error(msg):
                raise ReadOnlyError(
                    f"refused: {self.safe_url} is open read-only and the statement would "
                    f"modify it ({msg}); run it with --write to allow changes"
                ) from None
            raise DatabaseError(f"database error on {self.safe_url}: {msg}") from None

    @contextlib.contextmanager
    def _write(self) -> Iterator[Any]:
        """One write transaction (SQLite: BEGIN IMMEDIATE), committed on success."""
        with self._errors(), self.engine.connect() as conn:
            conn.execution_options(qkgeom_write=True)
            with conn.begin():
                yield conn

    @contextlib.contextmanager
    def _read(self) -> Iterator[Any]:
        with self._errors(), self.engine.connect() as conn:
            yield conn

    def _insert(self, table: Any) -> Any:
        if self.dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        else:
            from sqlalchemy.dialects.sqlite import insert
        return insert(table)

    def _upsert(self, model: Any, keys: Sequence[str], update: Sequence[str]) -> Any:
        """A cached ``INSERT ... ON CONFLICT (keys) DO UPDATE SET update = excluded``."""
        name = f"upsert:{model.__tablename__}"
        stmt = self._stmts.get(name)
        if stmt is None:
            ins = self._insert(model.__table__)
            stmt = ins.on_conflict_do_update(
                index_elements=list(keys), set_={c: ins.excluded[c] for c in update}
            )
            self._stmts[name] = stmt
        return stmt
