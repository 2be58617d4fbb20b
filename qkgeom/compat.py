"""Module paths of the flat layout before the layer packages (0.1.0 up to the move).

Ray Tune pickles the trainable, the callbacks and the trial specs by module path, and a
sweep started by the flat layout resumes only if those paths still import. Each old path
below loads the module that replaced it (the same module object, so classes compare
equal); nothing new should import these names.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
from typing import Any

MOVED = {
    "qkgeom.data": "qkgeom.engine.data",
    "qkgeom.model": "qkgeom.engine.model",
    "qkgeom.hooks": "qkgeom.engine.hooks",
    "qkgeom.metrics": "qkgeom.engine.metrics",
    "qkgeom.probe": "qkgeom.engine.probe",
    "qkgeom.intervention": "qkgeom.engine.intervention",
    "qkgeom.train": "qkgeom.engine.train",
    "qkgeom.sweep": "qkgeom.plan.spec",
    "qkgeom.pairing": "qkgeom.plan.pairing",
    "qkgeom.lifecycle": "qkgeom.store.lifecycle",
    "qkgeom.claims": "qkgeom.report.claims",
    "qkgeom.plots": "qkgeom.report.plots",
    "qkgeom.study": "qkgeom.report.study",
    "qkgeom.serve": "qkgeom.web.serve",
    "qkgeom.webpage": "qkgeom.report.html",
    "qkgeom.background": "qkgeom.web.background",
    "qkgeom.tune": "qkgeom.sweeps.driver",
    "qkgeom.tune_trial": "qkgeom.sweeps.trainable",
    "qkgeom.tune_callbacks": "qkgeom.sweeps.callbacks",
    "qkgeom.tune_ray": "qkgeom.sweeps.ray_session",
    "qkgeom.sweep_files": "qkgeom.sweeps.files",
    "qkgeom.cluster": "qkgeom.sweeps.cluster",
    "qkgeom.ship": "qkgeom.sweeps.ship",
    "qkgeom.trackers": "qkgeom.sweeps.trackers",
    "qkgeom.provenance": "qkgeom.sweeps.provenance",
}
# ``qkgeom.report`` was a module and is now the package of the report layer: its names
# (``build_report``, ``Report``, ...) resolve through the package's ``__getattr__``.


# Plain classes, not importlib.abc subclasses: importing importlib.abc pulls in
# importlib.resources and would slow `qkgeom --help` by ~9 ms.
class _Alias:
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module(self.target)

    def exec_module(self, module: Any) -> None:
        pass  # the target module ran when it was imported


class MovedFinder:
    """Finds an old flat-layout path and hands back the module now in its place."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedFinder())
