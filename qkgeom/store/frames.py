"""Query results as polars DataFrames: the store's one way from SQL rows to frames."""

from __future__ import annotations

import decimal
import json
from collections.abc import Sequence
from typing import Any

from qkgeom.errors import QkgeomError


def run_query(conn: Any, query: Any, params: dict | None) -> Any:
    """Execute ``query`` on ``conn``: a string without ``params`` goes to the driver
    verbatim; with ``params`` it is a ``text()`` with ``:name`` bind parameters; a
    SQLAlchemy statement (e.g. ``text(...)`` with expanding ``bindparam`` s for IN lists)
    runs as it is."""
    if not isinstance(query, str):
        return conn.execute(query, params or {})
    if params is None:
        return conn.execution_options(no_parameters=True).exec_driver_sql(query)
    from sqlalchemy import text

    return conn.execute(text(query), params)


def result_frame(result: Any) -> Any:
    """A polars DataFrame from a SQLAlchemy result (types inferred from all rows)."""
    import polars as pl

    keys = list(result.keys())
    rows = [tuple(r) for r in result]
    if len(set(keys)) != len(keys):
        raise QkgeomError(f"the query returns duplicate column names {keys}; alias them "
                          "(SELECT a.x AS a_x, b.x AS b_x ...)")
    if not rows:
        return pl.DataFrame(schema={k: pl.Null for k in keys})
    # PostgreSQL hands JSONB over as dicts and NUMERIC (e.g. AVG of integers) as Decimal;
    # SQLite as JSON text and floats. Make both look like SQLite's.
    fix = {}
    for i in range(len(keys)):
        first = next((r[i] for r in rows if r[i] is not None), None)
        if isinstance(first, (dict, list)):
            fix[i] = lambda v: None if v is None else json.dumps(v, sort_keys=True)
        elif isinstance(first, decimal.Decimal):
            fix[i] = lambda v: None if v is None else float(v)
    if fix:
        rows = [tuple(fix[i](v) if i in fix else v for i, v in enumerate(r)) for r in rows]
    return pl.DataFrame(rows, schema=keys, orient="row", infer_schema_length=None,
                        strict=False)


def rows_frame(rows: Sequence[Any], schema: dict) -> Any:
    import polars as pl

    return pl.DataFrame([tuple(r) for r in rows], schema=schema, orient="row")


def polars_type(t: Any) -> Any:
    import polars as pl
    from sqlalchemy import types as sat

    if isinstance(t, sat.Boolean):
        return pl.Boolean
    if isinstance(t, sat.Integer):
        return pl.Int64
    if isinstance(t, (sat.Float, sat.Numeric)):
        return pl.Float64
    if isinstance(t, sat.DateTime):
        return pl.Datetime("us", "UTC")
    return pl.String


def view_column_type(name: str) -> Any:
    """Column types of the views (reflection cannot type SQLite view expressions)."""
    import polars as pl

    if name in ("value", "progress", "test_loss"):
        return pl.Float64
    if name in ("sweep", "trial_key", "init", "arm", "status", "metric", "model", "revision"):
        return pl.String
    return pl.Int64
