"""qkgeom: run, store and analyse query/key geometry studies of small transformers."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Study", "open_study", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `import qkgeom` (and `qkgeom --help`) must not import polars/altair/SQLAlchemy.
    if name in ("open_study", "Study"):
        from qkgeom import study

        return getattr(study, name)
    raise AttributeError(f"module 'qkgeom' has no attribute {name!r}")
