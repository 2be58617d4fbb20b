"""HTML of the live page (qkgeom serve): the stylesheet, escaping, tables and the page
frame. Plain strings, no template engine: every value goes through :func:`escape`."""

from __future__ import annotations

import html
import math
from typing import Any

from qkgeom import analysis as A

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:1em 2em;
color:#222;line-height:1.4}
table{border-collapse:collapse;margin:.5em 0 1.2em;font-size:.88em}
th,td{border:1px solid #ccc;padding:.2em .5em;vertical-align:top}
th{background:#f3f3f3;text-align:left} th a{color:inherit;text-decoration:none}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.s-terminated{color:#1a7f1a}.s-running{color:#1f5fbf;font-weight:600}
.s-error,.s-interrupted,.s-stale{color:#b00020;font-weight:600}.s-pending{color:#777}
.v-holds{background:#e3f4e3;font-weight:600}.v-does{background:#fbe3e3;font-weight:600}
.v-not{background:#f6f0d8;font-weight:600}.provisional{color:#8a6d00;font-weight:400}
.note{color:#555}.err{color:#b00020} progress{width:20em} figure svg{max-width:100%;height:auto}
nav a{margin-right:1em}
"""


def escape(v: Any) -> str:
    """``v`` as text safe inside HTML, quotes included."""
    return html.escape(str(v), quote=True)


def cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "<td>-</td>"
    if isinstance(v, bool):
        return f"<td>{'yes' if v else 'no'}</td>"
    if isinstance(v, (int, float)):
        return f"<td class='num'>{escape(A.fmt(v))}</td>"
    return f"<td>{escape(v)}</td>"


def html_table(rows: list[dict[str, Any]], *, table_id: str = "") -> str:
    if not rows:
        return "<p class='note'>(no rows)</p>"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    tid = f" id='{escape(table_id)}'" if table_id else ""
    head = "".join(f"<th>{escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(cell(r.get(c)) for c in cols) + "</tr>" for r in rows)
    return f"<table{tid}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def page(title: str, body: str, *, refresh: int = 0) -> str:
    meta = f"<meta http-equiv='refresh' content='{int(refresh)}'>" if refresh > 0 else ""
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"{meta}<title>{escape(title)}</title><style>{CSS}</style></head><body>"
            f"{body}</body></html>")
