"""The registry of the paper's claims: one :class:`ClaimSpec` per verdict the report can
print, declaring the paper's sentence, the data it reads, its unit of analysis (and why
those units are independent), its test and "holds" rule, the calibration rows that measure
it, and how its size and power at a study's design are computed.

The report (:mod:`qkgeom.report.claims`), the calibration (:mod:`qkgeom.stats.calibration`),
the page and the tests enumerate :data:`REGISTRY`; a verdict whose key is not in it cannot
be printed (:func:`spec`), and one whose calibration rows are missing says "not calibrated"
(a test fails on it). Adding a claim: one :class:`ClaimSpec` here, the function in
:mod:`qkgeom.report.claims` that measures it, its calibration rows, its test and its row in
docs/statistics.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qkgeom.stats import power as P
from qkgeom.stats.rules import ALPHA, LATE_FROM, MIN_CHECKPOINTS, min_seeds

# Claim 4's primary arm, fixed before any data: the paper's headline intervention claim
# (claim 4's first sentence, the one with "high directional confidence"). It is tested
# alone at alpha; hold and shrink_act are secondary, tested (Holm) only if it holds
# (stats.rules.arm_family_rule). So the study's seeds are sized for one arm's power.
PRIMARY_ARM = "shrink"

# the effect a "not shown" verdict states its power at, per kind of test
SEED_Q = 0.95  # each seed in the predicted direction with this probability
ARM_EFFECT = 1.0  # a paired entropy effect of 1 sd (the per-seed delta's sd)
CHECK_EFFECT = 2.0  # a reality check's paired effect, in sd


@dataclass(frozen=True)
class ClaimSpec:
    """One claim the report decides.

    ``kind`` names how its size and power at a design are computed (:func:`at_design`):
    ``seed-sign`` (a sign test over seeds; ``halves`` tests that must all pass),
    ``trial-permutation``, ``arm-family``, ``all-lower`` or ``several-models``.
    ``calibration``: the rule names of its rows in the calibration record; ``power_row``:
    for permutation rules, the scenario of the power row quoted beside a verdict.
    """

    key: str
    paper: str
    reads: str
    unit: str
    rule: str
    kind: str
    calibration: tuple[str, ...]
    figure: str | None = None
    halves: int = 1
    power_row: str = ""


_GAP_RULE = (
    "Claim 2 (gap): the unit is the seed (a seed's layers, depths and inits share its data "
    "order and initial draw). Holds if PR_Q - PR_K > 0 at the final probe in every "
    "trajectory (the paper's 'all 54') and each seed's mean final gap is positive by the "
    f"one-sided sign test over seeds, p < {ALPHA}; contradicted if the seeds' sign test in "
    f"the opposite direction is below {ALPHA}; otherwise not shown (with its power); not "
    "enough data with fewer than 5 seeds.")
_SLOPES_RULE = (
    "Claim 2 (slopes): the unit is the seed: each seed's mean PR_Q slope (over its trials "
    "and layers) positive and its mean PR_K slope negative, one-sided sign tests over "
    f"seeds, p < {ALPHA} each; contradicted if either half's opposite test is below "
    f"{ALPHA / 2:g}. '2-slopes' fits each (trial, layer) from step 0; '2-slopes-late' from "
    f"training progress {LATE_FROM:g}, a window fixed in advance (after warm-up and the "
    "initial collapse), same rule.")
_CORR_RULE = (
    "Claim 3: on the baseline arm after step 0, the Spearman correlations of PR_K with the "
    "interaction rank and with attention entropy, taken across trials at the same training "
    "progress (each metric interpolated at levels of the validation loss every trial of the "
    "depth reached), depth and layer (so a training-time trend, a layer profile or a "
    "trial's training speed that both share cannot make them), are each positive with a "
    f"one-sided trial-permutation p < {ALPHA}; contradicted if one is negative with p < "
    f"{ALPHA / 2:g}.")
_ARM_RULE = (
    "Claim 4: per arm, an exact sign-flip permutation test of the mean paired entropy delta "
    "in the predicted direction. The primary arm, 'shrink' (pre-registered: the paper's "
    f"headline intervention claim), holds if its p < {ALPHA}; the secondary arms (hold, "
    "shrink_act) are tested with Holm only if the primary holds (a fixed sequence: at most "
    f"{ALPHA} false holds over the family); without 'shrink' every arm is one Holm family. "
    f"An arm is contradicted if the Holm-adjusted p (over all arms) of the opposite "
    f"direction is below {ALPHA}. With too few paired seeds for the smallest p to pass, not "
    "enough data. The effect is printed with a 95% t interval; the paper's directional "
    "confidence and bootstrap interval are reported beside it.")
_CHECK_RULE = (
    "Reality check: a contracting arm did its job if, at the site it acts on, its "
    "end-of-training value is below the paired baseline's in every seed, with enough seeds "
    f"for that to be unlikely by chance (2^-n < {ALPHA}; stats.rules.all_lower_rule): W_K "
    "weight PR for 'shrink', key-activation PR_K for 'shrink_act'; contradicted if above in "
    "every seed.")
_PRETRAINED_RULE = (
    f"Claim 5: per model with >= {MIN_CHECKPOINTS} checkpoints, 'rises then decays' = "
    "Spearman of PR_Q - PR_K (mean over layers) vs step > 0 in the first half of the "
    "checkpoints and < 0 in the second, tested against series rebuilt from the model's own "
    "checkpoint-to-checkpoint changes in every order (a random walk's null); the "
    "rank-entropy link = Spearman of the interaction rank with entropy across layers "
    "within each checkpoint, pooled, tested by permuting whole layers (the same "
    "permutation at every checkpoint). Holds if at least two models show each, every model "
    "tested at 2 x alpha / models (so 'two by chance' stays below alpha however the "
    "models depend on each other).")

_SEEDS = ("the seed: every layer, depth and init of one seed shares its data order and "
          "initial draw, so only whole seeds are independent")
_PAIRED = ("the paired seed: an arm and its baseline share the seed's data order and "
           "initial draw, which cancel in the delta; seeds are independent")
_ARMS = {
    "shrink": ("Shrink arm sharpens attention (lower entropy than the baseline) with high "
               "directional confidence", "W_K weights"),
    "shrink_act": ("Shrinking the keys as attention sees them (activation site) sharpens "
                   "attention (lower entropy than the baseline)", "key activations"),
    "hold": ("Hold arm makes attention softer (higher entropy) than the unconstrained "
             "baseline", "W_K weights"),
}
_ARM_ROWS = tuple(f"4-{a}" for a in _ARMS) + ("4 (any arm)",)

REGISTRY: dict[str, ClaimSpec] = {s.key: s for s in [
    ClaimSpec("2-gap", "PR_Q - PR_K > 0 in all 54 (depth, init, layer) trajectories; "
              "one-sided sign test p = 2^-54",
              "pr_q, pr_k per layer, baseline arm, the final probe", _SEEDS, _GAP_RULE,
              "seed-sign", ("2-gap",), "final_gap"),
    *(ClaimSpec(key, "PR_Q expands and PR_K shrinks over training: slopes about +0.14 and "
                "-0.04 per unit of training progress (unit unknown)",
                f"pr_q, pr_k per layer, baseline arm, probes {window}", _SEEDS, _SLOPES_RULE,
                "seed-sign", (key,), "trajectories", halves=2)
      for key, window in (("2-slopes", "from step 0"),
                          ("2-slopes-late", f"from progress {LATE_FROM:g}"))),
    ClaimSpec("3", "Shrinking keys goes with a narrower QK^T interaction spectrum and more "
              "peaked (lower-entropy) attention",
              "pr_k, qk_erank, entropy per layer and the validation loss per probe, "
              "baseline arm, probes after step 0",
              "the trial: trials of one depth are exchangeable under the null (whole trials "
              "are permuted, whatever a trial shares over its probes and layers)",
              _CORR_RULE, "trial-permutation", ("3",), "correlation",
              power_row="trial effects rho 0.6 + speed log-sd 0.6"),
    *(ClaimSpec(f"4-{arm}", paper, f"entropy per layer, the last probes, {arm} and its "
                f"paired baseline (site: {site})", _PAIRED, _ARM_RULE, "arm-family",
                _ARM_ROWS, "intervention") for arm, (paper, site) in _ARMS.items()),
    ClaimSpec("reality-check", "'shrink' should contract its W_K weight spectrum (PR) "
              "relative to the unconstrained baseline (the paper's small run found a 0.5 x "
              "step-0 target is a weaker 'hold', not a contraction)",
              "pr_wk per layer, the last probes, shrink and its paired baseline", _PAIRED,
              _CHECK_RULE, "all-lower", ("reality-check",), "intervention"),
    ClaimSpec("reality-check-act", "'shrink_act' should contract its key activations (PR_K) "
              "relative to the unconstrained baseline (holding W_K's spectrum did not stop "
              "the collapse of the key-activation PR_K, so the weight site alone may not "
              "move the keys attention sees)",
              "pr_k per layer, the last probes, shrink_act and its paired baseline",
              _PAIRED, _CHECK_RULE, "all-lower", ("reality-check",), "intervention"),
    ClaimSpec("5", "In pretrained families (Pythia checkpoints, GPT-2, SmolLM2) the "
              "monotonic PR_Q - PR_K trend is not universal: it appears early and decays "
              "over a full pretraining run; the interaction-rank/entropy link stays visible "
              "in several",
              "pr_q, pr_k, qk_erank, entropy per layer of each pretrained checkpoint",
              "the model for 'several' (valid however models depend on each other); within "
              "a model, checkpoint increments for the trend and whole layers for the link",
              _PRETRAINED_RULE, "several-models", ("5",), None,
              power_row="tent 6 sd and link rho 0.5, 10 checkpoints"),
]}

ARM_SITES = {arm: site for arm, (_, site) in _ARMS.items()}


def spec(key: str) -> ClaimSpec:
    """The registered claim ``key``; a verdict that is not registered cannot be printed."""
    if key not in REGISTRY:
        raise KeyError(f"claim {key!r} is not in qkgeom.stats.registry.REGISTRY; register it "
                       "(its unit, test, calibration rows) before the report may print it")
    return REGISTRY[key]


def rules_text() -> list[str]:
    """Each distinct rule once, in registry order (the report's 'Verdict rules')."""
    return list(dict.fromkeys(s.rule for s in REGISTRY.values()))


# 2-gap also needs every trajectory positive: the seeds' test's power is an upper bound
_GAP_BOUND = {"2-gap": " (at most: every trajectory must also be positive)"}


@dataclass(frozen=True)
class AtDesign:
    """A rule at a study's design: ``size`` and ``power`` as sentences."""

    size: str
    power: str


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def at_design(key: str, numbers: dict[str, Any], record: dict[str, Any] | None = None
              ) -> AtDesign:
    """The size and power of ``key``'s rule at the design its verdict rests on, from the
    verdict's own ``numbers`` (the seeds, arms, trials it used): exact for the seed-level
    tests, a bound for the permutation tests with their power from the calibration row
    at the design it was measured at."""
    s = spec(key)
    if s.kind == "seed-sign":
        by = numbers.get("by_seed") or {}
        n = int((by.get("pr_q_up") or by).get("n", 0) or 0)
        d = P.sign_design(n, SEED_Q, ALPHA, s.halves)
        if not d.k:
            return AtDesign(f"cannot pass with {n} seeds", "0%")
        return AtDesign(f"{_pct(d.size)} exactly ({n} independent seeds; sign test needs "
                        f"{d.k} of {n})" + (", per half" if s.halves > 1 else ""),
                        f"{_pct(d.power)} if {d.effect}" + _GAP_BOUND.get(key, ""))
    if s.kind == "arm-family":
        fam = numbers.get("family_test") or {}
        n, m = int(fam.get("n_seeds", 0)), int(fam.get("family", 1))
        role, need = fam.get("role", "family"), int(fam.get("min_seeds", min_seeds(m)))
        if n < need:
            return AtDesign(f"cannot pass with {n} seeds (needs {need})", "0%")
        if role == "primary":
            return AtDesign(f"<= {_pct(ALPHA)} (exact sign-flip test, the primary arm, "
                            f"{n} seeds)", f"{_pct(P.family_power(n, 1, ARM_EFFECT))} at a "
                            f"paired effect of {ARM_EFFECT:g} sd ({n} seeds)")
        k = m - 1 if role == "secondary" else m
        when = " if the primary holds" if role == "secondary" else ""
        return AtDesign(f"<= {_pct(ALPHA)} (exact sign-flip test, Holm over {k} arms{when}, "
                        f"{n} seeds)", f"{_pct(P.family_power(n, k, ARM_EFFECT))} at a "
                        f"paired effect of {ARM_EFFECT:g} sd{when} ({n} seeds)")
    if s.kind == "all-lower":
        n = _check_seeds(key, numbers)
        d = P.all_lower_design(n, CHECK_EFFECT)
        if not d.k:
            return AtDesign(f"cannot pass with {n} seeds", "0%")
        return AtDesign(f"{_pct(d.size)} exactly (every one of {n} seeds lower)",
                        f"{_pct(d.power)} at {d.effect}")
    row = _power_row(s, record)
    pw = (f"{_pct(row['rate'])} at {row['effect']} (measured at the cpu preset's design, "
          f"{row['scenario']})" if row else "not measured")
    if s.kind == "trial-permutation":
        w = (numbers.get("qk_erank~pr_k") or {}).get("within") or {}
        return AtDesign(f"<= {_pct(ALPHA)} (trial permutation; {w.get('n_trials', '?')} "
                        f"trials, smallest p {w.get('min_p', 1.0):.2g})", pw)
    return AtDesign(f"<= {_pct(ALPHA)} (at least two models at 2 x alpha / models, under "
                    "any dependence between them)", pw)


def _check_seeds(key: str, numbers: dict[str, Any]) -> int:
    site = "pr_k" if key.endswith("-act") else "pr_wk"
    for v in numbers.values():
        if isinstance(v, dict) and isinstance(v.get(site), dict) and "n_seeds" in v[site]:
            return int(v[site]["n_seeds"])
    return 0


def _power_row(s: ClaimSpec, record: dict[str, Any] | None) -> dict[str, Any] | None:
    if record is None or not s.power_row:
        return None
    return next((r for r in record.get("rows", []) if r["rule"] in s.calibration
                 and r["kind"] == "power" and r["scenario"].startswith(s.power_row)), None)


def planned_power(baseline_seeds: int, arm_seeds: dict[str, int]) -> dict[str, str]:
    """What a planned study can decide, before training (``qkgeom sweep --dry-run``): per
    seed-level claim, the rule's size and power at the planned seed counts (``arm_seeds``:
    paired seeds per intervention arm). Claims 3 and 5 depend on more than a count and
    are left to the report."""
    out = {}
    for key in ("2-gap", "2-slopes", "2-slopes-late"):
        d = P.sign_design(baseline_seeds, SEED_Q, ALPHA, spec(key).halves)
        out[key] = (f"power {_pct(d.power)} if {d.effect} ({baseline_seeds} seeds)"
                    + _GAP_BOUND.get(key, "") if d.k
                    else f"cannot pass with {baseline_seeds} seeds (needs 5)")
    arms = [a for a in _ARMS if arm_seeds.get(a)]
    gated = PRIMARY_ARM in arms and len(arms) > 1
    for a in arms:
        n = arm_seeds[a]
        role = ("primary" if a == PRIMARY_ARM else "secondary") if gated else "family"
        k = 1 if role == "primary" else len(arms) - 1 if role == "secondary" else len(arms)
        if n < min_seeds(k):
            out[f"4-{a}"] = f"cannot pass with {n} seeds (needs {min_seeds(k)})"
            continue
        when = " if the primary holds" if role == "secondary" else ""
        out[f"4-{a}"] = (f"power {_pct(P.family_power(n, k, ARM_EFFECT))} at a paired "
                         f"effect of {ARM_EFFECT:g} sd{when} ({n} seeds, {role})")
        if a in ("shrink", "shrink_act"):
            d = P.all_lower_design(n, CHECK_EFFECT)
            check = "reality-check" if a == "shrink" else "reality-check-act"
            out[check] = (f"power {_pct(d.power)} at {d.effect} ({n} seeds)" if d.k
                          else f"cannot pass with {n} seeds (needs 5)")
    return out
