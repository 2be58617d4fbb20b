"""qkgeom: run, store and analyse query/key geometry studies of small transformers."""

from __future__ import annotations

__version__ = "0.1.0"
