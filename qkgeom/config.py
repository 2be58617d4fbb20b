"""Trial configuration: one dataclass, validated on construction, stored with every run.

``TrialConfig.from_dict`` rejects unknown keys (naming them and the closest valid key),
``to_dict`` round-trips, and ``with_overrides`` applies ``--set key=value`` strings with
the field's own type. Every field marked *(reconstructed)* in PAPER.md is a field here,
never a constant in code.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from dataclasses import dataclass, field, fields
from typing import Any

from qkgeom.errors import QkgeomError


class ConfigError(QkgeomError, ValueError):
    """A user mistake in a configuration; the message says which key and what to do."""


INITS = ("gaussian", "tied", "orthogonal")
# shrink_act is the shrink arm at the activation site: the arm name fixes the site, so that
# the two ways of contracting the keys are separate arms, each paired with the baseline
ARMS = ("none", "hold", "shrink", "shrink_act")
ACTIVATION_ARMS = ("shrink_act",)
TARGET_MODES = ("init_fraction", "absolute", "baseline_fraction")
SCHEDULES = ("linear", "cosine", "exp", "constant")
SITES = ("weight", "activation")


@dataclass
class TrialConfig:
    # --- model (nanoGPT-style char-level GPT) ---
    n_layer: int = 6  # transformer blocks (the study's "depth")
    n_embd: int = 256  # residual width d_model
    n_head: int = 4  # attention heads; d_head = n_embd // n_head
    block_size: int = 256  # context length in characters
    dropout: float = 0.0  # dropout everywhere (0 keeps probes deterministic)
    bias: bool = False  # bias in Linear / LayerNorm layers
    init: str = "gaussian"  # Q/K initialisation: a key of qkgeom.engine.model.QK_INITS
    init_std: float = 0.02  # std of the normal init of every weight matrix
    # --- intervention on the key spectrum (reconstructed) ---
    arm: str = "none"  # none | hold | shrink | shrink_act (shrink at the activation site)
    site: str = "weight"  # weight: reshape W_K's spectrum; activation: rescale k in forward
    # (arm shrink_act always uses the activation site)
    target_mode: str = "init_fraction"  # init_fraction | absolute | baseline_fraction
    shrink_to: float = 0.5  # shrink: final target as a fraction (or absolute PR)
    shrink_schedule: str = "linear"  # linear | cosine | exp | constant: start -> final
    shrink_start: float = 0.0  # fraction of training before the schedule starts moving
    baseline_pr: list = field(default_factory=list)  # [[step, [pr_wk per layer]], ...]
    act_momentum: float = 0.99  # activation site: EMA momentum of the key covariance
    # --- optimisation ---
    max_steps: int = 5000  # optimizer steps
    batch_size: int = 64  # sequences per step
    lr: float = 1e-3  # peak learning rate (AdamW)
    min_lr: float = 1e-4  # floor of the cosine decay
    warmup_steps: int = 100  # linear warm-up steps (used when warmup_frac is 0)
    warmup_frac: float = 0.0  # warm-up as a fraction of max_steps; > 0 replaces warmup_steps
    weight_decay: float = 0.1  # AdamW weight decay on matrices
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # global grad-norm clip (0 disables)
    # --- measurement ---
    probe_every: int = 250  # probe geometry every N steps (and at step 0 and the end)
    probe_batch: int = 8  # sequences in the fixed held-out probe batch
    eval_every: int = 250  # validation loss every N steps
    log_every: int = 10  # training scalars (loss, lr, tokens/s) every N steps
    eval_batches: int = 8  # batches averaged for the validation loss
    test_batches: int = 32  # batches for the final test loss
    checkpoint_every: int = 0  # checkpoint every N steps (0: at every probe)
    # --- data and run ---
    dataset: str = "wikitext-103"  # wikitext-103 | wikitext-2 | a directory | a text file
    seed: int = 0  # seeds init, data order and dropout (with seed_stream: rng_seed)
    # the cell's random stream (qkgeom.plan.spec.seed_stream_of): empty, the seed is used
    # as it is (every run recorded before streams existed); otherwise init, data order and
    # dropout draw from rng_seed, derived from the stream and the seed, so two cells with
    # the same seed ids are independent replicates
    seed_stream: str = ""
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 0  # torch intra-op threads on CPU (0: torch default)
    compile: bool = False  # torch.compile the model (GPU runs)
    fail_at_step: int = -1  # TEST ONLY: raise once at this step (exercises retries)

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ConfigError(f"{key}: {msg}")

        for name in ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "probe_batch"):
            need(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        need(self.max_steps > 0, "max_steps", f"must be positive, got {self.max_steps}")
        need(
            self.n_embd % self.n_head == 0,
            "n_embd",
            f"{self.n_embd} is not divisible by n_head={self.n_head}",
        )
        need(self.init in INITS, "init", f"unknown init {self.init!r}; choose from {INITS}")
        need(
            self.init != "orthogonal" or self.d_head >= 2,
            "init",
            "orthogonal needs d_head = n_embd / n_head >= 2 (it splits each head's dimensions)",
        )
        need(self.arm in ARMS, "arm", f"unknown arm {self.arm!r}; choose from {ARMS}")
        if self.arm in ACTIVATION_ARMS:
            self.site = "activation"
        need(self.site in SITES, "site", f"unknown site {self.site!r}; choose from {SITES}")
        need(
            self.target_mode in TARGET_MODES,
            "target_mode",
            f"unknown mode {self.target_mode!r}; choose from {TARGET_MODES}",
        )
        need(
            self.shrink_schedule in SCHEDULES,
            "shrink_schedule",
            f"unknown schedule {self.shrink_schedule!r}; choose from {SCHEDULES}",
        )
        need(self.shrink_to > 0, "shrink_to", "must be positive")
        need(0 <= self.shrink_start < 1, "shrink_start", "must be in [0, 1)")
        need(0 <= self.dropout < 1, "dropout", "must be in [0, 1)")
        need(self.lr > 0, "lr", "must be positive")
        need(self.min_lr >= 0, "min_lr", "must be non-negative")
        need(self.warmup_steps >= 0, "warmup_steps", "must be non-negative")
        need(0 <= self.warmup_frac < 1, "warmup_frac", "must be in [0, 1)")
        need(self.probe_every > 0, "probe_every", "must be positive")
        need(self.eval_every > 0, "eval_every", "must be positive")
        need(self.log_every > 0, "log_every", "must be positive")
        need(self.eval_batches > 0, "eval_batches", "must be positive")
        need(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0")
        need(0 < self.act_momentum < 1, "act_momentum", "must be in (0, 1)")
        if self.target_mode == "baseline_fraction" and self.arm != "none":
            need(
                bool(self.baseline_pr),
                "baseline_pr",
                "target_mode=baseline_fraction needs the paired baseline's W_K PR "
                "(the sweep fills it from the baseline run of the same seed)",
            )

    # ------------------------------------------------------------------ derived
    @property
    def d_head(self) -> int:
        return self.n_embd // self.n_head

    @property
    def warmup(self) -> int:
        """Warm-up length in steps: ``round(warmup_frac * max_steps)`` when warmup_frac > 0."""
        if self.warmup_frac > 0:
            return int(round(self.warmup_frac * self.max_steps))
        return self.warmup_steps

    @property
    def rng_seed(self) -> int:
        """The seed init, data order and dropout draw from: ``seed`` itself without a
        ``seed_stream`` (derivation 1); else the first 8 bytes of
        ``sha256("qkgeom-seed-v2:<stream>:<seed>")`` as an unsigned integer, shifted right
        by one (derivation 2: 63 bits, independent across streams)."""
        if not self.seed_stream:
            return self.seed
        digest = hashlib.sha256(f"qkgeom-seed-v2:{self.seed_stream}:{self.seed}".encode())
        return int.from_bytes(digest.digest()[:8], "big") >> 1

    # ------------------------------------------------------------------ (de)serialise
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrialConfig:
        check_keys(d, cls.field_names(), what="config key")
        typed = {k: coerce(cls, k, v) for k, v in d.items()}
        return cls(**typed)

    def with_overrides(self, overrides: dict[str, Any] | list[str] | tuple[str, ...]) -> TrialConfig:
        """Return a copy with overrides applied (a dict, or ``key=value`` strings)."""
        if not isinstance(overrides, dict):
            overrides = parse_sets(overrides)
        d = self.to_dict()
        check_keys(overrides, self.field_names(), what="config key")
        d.update({k: coerce(type(self), k, v) for k, v in overrides.items()})
        return type(self)(**d)


def check_keys(d: dict[str, Any], valid: list[str], what: str) -> None:
    for k in d:
        if k not in valid:
            near = difflib.get_close_matches(k, valid, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"unknown {what} {k!r}{hint}; valid keys: {', '.join(valid)}")


def parse_sets(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Parse repeated ``--set key=value`` strings into a dict of raw strings."""
    out: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value")
        k, v = item.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def coerce(cls: type, key: str, value: Any) -> Any:
    """Convert a raw (often string) value to the declared type of ``cls.key``."""
    ftype = {f.name: f.type for f in fields(cls)}[key]
    if not isinstance(value, str):
        if ftype == "float" and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        return value
    try:
        if ftype == "int":
            return int(value)
        if ftype == "float":
            return float(value)
        if ftype == "bool":
            low = value.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if ftype == "list":
            return json.loads(value)
    except (ValueError, json.JSONDecodeError) as e:
        raise ConfigError(f"{key}: cannot read {value!r} as {ftype}") from e
    return value


# ---------------------------------------------------------------------- presets
#
# smoke: a trial in a few seconds on one CPU core (tests); its optimiser is not the paper's.
# cpu:   the study scaled to a 2-core machine (n_embd 48, context 48, 1,500 steps) with the
#        paper preset's optimiser: peak lr 1e-3, cosine floor 1e-4, warm-up 4% of training
#        (the paper preset's 200 of 5,000 steps), AdamW weight decay 0.1, betas (0.9, 0.99).
#        Model scale and learning rate are the factors of the ladder in docs/findings.md;
#        the scale is its smallest cell whose verdicts are stable across seeds and whose
#        whole study fits 60 minutes on 2 cores (issue 10's rule; docs/findings.md).
# paper: PAPER.md's reconstructed settings, GPU scale.
PAPER_OPTIMISER: dict[str, Any] = dict(lr=1e-3, min_lr=1e-4, warmup_frac=0.04,
                                       weight_decay=0.1, beta1=0.9, beta2=0.99)
PRESETS: dict[str, dict[str, Any]] = {
    "smoke": dict(
        n_layer=2, n_embd=32, n_head=2, block_size=32, batch_size=8, max_steps=40,
        warmup_steps=5, probe_every=20, eval_every=20, eval_batches=2, test_batches=4,
        probe_batch=4, lr=3e-3, min_lr=3e-4, threads=1,
    ),
    "cpu": dict(
        n_layer=4, n_embd=48, n_head=4, block_size=48, batch_size=32, max_steps=1500,
        probe_every=100, eval_every=100, eval_batches=4, test_batches=16, probe_batch=8,
        threads=1, **PAPER_OPTIMISER,
    ),
    "paper": dict(
        n_layer=6, n_embd=256, n_head=4, block_size=256, batch_size=64, max_steps=5000,
        probe_every=250, eval_every=250, eval_batches=16, test_batches=64, probe_batch=16,
        **PAPER_OPTIMISER,
    ),
}


def preset(name: str) -> TrialConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return TrialConfig(**PRESETS[name])
