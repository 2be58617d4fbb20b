"""``qkgeom serve``: a live web page over the results database (see docs/serve.md)."""

from __future__ import annotations

import click

from qkgeom.cli import main
from qkgeom.cli.common import db_option, user_errors


@main.command("serve")
@db_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on; anything but loopback needs --token. The page "
                   "answers requests for this address, 127.0.0.1, localhost and [::1] "
                   "(beyond loopback also this machine's name; 0.0.0.0: any IP address)")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="also answer requests for this host name (repeatable), e.g. the name "
                   "others reach this machine by; any other Host is refused (421)")
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True,
              help="TCP port (0: any free port; the address printed gives it)")
@click.option("--token", default=None, envvar="QKGEOM_SERVE_TOKEN", metavar="SECRET",
              help="required on every request (?token=SECRET or Authorization: Bearer "
                   "SECRET); also read from $QKGEOM_SERVE_TOKEN")
@click.option("--refresh", type=click.IntRange(min=0), default=5, show_default=True,
              help="seconds between page reloads (0: off)")
@click.option("--update-every", type=click.FloatRange(min=0), default=30.0,
              show_default=True,
              help="recompute verdicts and charts at most this often (seconds), so readers "
                   "of a running sweep do not compete with it for the CPUs")
def serve_cmd(db: str | None, host: str, allow_hosts: tuple[str, ...], port: int,
              token: str | None, refresh: int, update_every: float) -> None:
    """Serve a live page over the database, read-only: sweeps, trials, trajectories,
    verdicts (provisional while trials run), downloads. Ctrl-C stops it."""
    with user_errors():
        try:
            from qkgeom.web.serve import check_bind, create_app, listen
        except ImportError as e:
            from qkgeom.errors import QkgeomError

            raise QkgeomError(f"qkgeom serve needs starlette and uvicorn ({e}); install "
                              "them with: pip install 'qkgeom[serve]'") from None
        check_bind(host, token)
        app = create_app(db, token=token, refresh=refresh, update_every_s=update_every,
                         host=host, allow_hosts=allow_hosts)
        sock = listen(host, port)  # before the address is printed: a port in use says so
    import uvicorn

    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"qkgeom serve: http://{shown}:{port}/" + ("?token=..." if token else "")
               + " (read-only; Ctrl-C stops)", err=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
