"""Shared CLI helpers: one-line errors and the options several commands take."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

DB_HELP = "Results database URL or SQLite file (default: $QKGEOM_DB, else sqlite:///qkgeom.db)."


def db_option(f: F) -> F:
    """``--db URL`` (default None: :func:`qkgeom.store.resolve_url` picks), passed as ``db``."""
    return click.option("--db", "db", default=None, metavar="URL", help=DB_HELP)(f)


def format_option(*choices: str, default: str = "table",
                  dest: str = "output_format") -> Callable[[F], F]:
    """``--format`` with ``choices`` (default ``default``), passed as ``dest``."""
    return click.option("--format", dest, type=click.Choice(list(choices)), default=default,
                        show_default=True, help="Output format.")


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Map :class:`qkgeom.errors.QkgeomError` to ``click.ClickException`` (no traceback)."""
    from qkgeom.errors import QkgeomError

    try:
        yield
    except QkgeomError as e:
        raise click.ClickException(str(e)) from None
