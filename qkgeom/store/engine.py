"""Database URLs and engines: which database, how to connect, and what errors look like.

* :func:`resolve_url` picks the URL (``--db``, else ``$QKGEOM_DB``, else
  :data:`DEFAULT_URL`) and validates it; a bare path means a SQLite file.
* :func:`safe_url` masks the password; every message and log line uses it.
* :func:`make_engine` opens SQLite with WAL, a 30 s busy timeout (``$QKGEOM_BUSY_TIMEOUT_S``)
  and foreign keys on, and PostgreSQL through psycopg 3 with a connect timeout, so a dead
  server errors in seconds, and (writing engines) a ``lock_timeout`` of
  :func:`lock_wait_s`. A read-only SQLite engine changes no byte of the file
  (:func:`connect_sqlite_readonly`).
* Writers wait out a database that another writer keeps locked (a ``qkgeom db merge``
  holds SQLite's write lock for its whole copy): :meth:`qkgeom.store.base.StoreBase._write`
  retries SQLite's ``BEGIN IMMEDIATE`` with a line on stderr every busy timeout, up to
  :func:`lock_wait_s` (``$QKGEOM_LOCK_WAIT_S``, default an hour); PostgreSQL waits for
  row and table locks itself, up to the same bound.

SQLite transactions: pysqlite's own implicit BEGIN is switched off and we emit ``BEGIN``
ourselves, ``BEGIN IMMEDIATE`` on write connections (execution option
``qkgeom_write=True``). A deferred transaction that reads and then writes can fail at once
with "database is locked" when another process wrote in between (the busy handler is not
consulted for that upgrade); taking the write lock up front makes concurrent writers
queue on the busy timeout instead.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

from qkgeom.errors import QkgeomError

DEFAULT_URL = "sqlite:///qkgeom.db"  # a file in the current directory
EXAMPLE_URLS = "sqlite:///runs/qkgeom.db, or postgresql+psycopg://user:password@host:5432/qkgeom"
BUSY_TIMEOUT_S = 30  # default of $QKGEOM_BUSY_TIMEOUT_S: SQLite's wait for a lock, per try
LOCK_WAIT_S = 3600  # default of $QKGEOM_LOCK_WAIT_S: how long a writer waits out a lock
PG_CONNECT_TIMEOUT_S = 5


class DatabaseError(QkgeomError):
    """The database could not be opened, read or written."""


class UrlError(DatabaseError):
    """A database URL that cannot be used."""


def _seconds(var: str, default: float) -> float:
    raw = os.environ.get(var, "").strip()
    if not raw:
        return float(default)
    try:
        v = float(raw)
    except ValueError:
        v = math.nan
    if not (v > 0 and math.isfinite(v)):
        raise DatabaseError(f"${var}={raw!r}: give a number of seconds > 0 (default "
                            f"{default:g}), or unset it")
    return v


def busy_timeout_s() -> float:
    """Seconds SQLite waits for another connection's lock before it answers "database is
    locked" (``$QKGEOM_BUSY_TIMEOUT_S``, default :data:`BUSY_TIMEOUT_S`)."""
    return _seconds("QKGEOM_BUSY_TIMEOUT_S", BUSY_TIMEOUT_S)


def lock_wait_s() -> float:
    """Seconds a writer waits out a database that another writer keeps locked before it
    gives up (``$QKGEOM_LOCK_WAIT_S``, default :data:`LOCK_WAIT_S`)."""
    return _seconds("QKGEOM_LOCK_WAIT_S", LOCK_WAIT_S)


def is_locked_error(e: BaseException) -> bool:
    """Whether a DBAPI/SQLAlchemy error means another writer holds a lock this one needs:
    SQLite ``database is locked`` (SQLITE_BUSY), PostgreSQL ``lock_not_available``
    (55P03, a ``lock_timeout``)."""
    import sqlite3

    orig = getattr(e, "orig", None) or e
    if isinstance(orig, sqlite3.OperationalError):
        return (getattr(orig, "sqlite_errorcode", None) == sqlite3.SQLITE_BUSY
                or "database is locked" in str(orig))
    return getattr(orig, "sqlstate", None) == "55P03"


def safe_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (also for URLs that do not parse)."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


def resolve_url(db: str | None) -> str:
    """The database URL to use: ``db``, else ``$QKGEOM_DB``, else :data:`DEFAULT_URL`.

    A value without ``://`` is a path to a SQLite file. ``postgresql://`` and
    ``postgres://`` mean ``postgresql+psycopg://`` (psycopg 3). Raises :class:`UrlError`
    naming the problem and an example for anything else.
    """
    from sqlalchemy.engine import make_url

    raw = (db or "").strip() or os.environ.get("QKGEOM_DB", "").strip() or DEFAULT_URL
    if "://" not in raw:
        # "sqlite:/x.db" or "postgresql:host" are typos of URLs, not file names
        if re.match(r"^[A-Za-z][A-Za-z0-9+.\-]+:", raw):
            raise UrlError(
                f"malformed database URL {safe_url(raw)!r}: missing '://'; "
                f"expected e.g. {EXAMPLE_URLS}"
            )
        return "sqlite:///" + raw
    try:
        u = make_url(raw)
        u.port  # noqa: B018  (a non-numeric port raises here)
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        if isinstance(e, ValueError) and "int()" in reason:
            reason = "the port is not a number"
        raise UrlError(
            f"malformed database URL {safe_url(raw)!r}: {reason}; expected e.g. {EXAMPLE_URLS}"
        ) from None
    backend, _, driver = u.drivername.partition("+")
    if backend == "sqlite":
        if driver not in ("", "pysqlite"):
            raise UrlError(f"unsupported SQLite driver {driver!r} in {safe_url(raw)!r}; use sqlite:///PATH")
        return u.set(drivername="sqlite").render_as_string(hide_password=False)
    if backend in ("postgresql", "postgres"):
        if driver not in ("", "psycopg"):
            raise UrlError(
                f"unsupported PostgreSQL driver {driver!r} in {safe_url(raw)!r}: qkgeom uses "
                "psycopg 3; write postgresql+psycopg://user:password@host:5432/db"
            )
        return u.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    raise UrlError(
        f"unsupported database {backend!r} in {safe_url(raw)!r}: qkgeom stores results in "
        f"SQLite or PostgreSQL, e.g. {EXAMPLE_URLS}"
    )


def backend_of(url: str) -> str:
    """``"sqlite"`` or ``"postgresql"`` for a URL from :func:`resolve_url`."""
    return "sqlite" if url.startswith("sqlite") else "postgresql"


def sqlite_path(url: str) -> str | None:
    """The file of a SQLite URL; None for an in-memory database."""
    from sqlalchemy.engine import make_url

    db = make_url(url).database
    return None if db in (None, "", ":memory:") else db


def check_sqlite_file(url: str, *, create: bool) -> None:
    """Refuse a file that is not a SQLite database before qkgeom writes to it.

    The file is read through SQLite itself (a read-only connection), never with a plain
    ``open()``: closing any descriptor of the file drops every POSIX lock this process
    holds on it, including those of its open SQLite connections. Another process closing
    its own connection then takes itself for the last one, checkpoints and deletes the
    WAL, and what this process writes afterwards is lost to everyone else. SQLite's own
    file layer keeps such descriptors open until the process's locks are released.
    """
    path = sqlite_path(url)
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise DatabaseError(f"{path} is a directory, not a SQLite database file")
    if p.exists():
        if p.stat().st_size == 0:
            return  # SQLite treats an empty file as an empty database
        why = _sqlite_refusal(p)
        if why is not None:
            raise DatabaseError(
                f"{path} is not a SQLite database (SQLite says: {why}); give a qkgeom "
                "database file or a new path"
            )
        return
    if not create:
        raise DatabaseError(
            f"no database at {path}; create one with: qkgeom db upgrade --db {safe_url(url)}"
        )
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DatabaseError(f"cannot create the directory for {path}: {e.strerror}") from None


def _sqlite_refusal(p: Path) -> str | None:
    """SQLite's reason not to read ``p`` as a database (``file is not a database``), or
    None. Other errors (a lock, a permission) are left to the real connection to report."""
    import sqlite3

    try:
        # immutable: only the header page is read, and no -wal or -shm file is created
        # (a mode=ro connection to a WAL database would create both and leave them)
        con = sqlite3.connect(p.absolute().as_uri() + "?mode=ro&immutable=1", uri=True)
        try:
            con.execute("PRAGMA schema_version").fetchone()  # reads the header page
        finally:
            con.close()
    except sqlite3.DatabaseError as e:
        if getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_NOTADB or \
                "not a database" in str(e):
            return str(e)
    return None


def _wal(cur: Any) -> None:
    """``PRAGMA journal_mode=WAL``, retried while another connection holds the lock the
    switch needs (two processes opening one brand-new file at once): SQLite can answer
    "database is locked" here without waiting on the busy timeout."""
    import sqlite3
    import time

    deadline = time.monotonic() + busy_timeout_s()
    while True:
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def connect_sqlite_readonly(path: str, timeout: float | None = None) -> Any:
    """A sqlite3 connection that reads the file ``path`` and changes none of its bytes.

    With a ``-wal`` file present (a writer has the database open, or one died), the file
    is opened ``mode=ro``: a read-write connection that closes last would checkpoint that
    WAL into the file and delete it. Without one, a read-write connection (which
    ``PRAGMA query_only`` keeps from writing): on a WAL database it creates the ``-wal``
    and ``-shm`` files and, closing last, deletes them again, where ``mode=ro`` would
    leave both behind. A rollback-journal database stays one (no ``journal_mode``
    switch). The caller sets ``query_only``."""
    import sqlite3

    t = busy_timeout_s() if timeout is None else timeout
    p = Path(path)
    if Path(f"{p}-wal").exists():
        return sqlite3.connect(p.absolute().as_uri() + "?mode=ro", uri=True, timeout=t,
                               check_same_thread=False)
    return sqlite3.connect(str(p), timeout=t, check_same_thread=False)


def connect_sqlite_mode_ro(path: str, timeout: float) -> Any:
    """A sqlite3 connection to the file ``path`` through a read-only file handle
    (``mode=ro``): no statement can change the file, whatever ``PRAGMA query_only`` says.
    On a WAL database SQLite creates the ``-wal`` and ``-shm`` files if they are missing
    (the directory must be writable) and leaves them for the next connection."""
    import sqlite3

    return sqlite3.connect(Path(path).absolute().as_uri() + "?mode=ro", uri=True,
                           timeout=timeout, check_same_thread=False)


def make_engine(url: str, *, create: bool = True, readonly: bool = False,
                foreign_keys: bool = True, file_readonly: bool = False) -> Any:
    """A SQLAlchemy engine for a URL from :func:`resolve_url` (connects lazily).

    ``readonly``: every connection refuses writes at the database level (SQLite
    ``PRAGMA query_only``, and the file changes no byte: :func:`connect_sqlite_readonly`;
    PostgreSQL ``default_transaction_read_only``). Writing PostgreSQL engines wait for
    locks up to :func:`lock_wait_s` (``lock_timeout``, whatever the server's default).
    ``foreign_keys=False`` is for migrations: SQLite's batch mode rebuilds tables, and
    dropping a parent table with foreign keys on would cascade-delete its children.
    ``file_readonly`` (implies ``readonly``; the live page): every SQLite connection opens
    the file ``mode=ro`` (:func:`connect_sqlite_mode_ro`).
    """
    readonly = readonly or file_readonly
    if backend_of(url) == "sqlite":
        return _sqlite_engine(url, create=create, readonly=readonly,
                              foreign_keys=foreign_keys, file_readonly=file_readonly)
    return _pg_engine(url, readonly=readonly)


def _sqlite_engine(url: str, *, create: bool, readonly: bool, foreign_keys: bool,
                   file_readonly: bool) -> Any:
    """:func:`make_engine` for SQLite (see there)."""
    from sqlalchemy import create_engine, event
    from sqlalchemy.pool import StaticPool

    check_sqlite_file(url, create=create)
    path = sqlite_path(url)
    memory = path is None
    busy = busy_timeout_s()
    kw: dict[str, Any] = {"connect_args": {"timeout": busy}}
    if memory:
        kw.update(poolclass=StaticPool, connect_args={"check_same_thread": False})
    elif file_readonly:
        kw["creator"] = lambda: connect_sqlite_mode_ro(path, busy)  # type: ignore[arg-type]
    elif readonly:
        kw["creator"] = lambda: connect_sqlite_readonly(path, busy)  # type: ignore[arg-type]
    engine = create_engine(url, **kw)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves (see module doc)
        cur = dbapi_conn.cursor()
        try:
            # PRAGMAs take no bind parameters; both values are our own constants
            cur.execute(f"PRAGMA busy_timeout={int(busy * 1000)}")
            if not memory and not readonly:
                _wal(cur)
            cur.execute(f"PRAGMA foreign_keys={'ON' if foreign_keys else 'OFF'}")
            cur.execute("PRAGMA synchronous=NORMAL")  # safe with WAL; no fsync per commit
            if readonly:
                cur.execute("PRAGMA query_only=ON")
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        write = conn.get_execution_options().get("qkgeom_write", False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")

    return engine


def _pg_engine(url: str, *, readonly: bool) -> Any:
    """:func:`make_engine` for PostgreSQL (see there)."""
    from sqlalchemy import create_engine
    from sqlalchemy.engine import make_url

    u = make_url(url)
    connect_args: dict[str, Any] = {"application_name": "qkgeom"}
    if "connect_timeout" not in u.query:
        connect_args["connect_timeout"] = PG_CONNECT_TIMEOUT_S
    # appended to any options= the URL already carries (e.g. search_path): ours win
    opts = u.query.get("options", "")
    opts = " ".join(opts) if isinstance(opts, tuple) else opts
    if readonly:
        connect_args["options"] = (opts + " -c default_transaction_read_only=on").strip()
    else:  # wait out a lock (a DBA's lock_timeout too) up to the bound, never fail at once
        wait_ms = int(lock_wait_s() * 1000)
        connect_args["options"] = (opts + f" -c lock_timeout={wait_ms}").strip()
    engine = create_engine(url, connect_args=connect_args, pool_pre_ping=True)
    if readonly:
        from sqlalchemy import event

        @event.listens_for(engine, "begin")
        def _pg_begin(conn: Any) -> None:
            # a query after SET TRANSACTION READ ONLY: a later "SET TRANSACTION READ WRITE"
            # in the user's SQL is then an error, not a way around the read-only mode
            plain = {"stream_results": False}  # not through a server-side cursor
            conn.exec_driver_sql("SET TRANSACTION READ ONLY", execution_options=plain)
            conn.exec_driver_sql("SELECT 1", execution_options=plain)

    return engine


def describe_db_error(e: BaseException, url: str) -> str:
    """One line from a DBAPI/SQLAlchemy error, with any password scrubbed."""
    orig = getattr(e, "orig", None) or e
    text = " ".join(line.strip() for line in str(orig).splitlines() if line.strip())
    text = text or type(orig).__name__
    from sqlalchemy.engine import make_url

    try:
        pw = make_url(url).password
    except Exception:
        pw = None
    if pw:
        text = text.replace(str(pw), "***")
    return text


def connect_error(e: BaseException, url: str) -> DatabaseError:
    return DatabaseError(f"cannot open database {safe_url(url)}: {describe_db_error(e, url)}")
