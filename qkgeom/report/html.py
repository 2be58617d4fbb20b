"""The one HTML layer of qkgeom: the stylesheet, escaping, table cells and tables, the
verdict classes and the page frame, shared by the static report (``report.html``,
:mod:`qkgeom.report.render`) and the live page (``qkgeom serve``, :mod:`qkgeom.web.serve`).
Plain strings, no template engine: every value goes through :func:`escape`."""

from __future__ import annotations

import html
import math
from typing import Any

from qkgeom.analysis.common import fmt
from qkgeom.report.claims import CONTRADICTED, HOLDS, NO_DATA, NOT_SHOWN

VERDICTS = (HOLDS, NOT_SHOWN, CONTRADICTED, NO_DATA)

# One stylesheet for both pages; ``<body class='doc'>`` (the report) reads as a document
# column, the live page uses the window's width for its trial table.
CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:1em 2em;
color:#222;line-height:1.45}
body.doc{max-width:1200px;margin:2em auto;padding:0 1em}
table{border-collapse:collapse;margin:.6em 0 1.2em;font-size:.9em}
th,td{border:1px solid #ccc;padding:.25em .55em;vertical-align:top}
th{background:#f3f3f3;text-align:left} th a{color:inherit;text-decoration:none}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.s-terminated{color:#1a7f1a}.s-running{color:#1f5fbf;font-weight:600}
.s-error,.s-interrupted,.s-stale{color:#b00020;font-weight:600}.s-pending{color:#777}
.v-holds{background:#e3f4e3;font-weight:600}.v-contra{background:#fbe3e3;font-weight:600}
.v-shown{background:#ececec;font-weight:600}
.v-not{background:#f6f0d8;font-weight:600}.provisional{color:#8a6d00;font-weight:400}
.note{color:#555}.err{color:#b00020} progress{width:20em} nav a{margin-right:1em}
figure{margin:1em 0} figcaption{color:#555} figure svg{max-width:100%;height:auto}
code{background:#f5f5f5;padding:0 .2em}
"""


def escape(v: Any) -> str:
    """``v`` as text safe inside HTML, quotes included."""
    return html.escape(str(v), quote=True)


def cell(v: Any) -> str:
    """One ``<td>``: ``-`` for None and NaN, yes/no for booleans, numbers right-aligned in
    the tables' compact form (:func:`qkgeom.analysis.fmt`)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "<td>-</td>"
    if isinstance(v, bool):
        return f"<td>{'yes' if v else 'no'}</td>"
    if isinstance(v, (int, float)):
        return f"<td class='num'>{escape(fmt(v))}</td>"
    return f"<td>{escape(v)}</td>"


def html_table(rows: list[dict[str, Any]], *, table_id: str = "",
               verdicts: bool = False) -> str:
    """Rows as a table, one column per key (in the order first seen); ``table_id`` names
    it (``<table id=...>``) for links and tests; ``verdicts`` colours every cell holding a
    verdict (:func:`verdict_cell`). No rows: a note that says so."""
    if not rows:
        return "<p class='note'>(no rows)</p>"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    tid = f" id='{escape(table_id)}'" if table_id else ""
    head = "".join(f"<th>{escape(c)}</th>" for c in cols)

    def td(v: Any) -> str:
        return verdict_cell(v) if verdicts and v in VERDICTS else cell(v)

    body = "".join("<tr>" + "".join(td(r.get(c)) for c in cols) + "</tr>" for r in rows)
    return f"<table{tid}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def verdict_class(verdict: str) -> str:
    """The CSS class of a verdict: ``v-holds``, ``v-contra`` (contradicted), ``v-shown``
    (not shown) or ``v-not`` (not enough data, or anything else)."""
    return {HOLDS: "v-holds", CONTRADICTED: "v-contra", NOT_SHOWN: "v-shown"}.get(
        verdict, "v-not")


def verdict_cell(verdict: str, mark: str = "") -> str:
    """The verdict's ``<td>``, coloured by :func:`verdict_class`; ``mark`` is HTML put
    after the escaped verdict (e.g. a provisional note)."""
    return f"<td class='{verdict_class(verdict)}'>{escape(verdict)}{mark}</td>"


def page(title: str, body: str, *, refresh: int = 0, body_class: str = "") -> str:
    """A whole page around ``body`` (HTML): the stylesheet inline, nothing to load;
    ``refresh`` > 0 reloads it every so many seconds."""
    meta = f"<meta http-equiv='refresh' content='{int(refresh)}'>" if refresh > 0 else ""
    cls = f" class='{escape(body_class)}'" if body_class else ""
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"{meta}<title>{escape(title)}</title><style>{CSS}</style></head><body{cls}>"
            f"{body}</body></html>")
