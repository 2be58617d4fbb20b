"""``qkgeom query`` without ``--write``: one statement that cannot change any database.

Read-only by construction, in layers (docs/schema.md states the guarantee):

SQLite
  * A fresh connection to the file as ``file:PATH?mode=ro`` (a read-only file handle: no
    write can reach the file whatever the SQL).
  * An authorizer that allows only reading: SELECT, reading columns, functions, recursive
    CTEs and read-only PRAGMAs. ATTACH (which would create a file), DETACH, transaction
    statements, SAVEPOINT, writing PRAGMAs and every write are refused while the statement
    is compiled, i.e. before anything runs.
  * The statement runs inside a ``BEGIN`` that we roll back, so ``VACUUM [INTO file]`` is
    refused ("cannot VACUUM from within a transaction").
  * One statement per call: the sqlite3 module compiles the first and refuses the call if
    anything but whitespace and comments follows, before executing anything.

PostgreSQL
  * A dedicated connection (``default_transaction_read_only=on``) inside ``BEGIN READ
    ONLY``, rolled back afterwards; the connection is then discarded, so no session
    setting it made (``set_config``) outlives the call.
  * The statement goes through the extended query protocol (a prepared statement), which
    the server refuses for more than one command: ``COMMIT; DELETE ...`` cannot end the
    read-only transaction and then write.
  * Only SELECT, WITH, VALUES, TABLE, SHOW and EXPLAIN are run (no COPY, DO, CALL, SET,
    LOAD, transaction control), and functions with effects outside the transaction
    (``pg_terminate_backend``, ``lo_import``, ``dblink``, ``set_config``, ...) are
    refused by name.
  * Afterwards the transaction must still be open and read-only, else the call fails.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkgeom.errors import QkgeomError
from qkgeom.store.engine import BUSY_TIMEOUT_S, describe_db_error, sqlite_path
from qkgeom.store.frames import result_frame

if TYPE_CHECKING:
    from qkgeom.store.store import Store

HINT = "run it with --write to allow changes"
ALLOWED_FIRST = ("select", "with", "values", "table", "show", "explain")
SQLITE_FIRST = ("select", "with", "values", "pragma", "explain")

# PostgreSQL functions with effects that a read-only transaction does not stop (signals,
# server files, other databases, replication, session settings) or that run SQL text
_PG_DENIED = re.compile(
    r"\b(pg_terminate_backend|pg_cancel_backend|pg_reload_conf|pg_rotate_logfile\w*"
    r"|pg_switch_wal|pg_switch_xlog|pg_promote|pg_create_restore_point"
    r"|pg_\w*replication_slot\w*|pg_replication_origin_\w+|pg_logical_emit_message"
    r"|pg_stat_reset\w*|pg_stat_statements_reset|pg_log_backend_memory_contexts"
    r"|pg_file_\w+|lo_\w+|lowrite|dblink\w*|pg_notify|set_config|query_to_xml\w*"
    r"|ts_stat|ts_rewrite|pg_import_system_collations|pg_start_backup|pg_stop_backup"
    r"|pg_backup_start|pg_backup_stop|pg_wal_replay_\w+|brin_\w*summarize\w*"
    r"|gin_clean_pending_list|pg_truncate_visibility_map)\s*\(",
    re.IGNORECASE)

# SQLite PRAGMAs that only report: with an argument (a table or index name) or without
_SQLITE_QUERY_PRAGMAS = {
    "table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
    "foreign_key_list", "foreign_key_check", "integrity_check", "quick_check",
    "function_list", "module_list", "pragma_list", "collation_list", "database_list",
    "compile_options",
}
_SQLITE_SETTING_PRAGMAS = {  # read-only without an argument (with one they change things)
    "user_version", "schema_version", "application_id", "page_count", "page_size",
    "freelist_count", "encoding", "journal_mode", "foreign_keys", "query_only",
    "data_version", "auto_vacuum", "cache_size", "busy_timeout", "max_page_count",
    "synchronous", "temp_store", "wal_autocheckpoint", "locking_mode", "recursive_triggers",
}


class ReadOnlyRefusal(QkgeomError):
    """A statement that ``qkgeom query`` refuses to run without ``--write``."""


def _refuse(what: str) -> ReadOnlyRefusal:
    return ReadOnlyRefusal(f"refused: {what}; without --write the database is opened "
                           f"read-only and one reading statement runs; {HINT}")


def first_keyword(sql: str) -> str:
    """The first word of ``sql`` after comments, whitespace and opening parentheses."""
    i, n = 0, len(sql)
    while i < n:
        c = sql[i]
        if c.isspace() or c == "(":
            i += 1
        elif sql.startswith("--", i):
            j = sql.find("\n", i)
            i = n if j < 0 else j + 1
        elif sql.startswith("/*", i):  # PostgreSQL block comments nest
            depth, i = 1, i + 2
            while i < n and depth:
                if sql.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif sql.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        else:
            break
    m = re.match(r"[A-Za-z_]+", sql[i:])
    return m.group(0).lower() if m else sql[i:i + 10].strip()


class _Rows:
    """What :func:`qkgeom.store.frames.result_frame` needs from a result."""

    def __init__(self, keys: list[str], rows: list[tuple]) -> None:
        self._keys, self._rows = keys, rows

    def keys(self) -> list[str]:
        return self._keys

    def __iter__(self) -> Any:
        return iter(self._rows)


def run_readonly(store: Store, sql: str) -> Any:
    """Run one reading statement on ``store`` (any Store); a polars DataFrame."""
    if not sql.strip():
        raise ReadOnlyRefusal("no SQL given; pass one SELECT statement")
    if store.dialect == "sqlite":
        keys, rows = _sqlite(store, sql)
    else:
        keys, rows = _postgres(store, sql)
    return result_frame(_Rows(keys, rows))


# ---------------------------------------------------------------------- SQLite
def _more_than_one(sql: str) -> bool:
    """True if ``sql`` holds more than one SQLite statement (strings and comments aware)."""
    import sqlite3

    for i, c in enumerate(sql):
        if c == ";" and sqlite3.complete_statement(sql[:i + 1]):
            rest = sql[i + 1:]
            return bool(first_keyword(rest.replace(";", " ")))
    return False


def _sqlite_connection(store: Store) -> tuple[Any, Any]:
    """``(sqlite3 connection, raw pool connection or None)``: the file opened read-only
    (``mode=ro``), or for an in-memory database the engine's own connection."""
    import sqlite3

    path = sqlite_path(store.url)
    if path is None:  # in-memory: only the engine's own connection sees it
        raw = store.engine.raw_connection()
        return raw.driver_connection, raw
    uri = Path(path).absolute().as_uri() + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, timeout=BUSY_TIMEOUT_S)
    except sqlite3.Error as e:
        raise QkgeomError(f"cannot open {path} read-only: {e}") from None
    return conn, None


def _sqlite_authorizer(denied: list[str]) -> Callable[..., int]:
    """An authorizer that allows reading only; what it refuses is appended to ``denied``."""
    import sqlite3

    def authorizer(action: int, a1: Any, a2: Any, db: Any, trigger: Any) -> int:
        ok = sqlite3.SQLITE_OK
        if action in (sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE):
            return ok
        if action == sqlite3.SQLITE_FUNCTION:
            if str(a2).lower() in ("load_extension", "writefile", "edit"):
                denied.append(f"the function {a2}()")
                return sqlite3.SQLITE_DENY
            return ok
        if action == sqlite3.SQLITE_PRAGMA:
            name = str(a1).lower()
            if name in _SQLITE_QUERY_PRAGMAS or (name in _SQLITE_SETTING_PRAGMAS and a2 is None):
                return ok
            denied.append(f"PRAGMA {a1}" + (f"={a2}" if a2 is not None else ""))
            return sqlite3.SQLITE_DENY
        if action == sqlite3.SQLITE_UPDATE and a1 in ("sqlite_master", "sqlite_schema") \
                and trigger is None and not denied:
            # SQLite's own check when an eponymous virtual table (pragma_table_info(...))
            # is first used; the file is open read-only (mode=ro) so nothing is written
            return ok
        denied.append(_SQLITE_ACTIONS.get(action, f"operation {action}")
                      + (f" {a1}" if action in (sqlite3.SQLITE_ATTACH,) and a1 else ""))
        return sqlite3.SQLITE_DENY

    return authorizer


def _sqlite(store: Store, sql: str) -> tuple[list[str], list[tuple]]:
    import sqlite3

    if _more_than_one(sql):
        raise _refuse("more than one SQL statement")
    kw = first_keyword(sql)
    if kw not in SQLITE_FIRST:
        raise _refuse(f"{kw.upper() or 'this statement'} is not a query (allowed: "
                      f"{', '.join(k.upper() for k in SQLITE_FIRST)})")

    conn, raw = _sqlite_connection(store)
    denied: list[str] = []
    authorizer = _sqlite_authorizer(denied)
    try:
        conn.execute("SELECT 1 FROM sqlite_master LIMIT 1").fetchall()  # load the schema
        conn.execute("BEGIN")
        conn.set_authorizer(authorizer)
        try:
            cur = conn.execute(sql)
            rows = [tuple(r) for r in cur.fetchall()]
            desc = cur.description
        except (sqlite3.ProgrammingError, sqlite3.Warning) as e:
            if "one statement at a time" in str(e):
                raise _refuse("more than one SQL statement") from None
            raise QkgeomError(f"database error on {store.safe_url}: {e}") from None
        except sqlite3.Error as e:
            if denied:
                raise _refuse(f"{denied[0]} is not allowed") from None
            msg = describe_db_error(e, store.url)
            if "readonly" in msg.lower() or "read-only" in msg.lower():
                raise _refuse(f"the statement would modify the database ({msg})") from None
            raise QkgeomError(f"database error on {store.safe_url}: {msg}") from None
        finally:
            conn.set_authorizer(None)
        if desc is None:
            raise _refuse("the statement returns no rows (not a query)")
        if conn.in_transaction is False:  # cannot happen with the authorizer: belt and braces
            raise _refuse("the statement ended the read-only transaction")
        return [d[0] for d in desc], rows
    finally:
        try:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
        if raw is not None:
            raw.close()
        else:
            conn.close()


# authorizer action codes only (1..33); error codes share numbers, so build from a list
def _action_names() -> dict[int, str]:
    import sqlite3

    codes = ("CREATE_INDEX CREATE_TABLE CREATE_TEMP_INDEX CREATE_TEMP_TABLE "
             "CREATE_TEMP_TRIGGER CREATE_TEMP_VIEW CREATE_TRIGGER CREATE_VIEW DELETE "
             "DROP_INDEX DROP_TABLE DROP_TEMP_INDEX DROP_TEMP_TABLE DROP_TEMP_TRIGGER "
             "DROP_TEMP_VIEW DROP_TRIGGER DROP_VIEW INSERT PRAGMA READ SELECT TRANSACTION "
             "UPDATE ATTACH DETACH ALTER_TABLE REINDEX ANALYZE CREATE_VTABLE DROP_VTABLE "
             "FUNCTION SAVEPOINT RECURSIVE").split()
    names = {getattr(sqlite3, "SQLITE_" + c): c.replace("_", " ") for c in codes
             if hasattr(sqlite3, "SQLITE_" + c)}
    names.update({sqlite3.SQLITE_TRANSACTION: "a transaction statement (BEGIN/COMMIT/ROLLBACK)",
                  sqlite3.SQLITE_SAVEPOINT: "SAVEPOINT/RELEASE"})
    return names


_SQLITE_ACTIONS = _action_names()


# ---------------------------------------------------------------------- PostgreSQL
def _postgres(store: Store, sql: str) -> tuple[list[str], list[tuple]]:
    import psycopg

    kw = first_keyword(sql)
    if kw not in ALLOWED_FIRST:
        raise _refuse(f"{kw.upper() or 'this statement'} is not a query (allowed: "
                      f"{', '.join(k.upper() for k in ALLOWED_FIRST)})")
    flat = sql.replace('"', "")
    if re.search(r"\bu&", flat, re.IGNORECASE):
        raise _refuse("Unicode-escaped identifiers or strings (U&'...') are not allowed")
    m = _PG_DENIED.search(flat)
    if m:
        raise _refuse(f"the function {m.group(1)}() has effects outside a read-only "
                      "transaction")
    from psycopg.pq import TransactionStatus

    raw = store.engine.raw_connection()
    try:
        pc = raw.driver_connection
        pc.rollback()
        pc.autocommit = True
        with pc.cursor() as cur:
            cur.execute("BEGIN READ ONLY")
            try:
                # prepare=True: the extended protocol, which takes one command only
                cur.execute(sql, prepare=True)
                desc = cur.description
                rows = [tuple(r) for r in cur.fetchall()] if desc is not None else []
            except psycopg.Error as e:
                msg = describe_db_error(e, store.url)
                if "multiple commands" in msg:
                    raise _refuse("more than one SQL statement") from None
                if "read-only transaction" in msg or "read only" in msg.lower():
                    raise _refuse(f"the statement would modify the database ({msg})") from None
                raise QkgeomError(f"database error on {store.safe_url}: {msg}") from None
            if pc.info.transaction_status != TransactionStatus.INTRANS:
                raise _refuse("the statement ended the read-only transaction")
            cur.execute("SHOW transaction_read_only")
            if cur.fetchone()[0] != "on":
                raise _refuse("the statement made the transaction writable")
            if desc is None:
                raise _refuse("the statement returns no rows (not a query)")
            return [d.name for d in desc], rows
    finally:
        try:
            raw.driver_connection.rollback()
        except Exception:
            pass
        raw.invalidate()  # never reuse a connection whose session the statement touched
