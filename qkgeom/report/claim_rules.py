"""The report's statement of its verdict rules (:data:`RULES`, printed in every report)
and its header line on how they were calibrated (:func:`calibration_header`). The rules
themselves are :mod:`qkgeom.stats.rules`; :mod:`qkgeom.report.claims` applies them."""

from __future__ import annotations

from typing import Any

from qkgeom.stats import rules as R

ALPHA = R.ALPHA

RULES = [
    "Every rule is calibrated: under null models close to the study's data, including "
    "the structure real studies have (seed effects shared by a seed's layers, depths and "
    "inits; drifts shared by a network's layers; trial-to-trial training speed; fixed layer "
    "profiles; serially dependent checkpoints; models that are not independent), its rate "
    "of false 'holds' is measured, and a rule is only used if that rate is not shown to "
    f"exceed {ALPHA:.0%} (benchmarks/calibration.py; each verdict shows its rule's measured "
    "rate and power).",
    "Claim 2 (gap): the unit is the seed (a seed's layers, depths and inits share its data "
    "order and initial draw). Holds if PR_Q - PR_K > 0 at the final probe in every "
    "trajectory (the paper's 'all 54') and each seed's mean final gap is positive by the "
    f"one-sided sign test over seeds, p < {ALPHA}; does not hold if any trajectory is <= 0 "
    "or the seeds' test fails; not enough data with fewer than 5 seeds.",
    "Claim 2 (slopes): the unit is the seed: each seed's mean PR_Q slope (over its trials "
    "and layers) positive and its mean PR_K slope negative, one-sided sign tests over "
    f"seeds, p < {ALPHA} each. '2-slopes' fits each (trial, layer) from step 0; "
    f"'2-slopes-late' from training progress {R.LATE_FROM:g}, a window fixed in advance "
    "(after warm-up and the initial collapse), same rule.",
    "Claim 3: on the baseline arm after step 0, the Spearman correlations of PR_K with the "
    "interaction rank and with attention entropy, taken across trials at the same training "
    "progress (each metric interpolated at levels of the validation loss every trial of the "
    "depth reached), depth and layer (so a training-time trend, a layer profile or a "
    "trial's training speed that both share cannot make them), are each positive with a one-sided trial-permutation p < {ALPHA}.",
    "Claim 4: per arm, an exact sign-flip permutation test of the mean paired entropy delta "
    "in the predicted direction; the arms that share a baseline are one family (Holm), and "
    f"an arm holds if its adjusted p < {ALPHA}. With fewer paired seeds than the family "
    "needs (2^-n < alpha / arms), not enough data. The paper's directional confidence is "
    "reported beside it.",
    "Reality check: a contracting arm did its job if, at the site it acts on, its "
    "end-of-training value is below the paired baseline's in every seed, with enough seeds "
    f"for that to be unlikely by chance (2^-n < {ALPHA}; stats.rules.all_lower_rule): W_K "
    "weight PR for 'shrink', key-activation PR_K for 'shrink_act'.",
    f"Claim 5: per model with >= {R.MIN_CHECKPOINTS} checkpoints, 'rises then decays' = "
    "Spearman of PR_Q - PR_K (mean over layers) vs step > 0 in the first half of the "
    "checkpoints and < 0 in the second, tested against series rebuilt from the model's own "
    "checkpoint-to-checkpoint changes in every order (a random walk's null); the "
    "rank-entropy link = Spearman of the interaction rank with entropy across layers "
    "within each checkpoint, pooled, tested by permuting whole layers (the same "
    "permutation at every checkpoint). Holds if at least two models show each, every model "
    "tested at 2 x alpha / models (so 'two by chance' stays below alpha however the "
    "models depend on each other).",
]


def calibration_header(record: dict[str, Any] | None) -> str:
    """The report's line on how the rules were calibrated."""
    if record is None:
        return ("The rules' error rates were not recorded in this installation "
                "(run `python benchmarks/calibration.py`).")
    nulls = [r for r in record.get("rows", [])
             if r.get("kind") == "null" and "retired" not in r.get("rule", "")]
    over = [r for r in nulls if r["ci_low"] > ALPHA or r["ci_high"] > 0.07]
    top = max(nulls, key=lambda r: r["rate"], default=None)
    if over:
        verdict = ("rules over the limits (a 95% Monte Carlo interval wholly above "
                   f"{ALPHA:.0%}, or reaching past 7%): "
                   + ", ".join(f"{r['rule']} ({r['scenario']}, {r['rate']:.1%})" for r in over))
    else:
        verdict = (f"no rule's false-holds rate is shown to exceed {ALPHA:.0%} under its "
                   "nulls" + (f" (the largest estimate: {top['rule']}, {top['scenario']}, "
                              f"{top['rate']:.1%} [{top['ci_low']:.1%}, {top['ci_high']:.1%}])"
                              if top else ""))
    return (f"The rules behind these verdicts were calibrated on simulated null and "
            "planted-effect studies by "
            f"benchmarks/calibration.py at commit {record['commit'][:12]}"
            f"{' (uncommitted changes)' if record.get('dirty') else ''} ({record['date']}, "
            f"{record['reps']} studies per claim-4 scenario): {verdict}; each verdict shows "
            "its rule's rate.")
