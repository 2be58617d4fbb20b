"""What every part of the :class:`~qkgeom.store.Store` shares: the engine, managed
connections (one transaction per write, errors mapped to one-line messages), cached
upsert statements, and the float and status conventions of storage."""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from qkgeom.errors import QkgeomError
from qkgeom.store.engine import (
    DatabaseError,
    busy_timeout_s,
    describe_db_error,
    is_locked_error,
    lock_wait_s,
    safe_url,
)
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


def lock_note(line: str) -> None:
    """A writer waits out a locked database: say so on stderr (the sweep driver's and
    ``qkgeom train``'s terminal or log)."""
    print(line, file=sys.stderr, flush=True)


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
            if is_locked_error(e):
                raise DatabaseError(
                    f"database {self.safe_url} stayed locked by another writer longer than "
                    f"qkgeom waits ({lock_wait_s():g} s, $QKGEOM_LOCK_WAIT_S): {msg}; this "
                    "write was not stored. End what holds the lock (a qkgeom db merge, an "
                    "open transaction in psql or sqlite3), then run the command again"
                ) from None
            raise DatabaseError(f"database error on {self.safe_url}: {msg}") from None

    @contextlib.contextmanager
    def _write(self) -> Iterator[Any]:
        """One write transaction (SQLite: BEGIN IMMEDIATE), committed on success.

        A SQLite database that another writer keeps locked past the busy timeout (a
        ``qkgeom db merge`` holds the write lock for its whole copy) is waited out: the
        ``BEGIN IMMEDIATE`` is tried again, with a line on stderr each busy timeout, for
        up to :func:`~qkgeom.store.engine.lock_wait_s` seconds; only then does the write
        fail. With BEGIN IMMEDIATE in WAL mode a writer meets another's lock only there.
        PostgreSQL waits for locks inside each statement (its ``lock_timeout`` is the same
        bound, :func:`~qkgeom.store.engine.make_engine`)."""
        with self._errors():
            conn, tx = self._begin_write()
            with conn, tx:
                yield conn

    def _begin_write(self) -> tuple[Any, Any]:
        """A connection with its write transaction begun, once the lock is free."""
        from sqlalchemy.exc import OperationalError

        t0 = time.monotonic()
        bound = None
        while True:
            conn = self.engine.connect()
            try:
                conn.execution_options(qkgeom_write=True)
                return conn, conn.begin()
            except OperationalError as e:
                conn.close()
                if not is_locked_error(e):
                    raise
                bound = lock_wait_s() if bound is None else bound
                waited = time.monotonic() - t0
                if waited >= bound:
                    raise
                lock_note(f"{self.safe_url}: database locked by another writer for "
                          f"{waited:.0f} s; waiting (up to {bound:.0f} s, "
                          "$QKGEOM_LOCK_WAIT_S; a qkgeom db merge holds the lock while it "
                          "copies)")
                time.sleep(min(0.1, busy_timeout_s()))
            except BaseException:
                conn.close()
                raise

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
