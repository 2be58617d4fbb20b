"""The live page's query parameters, read and checked: a bad value is a
:class:`~qkgeom.web.sections.BadRequest` (400) that says what to give instead, an unknown
metric a :class:`~qkgeom.web.responses.NotFound` (404)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from qkgeom.web.responses import NotFound
from qkgeom.web.sections import PRQK, BadRequest

if TYPE_CHECKING:
    from starlette.requests import Request

    from qkgeom.report.study import Study

MAX_REFRESH_S = 86_400
MAX_NAME_LEN = 1000  # longer path segments name no sweep: 404 without a query
VIEWS = ("mean", "trial")


def name_can_exist(name: str) -> bool:
    """False for text no stored sweep name can be (NUL: PostgreSQL refuses it in a query;
    over :data:`MAX_NAME_LEN` characters): answered 404 without asking the database."""
    return "\x00" not in name and len(name) <= MAX_NAME_LEN


def flag_param(req: Request, key: str) -> bool:
    """``key=1`` (or ``true``) on, ``0``, ``false``, empty or absent off."""
    v = req.query_params.get(key, "0")
    if v not in ("0", "1", "true", "false", ""):
        raise BadRequest(f"{key}={v!r}: use {key}=1 or {key}=0")
    return v in ("1", "true")


def refresh_param(req: Request, default: int) -> int:
    """``refresh=S``: whole seconds between reloads (0: off), ``default`` when absent."""
    v = req.query_params.get("refresh")
    if v is None:
        return default
    if not (v.isascii() and v.isdigit()):  # '²' is a digit to str.isdigit, not to int
        raise BadRequest(f"refresh={v[:40]!r}: give whole seconds (0 turns reloading "
                         "off)")
    if len(v) > 6 or int(v) > MAX_REFRESH_S:
        raise BadRequest(f"refresh={v[:40]!r}: at most {MAX_REFRESH_S} seconds (0 turns "
                         "reloading off)")
    return int(v)


def metric_param(st: Study, req: Request) -> tuple[str, str]:
    """(metric, view) of ``metric=`` (default PR_Q and PR_K) and ``view=mean|trial``."""
    metric = req.query_params.get("metric") or PRQK
    view = req.query_params.get("view") or "mean"
    if view not in VIEWS:
        raise BadRequest(f"view={view!r}: use view=mean (over seeds) or view=trial")
    if metric != PRQK and metric not in st.metrics():
        raise NotFound(f"unknown metric {metric!r}; valid metrics: "
                       f"{', '.join(st.metrics())}")
    return metric, view
