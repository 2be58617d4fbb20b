"""The ``qkgeom`` command line: a thin click layer over the library.

Each sub-module registers its commands on :data:`main`; heavy imports (torch, ray,
altair) happen inside the commands so ``qkgeom --help`` stays instant.
"""

from __future__ import annotations

import click

from qkgeom import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="qkgeom")
def main() -> None:
    """Query/key geometry of small transformers: train, sweep, store, analyse."""


# Each module adds its commands to `main` (click lists them alphabetically).
from qkgeom.cli import db as _db  # noqa: E402,F401
from qkgeom.cli import pretrained as _pretrained  # noqa: E402,F401
from qkgeom.cli import serve as _serve  # noqa: E402,F401
from qkgeom.cli import stats as _stats  # noqa: E402,F401
from qkgeom.cli import sweep as _sweep  # noqa: E402,F401
from qkgeom.cli import train as _train  # noqa: E402,F401
