"""Shared CLI helpers: turning library errors into one-line click errors."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import click


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Map :class:`qkgeom.errors.QkgeomError` to ``click.ClickException`` (no traceback)."""
    from qkgeom.errors import QkgeomError

    try:
        yield
    except QkgeomError as e:
        raise click.ClickException(str(e)) from None
