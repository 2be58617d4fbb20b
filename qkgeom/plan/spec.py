"""The sweep spec as data: which trials a study runs. Pure Python, no Ray.

A spec has a trial base (a :data:`qkgeom.config.PRESETS` name plus overrides), a
*geometry grid* (depths x inits x seeds, arm ``none``) and an *intervention study*
(arms x seeds at one depth and init). Every intervention arm is paired by seed with the
arm-``none`` trial of the same depth, init and seed: that baseline is shared with the grid
when the grid already has it, and added once otherwise.

Spec file (YAML or TOML; every section optional except that one of grid/interventions
must yield trials)::

    name: mystudy                  # default sweep name
    trial:
      preset: cpu                  # base TrialConfig preset (qkgeom.config.PRESETS)
      overrides: {max_steps: 300}  # any TrialConfig key except n_layer/init/arm/seed
    grid:
      depths: [2, 3, 4]
      inits: [gaussian, tied, orthogonal]
      seeds: 2                     # an int n means seeds 0..n-1; or a list
    interventions:
      depth: 4
      init: gaussian
      arms: [hold, shrink]         # 'none' may be listed; the baseline is always run
      seeds: 3
      arm_overrides:               # optional per-arm TrialConfig overrides
        shrink: {shrink_to: 0.25}
    snapshots: all                 # weight snapshots kept: all | none | every:N (default all)
    axes: {lr: [1.0e-3, 3.0e-3]}   # factors beyond the grid: see qkgeom.plan.cells

Trial keys are deterministic: ``d{depth}-{init}-{arm}-s{seed}``, e.g. ``d4-gaussian-none-s0``,
prefixed by the cell label in a spec with ``axes`` or ``cells`` (``lr0.001.d4-gaussian-none-s0``).
An arm whose config uses ``target_mode: baseline_fraction`` needs its paired baseline's
PR trajectory (W_K weight PR; key-activation PR_K for the activation site); such trials are marked ``needs_baseline`` and run after the baselines.
"""

from __future__ import annotations

import copy
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from qkgeom.config import ARMS, INITS, PRESETS, ConfigError, TrialConfig
from qkgeom.config import check_keys as _config_check_keys
from qkgeom.errors import QkgeomError
from qkgeom.names import SweepNameError, check_sweep_name
from qkgeom.plan.cells import Cell, spec_cells

# Set per trial by the spec itself; a trial-level override of these would be silently lost.
GRID_KEYS = ("n_layer", "init", "arm", "seed")
SPEC_KEYS = ["name", "trial", "axes", "cells", "grid", "interventions", "snapshots",
             "seed_streams"]
# seed_streams: "per-cell" (a new sweep's default, written into its stored spec by
# plan_from): each cell's trials draw from a stream derived from the cell's config, so
# seed 0 of two cells are independent; "shared" (a spec without the key: every sweep
# recorded before streams existed): the seed alone, the same in every cell
SEED_STREAMS = ("per-cell", "shared")
# what does not make two cells different experiments: set per trial, or where and how a
# run is measured and executed
STREAM_EXCLUDED = ("n_layer", "init", "arm", "seed", "seed_stream", "dataset", "device",
                   "threads", "compile", "fail_at_step", "probe_every", "probe_batch",
                   "eval_every", "log_every", "eval_batches", "test_batches",
                   "checkpoint_every")
SNAPSHOT_POLICIES = "all | none | every:N"
DEFAULT_SNAPSHOTS = "all"  # every preset: see docs/sweeps.md for the paper sweep's disk cost
TRIAL_KEYS = ["preset", "overrides"]
GRID_SECTION_KEYS = ["depths", "inits", "seeds"]
INTERVENTION_KEYS = ["depth", "init", "arms", "seeds", "arm_overrides"]
# a placeholder so that baseline_fraction configs validate before the baseline exists
_PLACEHOLDER_PR = [[0, [1.0]]]


class SpecError(ConfigError):
    """A bad sweep spec; the message names the key."""


class SweepError(QkgeomError):
    """A sweep that cannot start or resume; the message says what to do."""


def check_keys(d: dict[str, Any], valid: list[str], what: str) -> None:
    try:
        _config_check_keys(d, valid, what)
    except ConfigError as e:
        raise SpecError(str(e)) from None


# ---------------------------------------------------------------------- presets
# The arms of every study preset (docs/sweeps.md, "Arms and their targets"): ``shrink``
# and ``shrink_act`` contract relative to the paired baseline of the same seed (its W_K
# weight PR for shrink, its key-activation PR_K for shrink_act), to half of it by the end;
# ``hold`` keeps the layer's step-0 W_K PR.
STUDY_ARM_OVERRIDES: dict[str, dict[str, Any]] = {
    "shrink": {"target_mode": "baseline_fraction", "shrink_to": 0.5},
    "shrink_act": {"target_mode": "baseline_fraction", "shrink_to": 0.5},
}
STUDY_ARMS = ["none", "hold", "shrink", "shrink_act"]
PAPER_SEEDS = {"grid": [0, 1, 2, 3], "arms": [0, 1, 2, 3, 4]}  # PAPER.md: 4 and 5 seeds
# The paired seeds of the study presets, sized by power, not by the paper's five: claim 4's
# primary arm (shrink, stats.registry.PRIMARY_ARM) tested alone by the exact sign-flip test
# has >= 80% power at a 1-sd paired entropy effect with 8 seeds (82%; 5 seeds: 0% in a
# family of three, 6: 35%; stats.power.family_power, docs/statistics.md "Presets sized by
# power"), and 8 baseline seeds also let claim 2 (the seed its unit) reach 5%.
ARM_SEEDS = list(range(8))

SWEEP_PRESETS: dict[str, dict[str, Any]] = {
    # tiny, for tests: 4 grid trials + 1 extra baseline + 3 arms x 2 seeds, seconds each
    # (2 paired seeds, not 5: the smoke sweep runs in the test suite)
    "smoke": {
        "name": "smoke",
        "trial": {"preset": "smoke", "overrides": {}},
        "grid": {"depths": [1, 2], "inits": ["gaussian", "orthogonal"], "seeds": [0]},
        "interventions": {"depth": 2, "init": "gaussian",
                          "arms": ["hold", "shrink", "shrink_act"], "seeds": [0, 1],
                          "arm_overrides": copy.deepcopy(STUDY_ARM_OVERRIDES)},
    },
    # the study scaled to a 2-core machine: 18 grid trials + 6 extra baselines + 3 arms x 8
    # seeds = 48 trials. Two grid seeds, not the paper's four, so that the whole study fits
    # the 2-core machine's budget (docs/sweeps.md, "Time budget"); 8 paired seeds for the
    # power of claim 4 (ARM_SEEDS)
    "cpu": {
        "name": "cpu",
        "trial": {"preset": "cpu", "overrides": {}},
        "grid": {"depths": [2, 3, 4], "inits": list(INITS), "seeds": [0, 1]},
        "interventions": {"depth": 4, "init": "gaussian", "arms": STUDY_ARMS,
                          "seeds": ARM_SEEDS,
                          "arm_overrides": copy.deepcopy(STUDY_ARM_OVERRIDES)},
    },
    # PAPER.md's design (36 geometry runs, the arms at depth 6, gaussian init), with the
    # arms at 8 paired seeds (ARM_SEEDS) instead of the paper's five
    "paper": {
        "name": "paper",
        "trial": {"preset": "paper", "overrides": {}},
        "grid": {"depths": [4, 6, 8], "inits": list(INITS), "seeds": PAPER_SEEDS["grid"]},
        "interventions": {"depth": 6, "init": "gaussian", "arms": STUDY_ARMS,
                          "seeds": ARM_SEEDS,
                          "arm_overrides": copy.deepcopy(STUDY_ARM_OVERRIDES)},
    },
}


@dataclass
class TrialSpec:
    """One trial of a sweep: its key, full config and the grid coordinates."""

    key: str
    config: dict[str, Any]  # TrialConfig.to_dict(), validated
    depth: int
    init: str
    arm: str
    seed: int
    baseline_key: str | None = None  # the paired arm-'none' trial (arms only)
    needs_baseline: bool = False  # config needs baseline_pr filled from baseline_key
    cell: str | None = None  # the cell label in a spec with factors (qkgeom.plan.cells)

    def to_dict(self) -> dict[str, Any]:
        return dict(key=self.key, config=self.config, depth=self.depth, init=self.init,
                    arm=self.arm, seed=self.seed, baseline_key=self.baseline_key,
                    needs_baseline=self.needs_baseline, cell=self.cell)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrialSpec:
        return cls(**d)


@dataclass
class SweepPlan:
    """A validated spec and the trials it expands to (in run order)."""

    name: str
    spec: dict[str, Any]  # the normalised spec (stored in the database)
    trials: list[TrialSpec] = field(default_factory=list)
    snapshots: str = DEFAULT_SNAPSHOTS  # weight snapshots kept (see snapshot_every)

    def by_key(self) -> dict[str, TrialSpec]:
        return {t.key: t for t in self.trials}

    def probes_per_trial(self, key: str) -> int:
        """Number of ProbeRecords a trial emits: step 0, every probe_every, and the end."""
        c = self.by_key()[key].config
        steps = set(range(0, c["max_steps"] + 1, c["probe_every"])) | {c["max_steps"]}
        return len(steps)


def snapshot_every(policy: str) -> int | None:
    """The ``train(snapshot_every=...)`` of a snapshot policy: None for ``none``, 0 for
    ``all`` (every probe step), N for ``every:N`` (probe steps that are multiples of N,
    and the last step)."""
    p = str(policy).strip()
    if p == "all":
        return 0
    if p == "none":
        return None
    if p.startswith("every:"):
        try:
            n = int(p[len("every:"):])
        except ValueError:
            n = 0
        if n > 0:
            return n
    raise SpecError(f"snapshots: {policy!r} is not a snapshot policy; use {SNAPSHOT_POLICIES} "
                    "(N: a positive step count, a multiple of probe_every)")


def _check_snapshots(policy: Any, trials: list[TrialSpec]) -> str:
    if not isinstance(policy, str):
        raise SpecError(f"snapshots: expected {SNAPSHOT_POLICIES}, got {policy!r}")
    n = snapshot_every(policy)
    for t in trials:
        pe = t.config["probe_every"]
        if n and n % pe:
            raise SpecError(f"snapshots: every:{n} is not a multiple of probe_every={pe} "
                            f"(trial {t.key}); snapshots are taken at probe steps, e.g. "
                            f"every:{pe * max(1, round(n / pe))}")
    return policy.strip()


def trial_key(depth: int, init: str, arm: str, seed: int, cell: str | None = None) -> str:
    key = f"d{depth}-{init}-{arm}-s{seed}"
    return f"{cell}.{key}" if cell else key


# ---------------------------------------------------------------------- loading
def load_spec_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (.yaml/.yml) or TOML (.toml) spec file into a dict."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"spec file {str(p)!r} not found")
    text = p.read_text()
    try:
        if p.suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover
                import tomli as tomllib
            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except Exception as e:  # yaml/toml parse errors carry the line number
        raise SpecError(f"spec file {str(p)!r}: cannot parse: {parse_error(e)}") from None
    if not isinstance(data, dict):
        raise SpecError(f"spec file {str(p)!r}: expected a mapping at the top level")
    return data


def parse_error(e: Exception) -> str:
    """One line from a YAML or TOML parse error, with its line and column."""
    mark = getattr(e, "problem_mark", None)
    if isinstance(e, yaml.MarkedYAMLError) and mark is not None:
        what = e.problem or e.context or "invalid YAML"
        return f"line {mark.line + 1}, column {mark.column + 1}: {what}"
    return " ".join(str(e).split()) or type(e).__name__


def _parse_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def apply_sets(spec: dict[str, Any], sets: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Apply ``--set`` items to a raw spec.

    ``key=value`` with a plain TrialConfig key goes to ``trial.overrides``; a dotted key
    addresses the spec itself (``grid.seeds=3``, ``interventions.arms=[hold]``,
    ``trial.preset=cpu``). Values are read as YAML (``3``, ``[1, 2]``, ``true``).
    """
    spec = copy.deepcopy(spec)
    for item in sets:
        if "=" not in item:
            raise SpecError(f"--set {item!r}: expected key=value")
        key, raw = (s.strip() for s in item.split("=", 1))
        if "." in key:
            path = key.split(".")
            check_keys({path[0]: None}, SPEC_KEYS, what="spec key")
            node = spec
            for part in path[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise SpecError(f"--set {key}: {part!r} is not a section")
            node[path[-1]] = _parse_value(raw)
        else:
            check_keys({key: None}, TrialConfig.field_names(), what="--set key")
            trial = spec.setdefault("trial", {})
            # keep the raw string: TrialConfig coerces it with the field's own type
            trial.setdefault("overrides", {})[key] = raw
    return spec


def _seeds(value: Any, where: str) -> list[int]:
    if isinstance(value, bool):
        raise SpecError(f"{where}: expected an int count or a list of ints, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise SpecError(f"{where}: a seed count must be >= 1, got {value}")
        return list(range(value))
    return _int_list(value, where)


def _int_list(value: Any, where: str) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list) or not value:
        raise SpecError(f"{where}: expected a non-empty list of ints, got {value!r}")
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool):
            raise SpecError(f"{where}: expected ints, got {v!r}")
    if len(set(value)) != len(value):
        raise SpecError(f"{where}: duplicate values in {value}")
    return list(value)


def _str_list(value: Any, where: str, choices: tuple[str, ...]) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise SpecError(f"{where}: expected a non-empty list, got {value!r}")
    for v in value:
        if v not in choices:
            raise SpecError(f"{where}: unknown value {v!r}; choose from {', '.join(choices)}")
    if len(set(value)) != len(value):
        raise SpecError(f"{where}: duplicate values in {value}")
    return list(value)


def _section(spec: dict[str, Any], key: str, valid: list[str]) -> dict[str, Any] | None:
    sec = spec.get(key)
    if sec is None:
        return None
    if not isinstance(sec, dict):
        raise SpecError(f"{key}: expected a mapping, got {type(sec).__name__}")
    check_keys(sec, valid, what=f"key in {key!r}")
    return sec


def _config(base: dict[str, Any], overrides: dict[str, Any], where: str,
            **grid: Any) -> dict[str, Any]:
    d = dict(base)
    d.update(overrides)
    d.update(grid)
    if d.get("target_mode") == "baseline_fraction" and d.get("arm") != "none" \
            and not d.get("baseline_pr"):
        d["baseline_pr"] = _PLACEHOLDER_PR
    try:
        return TrialConfig.from_dict(d).to_dict()
    except ConfigError as e:
        raise SpecError(f"{where}: {e}") from None


def seed_stream_of(base: dict[str, Any], cell_over: dict[str, Any]) -> str:
    """The random stream of a cell (``TrialConfig.seed_stream``): 16 hex digits of the
    sha256 of its trials' shared config (the base preset with the cell's overrides), less
    what is set per trial or only measures (:data:`STREAM_EXCLUDED`). Two cells that train
    the same way share it (they are one experiment); any other two draw independent
    numbers for the same seed id. Arms pair with their baseline: they share the cell's."""
    try:  # typed as the trials' configs are (lr 1 and 1.0 are one experiment)
        cfg = TrialConfig.from_dict({**base, **{k: v for k, v in cell_over.items()
                                                if k != "seed_stream"}}).to_dict()
    except ConfigError:
        return ""  # each trial's own validation says what is wrong, with where
    shared = {k: v for k, v in sorted(cfg.items()) if k not in STREAM_EXCLUDED}
    return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


def build_plan(spec: dict[str, Any], *, name: str | None = None, data: str | None = None,
               sets: list[str] | tuple[str, ...] = (),
               snapshots: str | None = None) -> SweepPlan:
    """Validate a raw spec (after ``--set``, ``--data`` and ``--snapshots``) and expand it
    into trials."""
    if not isinstance(spec, dict):
        raise SpecError("spec: expected a mapping")
    spec = apply_sets(spec, sets)
    if snapshots is not None:  # kept in the stored spec, like --data
        spec["snapshots"] = snapshots
    check_keys(spec, SPEC_KEYS, what="spec key")
    base_name, overrides = _trial_overrides(spec, data)
    base = TrialConfig(**PRESETS[base_name]).to_dict()
    trials: dict[str, TrialSpec] = {}
    arm_trials: list[TrialSpec] = []
    streams = spec.get("seed_streams", "shared")
    if streams not in SEED_STREAMS:
        raise SpecError(f"seed_streams: expected one of {', '.join(SEED_STREAMS)}, got "
                        f"{streams!r}")
    for cell in _cells(spec, overrides):  # baselines of every cell first, then the arms
        cell_over = {**overrides, **cell.factors}
        if streams == "per-cell":
            cell_over["seed_stream"] = seed_stream_of(base, cell_over)
        grid = _grid_trials(spec, base, cell_over, cell.label)
        baselines, arms = _intervention_trials(spec, base, cell_over, set(grid), cell.label)
        trials.update(grid)
        trials.update((t.key, t) for t in baselines)
        arm_trials += arms
    if not trials and not arm_trials:
        raise SpecError("spec: no trials; give a 'grid' and/or an 'interventions' section")

    sweep_name = name or spec.get("name") or base_name
    try:
        check_sweep_name(sweep_name, what="--name" if name else "name")
    except SweepNameError as e:
        raise SpecError(str(e)) from None
    all_trials = list(trials.values()) + arm_trials
    policy = _check_snapshots(spec.get("snapshots", DEFAULT_SNAPSHOTS), all_trials)
    normalised = json.loads(json.dumps(spec))  # plain JSON types for the database
    normalised["name"] = sweep_name
    return SweepPlan(sweep_name, normalised, all_trials, snapshots=policy)


def _cells(spec: dict[str, Any], overrides: dict[str, Any]) -> list[Cell]:
    try:
        return spec_cells(spec, overrides)
    except ConfigError as e:
        raise SpecError(str(e)) from None


def _trial_overrides(spec: dict[str, Any], data: str | None) -> tuple[str, dict[str, Any]]:
    """The ``trial`` section: its base preset name and the validated overrides, with
    ``--data`` as the dataset (also written into ``spec``)."""
    trial = _section(spec, "trial", TRIAL_KEYS) or {}
    base_name = trial.get("preset", "smoke")
    if base_name not in PRESETS:
        raise SpecError(f"trial.preset: unknown preset {base_name!r}; choose from "
                        f"{', '.join(PRESETS)}")
    overrides = trial.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise SpecError("trial.overrides: expected a mapping of TrialConfig keys")
    overrides = dict(overrides)
    check_keys(overrides, TrialConfig.field_names(), what="key in 'trial.overrides'")
    for k in GRID_KEYS:
        if k in overrides:
            raise SpecError(f"trial.overrides.{k}: set by the sweep grid; use grid.depths, "
                            "grid.inits, interventions.arms or the seeds lists instead")
    if data is not None:
        data = str(data)
        if Path(data).expanduser().exists():  # Ray workers run elsewhere: absolute paths only
            data = str(Path(data).expanduser().resolve())
        overrides["dataset"] = data
        # kept in the stored spec, so that a resume rebuilds the very same configs
        spec.setdefault("trial", {}).setdefault("overrides", {})["dataset"] = str(data)
    return base_name, overrides


def _grid_trials(spec: dict[str, Any], base: dict[str, Any],
                 overrides: dict[str, Any], cell: str | None = None
                 ) -> dict[str, TrialSpec]:
    """The geometry grid: depths x inits x seeds, arm ``none``, keyed by trial key."""
    trials: dict[str, TrialSpec] = {}
    grid = _section(spec, "grid", GRID_SECTION_KEYS)
    if grid is None:
        return trials
    for k in GRID_SECTION_KEYS:
        if k not in grid:
            raise SpecError(f"grid.{k}: missing")
    depths = _int_list(grid["depths"], "grid.depths")
    inits = _str_list(grid["inits"], "grid.inits", INITS)
    seeds = _seeds(grid["seeds"], "grid.seeds")
    for depth in depths:
        for init in inits:
            for seed in seeds:
                key = trial_key(depth, init, "none", seed, cell)
                cfg = _config(base, overrides, f"grid trial {key}", n_layer=depth,
                              init=init, arm="none", seed=seed)
                trials[key] = TrialSpec(key, cfg, depth, init, "none", seed, cell=cell)
    return trials


def _intervention_trials(spec: dict[str, Any], base: dict[str, Any],
                         overrides: dict[str, Any], have: set[str],
                         cell: str | None = None
                         ) -> tuple[list[TrialSpec], list[TrialSpec]]:
    """The intervention study: ``(baselines not in have, arm trials)``, each arm trial
    paired by seed with the arm-``none`` trial of its depth, init and seed."""
    inter = _section(spec, "interventions", INTERVENTION_KEYS)
    if inter is None:
        return [], []
    for k in ("depth", "init", "arms", "seeds"):
        if k not in inter:
            raise SpecError(f"interventions.{k}: missing")
    depth = inter["depth"]
    if not isinstance(depth, int) or isinstance(depth, bool):
        raise SpecError(f"interventions.depth: expected an int, got {depth!r}")
    init = inter["init"]
    if init not in INITS:
        raise SpecError(f"interventions.init: unknown init {init!r}; choose from "
                        f"{', '.join(INITS)}")
    arms = _str_list(inter["arms"], "interventions.arms", ARMS)
    seeds = _seeds(inter["seeds"], "interventions.seeds")
    arm_over = _arm_overrides(inter)
    baselines, arm_trials = [], []
    for seed in seeds:
        bkey = trial_key(depth, init, "none", seed, cell)
        if bkey not in have:  # the shared baseline, added once
            cfg = _config(base, overrides, f"baseline trial {bkey}", n_layer=depth,
                          init=init, arm="none", seed=seed)
            baselines.append(TrialSpec(bkey, cfg, depth, init, "none", seed, cell=cell))
        for arm in arms:
            if arm == "none":
                continue
            key = trial_key(depth, init, arm, seed, cell)
            cfg = _config(base, {**overrides, **arm_over.get(arm, {})},
                          f"intervention trial {key}", n_layer=depth, init=init, arm=arm,
                          seed=seed)
            needs = cfg["target_mode"] == "baseline_fraction"
            arm_trials.append(TrialSpec(key, cfg, depth, init, arm, seed,
                                        baseline_key=bkey, needs_baseline=needs, cell=cell))
    return baselines, arm_trials


def _arm_overrides(inter: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``interventions.arm_overrides``, validated: arm -> TrialConfig overrides."""
    arm_over = inter.get("arm_overrides") or {}
    if not isinstance(arm_over, dict):
        raise SpecError("interventions.arm_overrides: expected a mapping arm -> overrides")
    check_keys(arm_over, list(ARMS), what="arm in 'interventions.arm_overrides'")
    for arm, ov in arm_over.items():
        if not isinstance(ov, dict):
            raise SpecError(f"interventions.arm_overrides.{arm}: expected a mapping")
        check_keys(ov, TrialConfig.field_names(),
                   what=f"key in 'interventions.arm_overrides.{arm}'")
        for k in GRID_KEYS:
            if k in ov:
                raise SpecError(f"interventions.arm_overrides.{arm}.{k}: set by the sweep")
    if arm_over.get("none"):
        raise SpecError("interventions.arm_overrides.none: the baseline is shared with the "
                        "grid and takes the trial overrides only")
    return arm_over


def plan_summary(plan: SweepPlan) -> dict[str, Any]:
    """What a plan runs, without running it (``qkgeom sweep --dry-run``): trial counts,
    the seeds of every arm, and the distinct values of the scale and optimiser settings."""
    arms: dict[str, list[int]] = {}
    for t in plan.trials:
        arms.setdefault(t.arm, []).append(t.seed)
    settings = {}
    for k in ("n_layer", "n_embd", "n_head", "block_size", "max_steps", "batch_size", "lr",
              "min_lr", "warmup", "weight_decay", "beta1", "beta2"):
        vals = {TrialConfig.from_dict(t.config).warmup if k == "warmup" else t.config[k]
                for t in plan.trials}
        settings[k] = sorted(vals)
    return {"name": plan.name, "n_trials": len(plan.trials),
            "n_after_baselines": sum(t.needs_baseline for t in plan.trials),
            "arms": {a: sorted(set(s)) for a, s in arms.items()},
            "trials_per_arm": {a: len(s) for a, s in arms.items()}, "settings": settings}


def plan_from(preset: str | None = None, spec_file: str | Path | None = None, *,
              name: str | None = None, data: str | None = None,
              sets: list[str] | tuple[str, ...] = (),
              snapshots: str | None = None) -> SweepPlan:
    """The CLI entry: a sweep preset or a spec file (not both), then ``--set``/``--data``."""
    if preset is not None and spec_file is not None:
        raise SpecError("give either --preset or --spec, not both")
    if spec_file is not None:
        spec = load_spec_file(spec_file)
    else:
        preset = preset or "smoke"
        if preset not in SWEEP_PRESETS:
            raise SpecError(f"unknown sweep preset {preset!r}; choose from "
                            f"{', '.join(SWEEP_PRESETS)}")
        spec = copy.deepcopy(SWEEP_PRESETS[preset])
    # a new sweep: its cells' seeds are independent (qkgeom.config.TrialConfig.rng_seed);
    # kept in its stored spec, so that a resume rebuilds the very same configs, and absent
    # from the specs of sweeps recorded before (a resume of one keeps its shared seeds)
    spec.setdefault("seed_streams", "per-cell")
    return build_plan(spec, name=name, data=data, sets=sets, snapshots=snapshots)


def baseline_metric(config: dict[str, Any]) -> str:
    """The baseline metric a ``baseline_fraction`` target follows: the W_K weight PR at the
    weight site, the key-activation PR (heads concatenated) at the activation site."""
    return "pr_k" if config.get("site") == "activation" else "pr_wk"


def fill_baseline_pr(config: dict[str, Any], pr_rows: list[tuple[int, int, float]]
                     ) -> dict[str, Any]:
    """Return ``config`` with ``baseline_pr`` built from (step, layer, value) rows of the
    paired baseline's :func:`baseline_metric`."""
    by_step: dict[int, dict[int, float]] = {}
    for step, layer, value in pr_rows:
        by_step.setdefault(int(step), {})[int(layer)] = float(value)
    n_layer = config["n_layer"]
    traj = []
    for step in sorted(by_step):
        layers = by_step[step]
        if len(layers) != n_layer:
            continue
        traj.append([step, [layers[i] for i in range(n_layer)]])
    if not traj:
        raise SpecError(f"baseline_pr: the paired baseline has no layer-level "
                        f"{baseline_metric(config)} rows")
    out = dict(config)
    out["baseline_pr"] = traj
    TrialConfig.from_dict(out)
    return out
