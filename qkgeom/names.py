"""The rule for sweep names, checked wherever a sweep is created (docs/sweeps.md, "Sweep
names"): a spec's ``name`` or ``qkgeom sweep --name`` (:func:`qkgeom.plan.spec.build_plan`),
``qkgeom train --name`` and ``qkgeom db merge --rename OLD=NEW``.

A name becomes a directory (``qkgeom-NAME`` in the Ray Tune storage), a path segment of the
live page's addresses, a file name of downloads and words of report.md, so it is kept to
characters that mean nothing to any of them. Names stored before the rule (an old
database) are not checked again: the page, the reports and ``db merge`` of them keep
working, with the name escaped wherever it is shown.
"""

from __future__ import annotations

from qkgeom.errors import QkgeomError

MAX_LEN = 100
NAME_RULE = (f"1 to {MAX_LEN} characters: letters, digits, '-', '_' and '.', starting with a "
             "letter or digit, with no '..'")


class SweepNameError(QkgeomError, ValueError):
    """A sweep name that breaks :data:`NAME_RULE`; the message says why and gives the rule."""


def _why(name: str) -> str | None:
    if not name:
        return "it is empty"
    if len(name) > MAX_LEN:
        return f"it has {len(name)} characters"
    bad = sorted({c for c in name if not (c.isalnum() or c in "-_.")})
    if bad:
        shown = ", ".join(repr(c) for c in bad[:5])
        return f"it has the character{'s' if len(bad) > 1 else ''} {shown}"
    if not name[0].isalnum():
        return f"it starts with {name[0]!r}"
    if ".." in name:
        return "it has '..'"
    return None


def check_sweep_name(name: object, *, what: str = "sweep name") -> str:
    """``name`` if it follows :data:`NAME_RULE`, else a :class:`SweepNameError` that starts
    with ``what`` (the option or key the user wrote), says why and gives the rule."""
    if not isinstance(name, str):
        raise SweepNameError(f"{what} {name!r}: expected text; a sweep name is {NAME_RULE}")
    why = _why(name)
    if why is not None:
        raise SweepNameError(f"{what} {name!r}: {why}; a sweep name is {NAME_RULE}")
    return name
