"""Opt-in experiment trackers: TensorBoard, MLflow and W&B, through Ray Tune's own logger
callbacks (``qkgeom sweep --logger NAME``, repeatable).

The database stays the source of truth; a tracker gets a copy of every probe, in the
driver, from the result each trial reports. The result carries the probe record as JSON
(:class:`qkgeom.records.ProbeRecord`), so each callback here flattens it first into
readable scalar names, then hands it to Tune's callback unchanged otherwise:

* ``val_loss``, ``train_loss``, ``tokens_per_s`` and, at the end, ``test_loss``;
* every probe metric as ``METRIC/layerL`` (layer level) and ``METRIC/layerL/headH``
  (per head), e.g. ``pr_q/layer0``, ``entropy/layer1/head2``;
* the step is the training step (Tune's ``timesteps_total``), not Tune's iteration.

Where each one writes, offline by default:

* ``tensorboard``: tensorboardX event files in each trial's directory of the Ray storage
  (``tensorboard --logdir <storage>/qkgeom-NAME``); scalars are named ``ray/tune/...``;
* ``mlflow``: one MLflow run per trial in experiment ``qkgeom-NAME`` of the tracking
  store ``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in the working directory
  (``mlflow ui --backend-store-uri sqlite:///mlflow.db``); needs ``pip install
  mlflow-skinny`` (or ``mlflow``);
* ``wandb``: one W&B run per trial in project ``qkgeom-NAME``, in offline mode unless
  ``$WANDB_MODE`` says otherwise, written under ``$WANDB_DIR`` (default: the working
  directory) as ``wandb/offline-run-*`` (``wandb sync DIR/wandb/offline-run-*`` uploads
  later); needs ``pip install wandb`` (the ``trackers`` extra). Tested offline: the values
  read back from the run files equal the database's (tests/test_trackers.py).

Trackers read the records the driver receives, so they need the default driver writes:
``--direct-writes`` (workers write their own rows) is refused with them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from qkgeom.errors import QkgeomError

TRACKERS = ("tensorboard", "mlflow", "wandb")


def flat_result(result: dict[str, Any]) -> dict[str, Any] | None:
    """The scalars of one reported result under readable names, or None when it holds
    nothing to log (e.g. a trial skipped on resume)."""
    out: dict[str, Any] = {}
    rec = result.get("record")
    if rec:
        d = json.loads(rec)
        for k in ("val_loss", "train_loss", "tokens_per_s"):
            if d.get(k) is not None:
                out[k] = float(d[k])
        for layer, head, name, value in d["metrics"]:
            key = f"{name}/layer{int(layer)}" + ("" if head is None else f"/head{int(head)}")
            out[key] = float(value)
    if result.get("test_loss") is not None:
        out["test_loss"] = float(result["test_loss"])
    if not out:
        return None
    step = int(result.get("step") or 0)
    # the callbacks' step is `timesteps_total or training_iteration`: both are the
    # training step, so step 0 stays 0 (tensorboard drops the iteration from its scalars)
    out["timesteps_total"] = step
    out["training_iteration"] = step
    return out


class _Flattening:
    """Mixed in before a Tune logger callback: it sees the flattened result only."""

    def log_trial_result(self, iteration: int, trial: Any, result: dict) -> None:
        flat = flat_result(result)
        if flat is not None:
            super().log_trial_result(iteration, trial, flat)  # type: ignore[misc]


# class name -> (module, Tune callback it flattens for)
_BASES = {"TensorBoardLogger": ("ray.tune.logger", "TBXLoggerCallback"),
          "MLflowLogger": ("ray.air.integrations.mlflow", "MLflowLoggerCallback"),
          "WandbLogger": ("ray.air.integrations.wandb", "WandbLoggerCallback")}


def _flattening(name: str) -> Any:
    """``class NAME(_Flattening, <Tune's callback>)``, importable as ``qkgeom.sweeps.trackers.NAME``."""
    import importlib

    mod, base = _BASES[name]
    cls = type(name, (_Flattening, getattr(importlib.import_module(mod), base)), {})
    cls.__module__ = __name__
    return cls


def __getattr__(name: str) -> Any:
    # Tune pickles its callbacks into the experiment state by module path: the classes
    # resolve here on a resume (built on first use, so importing qkgeom needs no tracker)
    if name in _BASES:
        cls = _flattening(name)
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def mlflow_uri() -> str:
    """``$MLFLOW_TRACKING_URI``, else an SQLite store in the working directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or \
        f"sqlite:///{(Path.cwd() / 'mlflow.db').resolve()}"


def wandb_mode() -> str:
    """``$WANDB_MODE``, else ``offline``: nothing leaves the machine unless asked."""
    return os.environ.get("WANDB_MODE") or "offline"


def wandb_dir() -> str:
    """Where W&B writes its runs (``DIR/wandb/offline-run-*``): ``$WANDB_DIR``, else the
    working directory, as MLflow's default store."""
    return os.environ.get("WANDB_DIR") or str(Path.cwd().resolve())


def check_trackers(names: tuple[str, ...] | list[str], *, direct_writes: bool) -> None:
    """Refuse, before anything starts, a tracker whose package is missing."""
    import importlib.util

    if names and direct_writes:
        raise QkgeomError("--logger needs the driver to see every probe: drop --direct-writes "
                          "(the database gets the same rows either way)")
    need = {"tensorboard": ("tensorboardX", "pip install tensorboardX"),
            "mlflow": ("mlflow", "pip install mlflow-skinny"),
            "wandb": ("wandb", "pip install wandb")}
    for n in names:
        if n not in need:
            raise QkgeomError(f"unknown --logger {n!r}; choose from {', '.join(TRACKERS)}")
        mod, how = need[n]
        if importlib.util.find_spec(mod) is None:
            raise QkgeomError(f"--logger {n} needs the {mod} package: {how}")


def tracker_callbacks(names: tuple[str, ...] | list[str], sweep: str) -> list[Any]:
    """Tune callbacks for the trackers ``names`` of sweep ``sweep``."""
    mod = __import__(__name__, fromlist=["x"])
    out = []
    for n in dict.fromkeys(names):
        if n == "tensorboard":
            out.append(mod.TensorBoardLogger())
        elif n == "mlflow":
            out.append(mod.MLflowLogger(tracking_uri=mlflow_uri(),
                                        experiment_name=f"qkgeom-{sweep}",
                                        tags={"qkgeom.plan.spec": sweep}))
        elif n == "wandb":
            # the driver's environment tells Tune's callback not to look for an API key
            # offline; the mode itself goes to wandb.init in Tune's logging actor, which an
            # environment variable set here, after Ray started, would not reach
            os.environ.setdefault("WANDB_MODE", wandb_mode())
            out.append(mod.WandbLogger(project=f"qkgeom-{sweep}", mode=wandb_mode(),
                                       dir=wandb_dir()))
    return out
