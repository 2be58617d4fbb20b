"""The paper's claims decided from the database, and what shows them: the report,
its charts, the comparison of cells and the notebook API (``open_study``)."""

from __future__ import annotations

from typing import Any

_SUBMODULES = {"claims", "render", "html", "plots", "compare", "sensitivity", "study"}


def __getattr__(name: str) -> Any:
    # ``qkgeom.report`` was the rendering module before the layer packages: its public
    # names (``build_report``, ``Report``, ...) still resolve, lazily.
    import importlib

    if name.startswith("_") or name in _SUBMODULES:
        raise AttributeError(name)  # a submodule not yet imported: the import system's job
    render = importlib.import_module("qkgeom.report.render")
    try:
        return getattr(render, name)
    except AttributeError:
        raise AttributeError(f"module 'qkgeom.report' has no attribute {name!r}") from None
