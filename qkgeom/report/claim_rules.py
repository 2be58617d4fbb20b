"""The report's statement of its verdict rules (:data:`RULES`, printed in every report;
per claim from :mod:`qkgeom.stats.registry`)
and its header line on how they were calibrated (:func:`calibration_header`). The rules
themselves are :mod:`qkgeom.stats.rules`; :mod:`qkgeom.report.claims` applies them."""

from __future__ import annotations

from typing import Any

from qkgeom.stats import rules as R
from qkgeom.stats.registry import rules_text

ALPHA = R.ALPHA

RULES = [
    "Every rule's rate of false 'holds' is measured under null models close to the study's "
    "data, including the structure real studies have (seed effects shared by a seed's "
    "layers, depths and inits; drifts shared by a network's layers; trial-to-trial training "
    "speed; fixed layer profiles; serially dependent checkpoints; models that are not "
    "independent) by benchmarks/calibration.py; the line above says what its record shows, "
    "and each verdict gives its rule's size and power at this study's design.",
    "Verdict words: 'holds' = the test rejects its null at 5% in the claim's direction; "
    "'contradicted' = a calibrated test rejects it in the opposite direction; 'not shown' = "
    "neither, printed with the power the study's design had at a stated effect; 'not enough "
    "data' = the design cannot reach 5% at all, or the data are missing.",
    *rules_text(),
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
