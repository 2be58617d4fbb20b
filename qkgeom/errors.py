"""One base class for every error that is the user's to fix.

The CLI turns any :class:`QkgeomError` into a one-line message and a non-zero exit, so
each subclass's message must say what went wrong *and* what to do.
"""

from __future__ import annotations


class QkgeomError(Exception):
    """A user-facing error: bad input, missing data, an out-of-date database, ..."""


class DataError(QkgeomError):
    """The corpus could not be found, read or downloaded."""
