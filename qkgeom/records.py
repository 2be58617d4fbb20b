"""The records a trial emits: the one contract between the engine, storage, Ray and stats.

A trial emits one :class:`ProbeRecord` per probe (step 0, every ``probe_every`` steps and
the last step) and one :class:`StepRecord` per validation point. Metric values are long
rows ``(layer, head, name, value)``: ``head`` is ``None`` for a layer-level value
(heads concatenated, or averaged over heads where the metric is per head by nature).
Values may be non-finite (NaN, inf); storage keeps them faithfully.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

Row = tuple[int, "int | None", str, float]  # (layer, head | None, metric name, value)
# name -> (unit, meaning). Layer-level rows (head NULL) exist for every name; head-level
# rows exist for those marked per_head.
METRICS: dict[str, dict[str, Any]] = {
    "pr_q": dict(per_head=True, unit="dims", doc="participation ratio of mean-centred query "
                 "activations on the probe batch; layer: heads concatenated"),
    "pr_k": dict(per_head=True, unit="dims", doc="participation ratio of mean-centred key "
                 "activations on the probe batch; layer: heads concatenated"),
    "pr_wq": dict(per_head=True, unit="dims", doc="PR of the squared singular values of W_Q "
                  "(layer: whole d_model x d_model matrix; head: its d_head rows)"),
    "pr_wk": dict(per_head=True, unit="dims", doc="PR of the squared singular values of W_K"),
    "qk_pr": dict(per_head=True, unit="dims", doc="PR of the squared singular values of "
                  "W_Q^h (W_K^h)^T, computed in factored form; layer: mean over heads"),
    "qk_erank": dict(per_head=True, unit="dims", doc="effective rank exp(H(s/sum s)) of the "
                     "singular values of W_Q^h (W_K^h)^T; layer: mean over heads"),
    "token_erank": dict(per_head=True, unit="dims", doc="effective rank exp(H(s/sum s)) of "
                        "the row-centred token-level score matrix Q K_c^T (keys centred over "
                        "the sequence, so per-row logit constants, which softmax ignores, drop "
                        "out; unmasked), from d_head-sized factors; 1 when every row is "
                        "constant; mean over probe sequences; layer: mean over heads"),
    "entropy": dict(per_head=True, unit="nats", doc="attention entropy -sum p log p over "
                    "visible keys, mean over query rows with >= 2 visible keys; layer: mean "
                    "over heads"),
    "entropy_norm": dict(per_head=True, unit="ratio", doc="entropy / log(k visible), mean over "
                         "rows with >= 2 visible keys; 1 = uniform"),
    "wk_target_pr": dict(per_head=False, unit="dims", doc="intervention target at this step: "
                         "W_K's weight PR at the weight site, the key-activation PR at the "
                         "activation site (arms only)"),
}

# names that only pretrained measurements store (``probe-pretrained --prerot``); declared in
# ``metric_definitions`` beside METRICS, never part of a trained trial's probe
PRETRAINED_ONLY_METRICS: dict[str, dict[str, Any]] = {
    "pr_q_prerot": dict(per_head=True, unit="dims", doc="rotary models with --prerot: PR of "
                        "the query projections before the rotary embedding; layer: heads "
                        "concatenated"),
    "pr_k_prerot": dict(per_head=True, unit="dims", doc="rotary models with --prerot: PR of "
                        "the key projections before the rotary embedding; layer: key heads "
                        "concatenated"),
}
METRIC_DEFINITIONS: dict[str, dict[str, Any]] = {**METRICS, **PRETRAINED_ONLY_METRICS}


@dataclass
class StepRecord:
    """Training scalars at one step. ``val_loss`` is NaN except at validation points."""

    step: int
    train_loss: float  # mean training loss over the steps since the previous StepRecord
    val_loss: float
    lr: float
    tokens_per_s: float


@dataclass
class ProbeRecord:
    """One probe of one trial. ``metrics`` rows are ``(layer, head | None, name, value)``."""

    step: int  # optimizer steps completed when probed (0 = at init)
    progress: float  # step / max_steps, the study's "training progress" in [0, 1]
    tokens: int  # training tokens seen so far
    train_loss: float  # mean training loss (nats/char) since the previous probe; NaN at 0
    val_loss: float  # validation loss (nats/char) at this step
    lr: float  # learning rate at this step
    tokens_per_s: float  # training throughput since the previous probe (0 at step 0)
    metrics: list[tuple[int, int | None, str, float]] = field(default_factory=list)
    # training scalars logged since the previous probe (every cfg.log_every steps)
    history: list[StepRecord] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["metrics"] = [list(m) for m in self.metrics]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProbeRecord:
        d = dict(d)
        d["metrics"] = [(int(a), None if b is None else int(b), str(c), float(v))
                        for a, b, c, v in d["metrics"]]
        d["history"] = [StepRecord(**h) for h in d.get("history", [])]
        return cls(**d)


@dataclass
class TrialResult:
    """What ``train`` returns once a trial finishes."""

    steps: int
    final_val_loss: float
    test_loss: float  # nats/char on the evaluation split
    unigram_entropy: float  # nats/char of the evaluation split's character distribution
    wall_s: float
    tokens_per_s: float
    device: str
    data_note: str  # e.g. "trained on wiki.valid.raw, evaluated on wiki.test.raw"
    n_params: int
    extra: dict[str, Any] = field(default_factory=dict)


def to_jsonable(v: Any, *, finite: bool = True) -> Any:
    """``v`` as plain JSON data: dicts (keys as text), lists (from tuples and numpy arrays)
    and Python scalars (from numpy scalars). With ``finite`` NaN and +-inf become None, as
    strict JSON (``allow_nan=False``) needs; without it they stay floats (the statistics'
    ``to_dict`` keeps NaN). The one JSON cleaner of stats, report and ``qkgeom stats``."""
    if isinstance(v, dict):
        return {k if isinstance(k, str) else str(k): to_jsonable(x, finite=finite)
                for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [to_jsonable(x, finite=finite) for x in v]
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):  # numpy scalar or array
        v = v.tolist()
        if isinstance(v, list):
            return [to_jsonable(x, finite=finite) for x in v]
    if isinstance(v, float):
        return None if finite and not math.isfinite(v) else float(v)
    return v
