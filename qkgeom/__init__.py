"""qkgeom: run, store and analyse query/key geometry studies of small transformers."""

from __future__ import annotations

from typing import Any

from qkgeom import compat

compat.install()  # old flat-layout module paths, for sweeps pickled by 0.1.0

__version__ = "0.1.0"
__all__ = ["Study", "open_study", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `import qkgeom` (and `qkgeom --help`) must not import polars/altair/SQLAlchemy.
    if name in ("open_study", "Study"):
        from qkgeom.report import study

        return getattr(study, name)
    raise AttributeError(f"module 'qkgeom' has no attribute {name!r}")
