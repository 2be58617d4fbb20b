"""``qkgeom db upgrade|current``, ``qkgeom query`` and ``qkgeom export``: the results database.

Every command takes ``--db URL`` (a SQLAlchemy URL or a SQLite file path); without it,
``$QKGEOM_DB``, else ``sqlite:///qkgeom.db`` in the current directory. Passwords are
masked in everything printed.
"""

from __future__ import annotations

import sys

import click

from qkgeom.cli import main
from qkgeom.cli.common import db_option, format_option, user_errors


@main.group()
def db() -> None:
    """Create, upgrade and inspect the results database's schema."""


@db.command("upgrade")
@db_option
def db_upgrade(db: str | None) -> None:
    """Create the database, or upgrade it to this qkgeom's schema (never downgrades)."""
    with user_errors():
        from qkgeom.store import resolve_url, safe_url
        from qkgeom.store.schema import upgrade

        url = resolve_url(db)
        before, after = upgrade(url)
        shown = safe_url(url)
        if before.current == after.current:
            click.echo(f"{shown}: already at {after.revision} (head)")
        else:
            was = before.revision or "empty"
            click.echo(f"{shown}: upgraded {was} -> {after.revision} (head)")


@db.command("current")
@db_option
def db_current(db: str | None) -> None:
    """Show the database's schema revision and this qkgeom's (changes nothing)."""
    with user_errors():
        from qkgeom.store import resolve_url, safe_url
        from qkgeom.store.schema import current

        url = resolve_url(db)
        state = current(url)
        shown = safe_url(url)
        rev = ", ".join(state.current) or "none"
        note = {
            "head": "(head)",
            "empty": f"(empty database; create it with: qkgeom db upgrade --db {shown})",
            "outdated": f"(out of date, head is {state.head}; run: qkgeom db upgrade --db {shown})",
            "newer": f"(unknown to this qkgeom, whose head is {state.head}: written by a newer "
                     "qkgeom)",
            "foreign": "(qkgeom tables without alembic_version: not created by qkgeom)",
        }[state.verdict]
        click.echo(f"database: {shown}")
        click.echo(f"revision: {rev} {note}")


@main.command()
@db_option
@format_option("table", "csv", "json", "parquet", dest="fmt")
@click.option("--out", type=click.Path(dir_okay=False), default=None,
              help="Write to this file instead of stdout (needed for parquet on a terminal).")
@click.option("--write", is_flag=True,
              help="Allow statements that modify the database (otherwise it is opened "
              "read-only and such statements are refused).")
@click.argument("sql")
def query(db: str | None, fmt: str, out: str | None, write: bool, sql: str) -> None:
    """Run one SQL statement and print the result (read-only unless --write).

    \b
    Examples:
      qkgeom query "SELECT * FROM v_final WHERE metric = 'pr_q' LIMIT 20"
      qkgeom query --format csv --out final.csv "SELECT * FROM v_final"
    Tables and views: docs/schema.md. NULL in a float column means NaN.
    """
    with user_errors():
        from qkgeom.store import open_store

        if fmt == "parquet" and out is None and sys.stdout.isatty():
            raise click.UsageError("parquet is binary: give --out FILE (or redirect stdout)")
        if out is not None:
            _check_out(out)
        with open_store(db, create=False, readonly=not write) as store:
            if write:
                df, rowcount = store.execute(sql)
                if df is None:
                    click.echo(f"{rowcount} row(s) affected", err=True)
                    return
            else:
                from qkgeom.store.readonly import run_readonly

                df = run_readonly(store, sql)
        try:
            _emit(df, fmt, out)
        except OSError as e:
            raise click.ClickException(f"cannot write {out}: {e.strerror or e}; give a "
                                       "writable --out") from None


def _check_out(out: str) -> None:
    """Refuse an --out that cannot be written before the query runs."""
    from pathlib import Path

    parent = Path(out).parent
    if not parent.is_dir():
        raise click.ClickException(f"cannot write {out}: directory {parent} does not exist; "
                                   "create it first or give another --out")


def _emit(df, fmt: str, out: str | None) -> None:  # type: ignore[no-untyped-def]
    import polars as pl

    if fmt == "table":
        with pl.Config(tbl_rows=-1, tbl_cols=-1, fmt_str_lengths=80, tbl_width_chars=250,
                       fmt_float="mixed"):
            text = str(df)
        if out:
            with open(out, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        else:
            click.echo(text)
        return
    if fmt in ("csv", "json"):
        flat = df.with_columns(
            [pl.col(c).struct.json_encode() for c, t in df.schema.items()
             if isinstance(t, pl.Struct)]
            + ([pl.col(c).cast(pl.String) for c, t in df.schema.items()
                if isinstance(t, pl.List | pl.Array)] if fmt == "csv" else [])
        )
        if out:
            (flat.write_csv if fmt == "csv" else flat.write_json)(out)
        else:
            text = flat.write_csv() if fmt == "csv" else flat.write_json()
            click.echo(text, nl=not text.endswith("\n"))
        return
    if out:
        df.write_parquet(out)
    else:
        stream = click.get_binary_stream("stdout")
        df.write_parquet(stream)
        stream.flush()


@main.command()
@db_option
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Directory for <table>.parquet files (created if missing).")
@click.option("--views/--no-views", default=False, show_default=True,
              help="Also export the views (v_metrics, v_final, ...).")
def export(db: str | None, out: str, views: bool) -> None:
    """Write every table of the database to OUT/<table>.parquet."""
    with user_errors():
        from qkgeom.store import open_store

        with open_store(db, create=False, readonly=True) as store:
            files = store.export(out, views=views)
        for f in files:
            click.echo(f"{f.rows:>12,} rows  {f.path}")


@db.command("merge")
@click.option("--from", "source", required=True, metavar="URL",
              help="The database to copy sweeps from (read only; never changed, also when "
              "its schema is older: then it is read through an upgraded temporary copy).")
@db_option
@click.option("--sweep", "sweeps", multiple=True, metavar="NAME",
              help="A sweep to copy (repeatable; default: every sweep of --from).")
@click.option("--rename", "renames", multiple=True, metavar="OLD=NEW",
              help="Store source sweep OLD as NEW in the target (repeatable), e.g. when "
              "the target already has a sweep of that name.")
@click.option("--beside-running", is_flag=True,
              help="Merge into a SQLite --db even while a sweep runs there (refused "
              "otherwise): the merge holds the file's write lock for its whole copy, and "
              "the sweep's writes wait for it.")
def db_merge(source: str, db: str | None, sweeps: tuple[str, ...],
             renames: tuple[str, ...], beside_running: bool) -> None:
    """Copy sweeps, with every row of their trials, from --from into --db.

    Rows are copied as stored (new ids in the target, nothing recomputed), in one
    transaction; a name already in the target, a trial still running in the source, the
    same database twice (also through a link), or a SQLite target where a sweep is
    running are refused before anything is written. A source at an older schema
    revision is read through an upgraded temporary copy (SQLite; the file is not changed).

    \b
    Examples:
      qkgeom db merge --from e96.db --db ladder.db
      qkgeom db merge --from postgresql://u@host/qk --db ladder.db --sweep cpu --rename cpu=cpu-h100
    """
    with user_errors():
        from qkgeom.store import resolve_url, safe_url
        from qkgeom.store.merge import merge_sweeps, parse_renames

        merged = merge_sweeps(source, resolve_url(db), list(sweeps), parse_renames(renames),
                              beside_running=beside_running, say=click.echo)
        for m in merged:
            rows = ", ".join(f"{n:,} {k}" for k, n in m.rows.items() if k != "trials")
            name = m.name if m.name == m.source_name else f"{m.source_name} -> {m.name}"
            click.echo(f"copied sweep {name}: {m.rows['trials']} trials ({rows})")
        click.echo(f"into {safe_url(resolve_url(db))}")
