"""The security layer of ``qkgeom serve``: which binds need a token, which host names a
server answers, the headers of every response, and the token itself.

Without a token the server binds to loopback only (:func:`check_bind`); with one, every
request must carry it (:class:`TokenMiddleware`): ``?token=T`` (then a cookie keeps it for
the session), the header ``Authorization: Bearer T`` or ``X-Qkgeom-Token: T``.

Against a hostile page in the user's browser: a request for any host name but the
server's own is refused before anything else (:class:`HostRule`; DNS rebinding), and
every response carries :data:`SECURITY_HEADERS` (a Content-Security-Policy that allows
no script, no frame and only the page's own stylesheet), both by
:class:`GuardMiddleware`, which :class:`GuardedApp` puts outside everything.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import hmac
import ipaddress
import re
from collections.abc import Iterable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from qkgeom.errors import QkgeomError
from qkgeom.report.html import CSS
from qkgeom.web.responses import error_page

COOKIE = "qkgeom_token"


class ServeError(QkgeomError):
    """The server cannot start as asked (e.g. a public bind without a token)."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, token: str | None) -> None:
    """Refuse to listen beyond this machine without a token."""
    if not is_loopback(host) and not token:
        raise ServeError(f"refusing to serve on {host} without a token: anyone who can reach "
                         "it could read the database; pass --token SECRET (then required on "
                         "every request) or bind to 127.0.0.1")


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
WILDCARDS = ("0.0.0.0", "::", "")
_HOSTNAME = re.compile(r"^[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*$")


def _shown(name: str) -> str:
    return f"[{name}]" if ":" in name else name


def host_of(header: str) -> str | None:
    """The host name of a ``Host`` header, lower case, without its port, brackets or a
    final dot (``LOCALHOST.:8765`` -> ``localhost``, ``[::1]:80`` -> ``::1``); None for
    anything that is not a well-formed host name or IP address with an optional port."""
    v = header.strip()
    if v.startswith("["):
        end = v.find("]")
        name, rest = (v[1:end], v[end + 1:]) if end > 0 else ("", "")
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            return None
    else:
        name, sep, port = v.rpartition(":")
        name, rest = (name, sep + port) if sep else (v, "")
    if rest and not (rest[0] == ":" and rest[1:].isascii() and rest[1:].isdigit()
                     and len(rest) <= 6):
        return None
    name = name.lower()
    if name.endswith(".") and not name.endswith(".."):
        name = name[:-1]
    if ":" in name:
        return name
    return name if name.isascii() and _HOSTNAME.match(name) else None


def _ip(name: str) -> Any:
    try:
        return ipaddress.ip_address(name)
    except ValueError:
        return None


class HostRule:
    """The host names a server bound to ``bind`` answers (the ``Host`` header of a
    request, any port): the bound address, ``127.0.0.1``, ``localhost``, ``[::1]`` and any
    loopback address, the ``allow`` names (``--allow-host``), and for a bind beyond
    loopback (which needs a token) this machine's host name and fully qualified name, and
    for a bind to every address (``0.0.0.0``, ``::``) any IP address. A page of another
    site that rebinds its own name to this machine sends its own name: refused."""

    def __init__(self, bind: str = "127.0.0.1", allow: Iterable[str] = ()) -> None:
        import socket

        self.bind = bind.strip().strip("[]").lower()
        self.any_ip = self.bind in WILDCARDS
        names = list(LOOPBACK_NAMES)
        if not self.any_ip:
            names.append(self.bind)
        for a in allow:
            h = host_of(a)
            if h is None:
                raise ServeError(f"--allow-host {a!r}: give a host name or IP address, e.g. "
                                 "--allow-host lab.example.org")
            names.append(h)
        if not is_loopback(self.bind):
            for own in (socket.gethostname(), socket.getfqdn()):
                h = host_of(own)
                if h is not None:
                    names.append(h)
        self.names = list(dict.fromkeys(names))

    def allows(self, header: str | None) -> bool:
        if header is None:  # HTTP/1.0 without Host: no browser sends that
            return True
        h = host_of(header)
        if h is None:
            return False
        if h in self.names:
            return True
        ip = _ip(h)
        return ip is not None and (ip.is_loopback or self.any_ip)

    def refusal(self, header: str) -> str:
        shown = ", ".join(_shown(n) for n in self.names)
        if self.any_ip:
            shown += ", any IP address of this machine"
        return (f"this qkgeom serve answers only the hosts {shown} (with any port), not "
                f"{header[:200]!r}: open it at one of those, or start it with --host ADDRESS "
                "(the address it listens on and answers) or --allow-host NAME (repeatable) "
                "to answer another name\n")


def _style_hash(css: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(css.encode()).digest()).decode() + "'"


# Every response's headers. The pages use one inline <style> (report.html.CSS, allowed by
# its hash), inline SVG without style attributes, links, and GET forms to this server;
# no script, image, font, frame or connection of any kind.
CSP = ("default-src 'none'; style-src " + _style_hash(CSS) + "; form-action 'self'; "
       "frame-ancestors 'none'; base-uri 'none'")
SECURITY_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-resource-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
]


class GuardMiddleware:
    """Outermost: every response gets :data:`SECURITY_HEADERS`, and a request for a host
    that :class:`HostRule` does not allow is answered 421 with one line of text, before
    the token is looked at or anything is read."""

    def __init__(self, app: Any, hosts: HostRule) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_guarded(message: Any) -> None:
            if message["type"] == "http.response.start":
                ours = {k for k, _ in SECURITY_HEADERS}
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in ours]
                message = {**message, "headers": [*kept, *SECURITY_HEADERS]}
            await send(message)

        hosts = [v for k, v in scope.get("headers", []) if k.lower() == b"host"]
        header = hosts[0].decode("latin-1") if hosts else None
        if len(hosts) > 1 or not self.hosts.allows(header):
            resp = Response(self.hosts.refusal(header or ""), status_code=421,
                            media_type="text/plain")
            await resp(scope, receive, send_guarded)
            return
        await self.app(scope, receive, send_guarded)




class GuardedApp(Starlette):
    """Starlette with :class:`GuardMiddleware` outside everything, its own error
    middleware included (so a 500 carries the headers too)."""

    def __init__(self, *args: Any, hosts: HostRule, **kw: Any) -> None:
        self.hosts = hosts
        super().__init__(*args, **kw)

    def build_middleware_stack(self) -> Any:
        return GuardMiddleware(super().build_middleware_stack(), self.hosts)



class TokenMiddleware:
    """Every request must carry the token (query ``token``, ``Authorization: Bearer``,
    ``X-Qkgeom-Token`` or the cookie set after a query-token visit)."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.token = token
        self.cookie = hashlib.sha256(("qkgeom:" + token).encode()).hexdigest()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        req = Request(scope)
        auth = req.headers.get("authorization", "")
        given = (req.query_params.get("token") or req.headers.get("x-qkgeom-token")
                 or (auth[7:] if auth.lower().startswith("bearer ") else None))
        ok = given is not None and hmac.compare_digest(given.encode(), self.token.encode())
        ok = ok or hmac.compare_digest(req.cookies.get(COOKIE, "").encode(),
                                       self.cookie.encode())
        if not ok:
            resp = error_page(401, "this server needs its token: open the page with "
                                   "?token=TOKEN (or send the header Authorization: "
                                   "Bearer TOKEN)")
            await resp(scope, receive, send)
            return
        if req.query_params.get("token"):
            cookie = f"{COOKIE}={self.cookie}; Path=/; HttpOnly; SameSite=Strict".encode()

            async def send_cookie(message: Any) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"set-cookie", cookie)]}
                await send(message)

            await self.app(scope, receive, send_cookie)
            return
        await self.app(scope, receive, send)



def listen(host: str, port: int) -> Any:
    """A listening TCP socket on ``host:port`` (``port`` 0: any free port, read it back
    with ``getsockname()``); a port in use or an address not on this machine is a
    :class:`ServeError` that says what to do."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ServeError(f"cannot listen on {host}: {e.strerror}; give --host an address "
                         "of this machine (127.0.0.1 for this machine only)") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        what = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be used ({e.strerror})"
        raise ServeError(f"port {port} on {host} {what}; pick another with --port N, or "
                         "--port 0 for any free port") from None
    return sock
