"""The live page's small answers: :class:`NotFound` (a 404), the one-message error page,
a download with a safe file name, and the note for what is still being computed."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from starlette.responses import HTMLResponse, Response

from qkgeom.errors import QkgeomError
from qkgeom.report.html import escape as _e
from qkgeom.report.html import page
from qkgeom.web.background import Failed


class NotFound(QkgeomError):
    """An unknown sweep, metric or page: answered with 404 and the message."""


def error_page(status: int, text: str) -> HTMLResponse:
    """A page with ``status`` and one message (``id='message'``), linking to the index."""
    word = {400: "bad request", 401: "token required", 404: "not found",
            500: "server error"}.get(status, "error")
    return HTMLResponse(page(f"qkgeom: {word}", f"<h1>{status} {_e(word)}</h1>"
                             f"<p class='err' id='message'>{_e(text)}</p>"
                             "<p><a href='/'>all sweeps</a></p>"), status_code=status)


def pending(got: Any) -> str:
    """Why a background result is not there: it failed (and how), or it is on its way."""
    if isinstance(got, Failed):
        return f"could not compute it: {got.message}"
    return "being computed (this page reloads by itself)"


def download(body: str | bytes, media: str, filename: str) -> Response:
    """``body`` as an attachment named ``filename``."""
    # an ASCII name for every client, the exact one (RFC 6266 filename*) for those that
    # read it; header values are latin-1, so a name's other characters never go raw
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "-_.") else "_"
                   for c in filename)
    exact = quote(filename, safe="")
    return Response(body, media_type=media, headers={
        "Content-Disposition": f"attachment; filename=\"{safe}\"; filename*=UTF-8''{exact}"})
