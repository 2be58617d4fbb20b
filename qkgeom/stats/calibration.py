"""Calibration of the verdict rules (:mod:`qkgeom.stats.rules`): how often each says
"holds" under null models close to the study's data, and how often under planted effects
of stated sizes. ``benchmarks/calibration.py`` runs :func:`calibrate` and records the
table (docs/statistics.md, "Calibration"); tests pin the null rates with fixed seeds.

The null models (each the study's shape: the cpu preset's 16 probes, 27 trajectories of
(depth, init, layer) averaged over 2 seeds, 5 paired seeds per arm, three pretrained
models):

* ``collapse-flat``: each seed's PR_Q and PR_K fall from 17 to a floor (uniform 2-5) with
  time constant 0.03 of training, then stay flat with AR(1) noise (phi 0.6, sd 0.4);
  PR_Q and PR_K are equal in distribution and independent.
* ``collapse-shared-drift``: the same plus a slow drift per trajectory (slope N(0, 1) per
  unit of progress) shared by PR_Q and PR_K.
* ``trials-shared-trend`` (claim 3): PR_K and the two other metrics of each trial follow
  one training-time trend (falling early) and a layer profile each, with trial effects
  independent between the metrics; each trial also has a validation loss falling on its
  own time course (:func:`qkgeom.stats.hard_nulls.claim3_groups`).
* ``paired-null`` (claim 4, reality checks): per seed, baseline and each arm N(0, 1)
  (three arms share the baseline, so their deltas correlate 0.5).
* ``iid-checkpoints`` (claim 5): i.i.d. N(0, 1) values at 5-30 checkpoints; the link's
  null has metrics independent within checkpoint but with checkpoint and layer effects.

Planted effects are stated beside each power row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from qkgeom.stats import rules as R
from qkgeom.stats.effects import directional_confidence
from qkgeom.stats.hard_nulls import claim3_groups, claim3_verdict, hard_rows
from qkgeom.stats.rank_correlation import spearman_ci
from qkgeom.stats.registry import PRIMARY_ARM, REGISTRY

PROGRESS = np.arange(16) / 15  # the cpu preset: 1,500 steps, a probe every 100
UNITS = 27  # (depth, init, layer) trajectories of the cpu grid: (2 + 3 + 4) x 3 inits
GRID_SEEDS = 2
ARM_SEEDS = 5
ARMS = ("shrink", "hold", "shrink_act")
SIGNS = {"shrink": -1, "hold": 1, "shrink_act": -1}


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score 95% interval of a binomial proportion (the Monte Carlo interval)."""
    if n == 0:
        return math.nan, math.nan
    p = k / n
    c = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    m = (p + z * z / (2 * n)) / (1 + z * z / n)
    return max(0.0, m - c), min(1.0, m + c)


# --------------------------------------------------------------------------- claim 3

def claim3_retired(rng: np.random.Generator) -> str:
    """The retired rule: one pooled Spearman over every probe including step 0 (both
    metrics at their maximum), CI from a cluster bootstrap over trials, both CIs > 0."""
    xs, ys, zs, _ = (g if k == 3 else [a.reshape(a.shape[0], -1) for a in g]
                     for k, g in enumerate(claim3_groups(rng)))
    oks = []
    for other in (ys, zs):
        x, y, c = [], [], []
        for g, (a, b) in enumerate(zip(xs, other)):
            n = a.shape[0]
            a0 = np.concatenate([np.full((n, 1), 10.0), a], axis=1)  # step 0: at the top
            b0 = np.concatenate([np.full((n, 1), 10.0), b], axis=1)
            x.append(a0.ravel())
            y.append(b0.ravel())
            c.append(np.repeat(np.arange(n) + 100 * g, a0.shape[1]))
        r = spearman_ci(np.concatenate(x), np.concatenate(y), clusters=np.concatenate(c),
                        n_boot=200, rng=rng)
        oks.append(r.ci_low is not None and r.ci_low > 0)
    return R.HOLDS if all(oks) else R.NOT_SHOWN


# --------------------------------------------------------------------------- claim 4


def arm_deltas(rng: np.random.Generator, n: int, effect: dict[str, float] | None = None
               ) -> dict[str, np.ndarray]:
    """Per-seed arm - baseline deltas of the three arms sharing one baseline; ``effect``
    adds (arm: size in units of the delta's sd, in the predicted direction)."""
    base = rng.normal(0, 1, n)
    out = {}
    for a in ARMS:
        d = (rng.normal(0, 1, n) - base) / math.sqrt(2)  # unit sd
        out[a] = d + SIGNS[a] * (effect or {}).get(a, 0.0)
    return out


def claim4_verdicts(d: dict[str, np.ndarray]) -> dict[str, str]:
    fam = R.arm_family_rule(d, SIGNS, primary=PRIMARY_ARM)
    return {a: fam[a]["verdict"] for a in ARMS}


def claim4_retired(rng: np.random.Generator, d: dict[str, np.ndarray]) -> dict[str, str]:
    """The retired rule: directional confidence >= 0.95 per arm, no family."""
    return {a: R.HOLDS if directional_confidence(
        d[a], predicted_sign=SIGNS[a], rng=rng).directional_confidence >= 0.95 else R.NOT_SHOWN
        for a in ARMS}


# --------------------------------------------------------------------------- the table


def _rate(name: str, scenario: str, kind: str, effect: str, reps: int,
          draw: Callable[[np.random.Generator], bool], rng: np.random.Generator
          ) -> dict[str, Any]:
    k = sum(bool(draw(rng)) for _ in range(reps))
    lo, hi = wilson(k, reps)
    return {"rule": name, "scenario": scenario, "kind": kind, "effect": effect, "reps": reps,
            "holds": k, "rate": k / reps, "ci_low": lo, "ci_high": hi}


def calibrate(reps: int = 2000, *, seed: int = 0, retired: bool = True,
              say: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Every rule under its nulls and at its planted effects: one row per (rule, scenario)
    with the share of simulated studies where it says "holds" and a Wilson 95% interval.
    ``reps`` sets the claim-2/4 repetitions; permutation-based rules run reps / 2."""
    rng = np.random.default_rng(seed)
    rows: list[dict[str, Any]] = []
    draws: list[Callable[[np.random.Generator], bool]] = []
    say = say or (lambda s: None)
    slow = max(reps // 2, 50)

    def add(*a: Any) -> None:
        rows.append(_rate(*a, rng))
        draws.append(a[-1])
        r = rows[-1]
        say(f"{r['rule']:<28} {r['scenario']:<34} {r['rate']:.3f} "
            f"[{r['ci_low']:.3f}, {r['ci_high']:.3f}]")

    add("3", "trials-shared-trend", "null", "-", reps,
        lambda g: claim3_verdict(g) == R.HOLDS)
    add("3", "trials-shared-trend, only the rank linked (rho 0.9)", "null", "-", reps,
        lambda g: claim3_verdict(g, 0.9, 0.0) == R.HOLDS)
    add("3", "trials-shared-trend + trial effects rho 0.6", "power", "rho 0.6", slow,
        lambda g: claim3_verdict(g, 0.6) == R.HOLDS)
    if retired:
        add("3 (retired)", "trials-shared-trend", "null", "-", max(reps // 20, 20),
            claim3_retired)
    for n in (ARM_SEEDS, 6, 8, 10, 12):
        for a in ARMS:
            add(f"4-{a}", f"paired-null, {n} seeds", "null", "-", reps,
                lambda g, a=a, n=n: claim4_verdicts(arm_deltas(g, n))[a] == R.HOLDS)
        add("4 (any arm)", f"paired-null, {n} seeds", "null", "-", reps,
            lambda g, n=n: R.HOLDS in claim4_verdicts(arm_deltas(g, n)).values())
        for eff in (0.5, 1.0, 2.0):
            add("4-shrink", f"paired, {n} seeds, shrink effect {eff} sd", "power",
                f"{eff} sd", reps, lambda g, n=n, eff=eff: claim4_verdicts(
                    arm_deltas(g, n, {"shrink": eff}))["shrink"] == R.HOLDS)
        # a secondary arm: its power when the primary has the same effect, and its false
        # holds when it has an effect but the primary does not (the gate stays closed)
        add("4-hold", f"paired, {n} seeds, hold and shrink effects 1.0 sd", "power",
            "1.0 sd", reps, lambda g, n=n: claim4_verdicts(arm_deltas(
                g, n, {"shrink": 1.0, "hold": 1.0}))["hold"] == R.HOLDS)
        add("4-shrink_act", f"paired, {n} seeds, only hold effect 2.0 sd", "null", "-", reps,
            lambda g, n=n: claim4_verdicts(arm_deltas(g, n, {"hold": 2.0}))["shrink_act"]
            == R.HOLDS)
    if retired:
        add("4-shrink (retired DC>=0.95)", f"paired-null, {ARM_SEEDS} seeds", "null", "-",
            max(reps // 2, 50), lambda g: claim4_retired(g, arm_deltas(g, ARM_SEEDS))[
                "shrink"] == R.HOLDS)
    for n in (ARM_SEEDS, 6, 8, 10):
        add("reality-check", f"paired-null, {n} seeds", "null", "-", reps,
            lambda g, n=n: R.all_lower_rule(g.normal(0, 1, n)) == R.HOLDS)
        add("reality-check", f"paired, {n} seeds, effect 2 sd", "power", "2 sd", reps,
            lambda g, n=n: R.all_lower_rule(g.normal(-2, 1, n)) == R.HOLDS)
    hard_rows(add, reps, retired)
    contradiction_rows(add, reps)
    coverage_rows(add, reps)
    extend_near_limit(rows, draws, rng, say, EXTEND * reps)
    return rows


EXTEND = 3  # a null row near the limit gets this many times reps more studies


def extend_near_limit(rows: list[dict[str, Any]], draws: list[Callable[..., bool]],
                      rng: np.random.Generator, say: Callable[[str], None], extra: int
                      ) -> None:
    """An exact-size test (its false-holds rate 5% by construction, or just under) has an
    estimate above 5%, or an upper Monte Carlo bound above 7% at 1,000 studies, about half
    the time by noise alone. Every current null row whose estimate is above 5% or whose
    bound passes 7% is measured again with ``extra`` more studies, pooled with the first
    (``extended`` in the row says how many were added), so a row is flagged only when the
    larger sample still puts it over the limit."""
    for r, draw in zip(rows, draws):
        if r["kind"] != "null" or "retired" in r["rule"]:
            continue
        if r["rate"] <= ALPHA_LIMIT and r["ci_high"] <= 0.07:
            continue
        k = r["holds"] + sum(bool(draw(rng)) for _ in range(extra))
        n = r["reps"] + extra
        lo, hi = wilson(k, n)
        r.update(holds=k, reps=n, rate=k / n, ci_low=lo, ci_high=hi, extended=extra)
        say(f"extended: {r['rule']:<28} {r['scenario']:<34} {r['rate']:.3f} "
            f"[{lo:.3f}, {hi:.3f}] over {n}")


ALPHA_LIMIT = R.ALPHA


def contradiction_rows(add: Callable[..., None], reps: int) -> None:
    """How often each rule says "contradicted" when there is no effect either way (the
    nulls symmetric about 0): at most alpha, like its "holds"."""
    from qkgeom.stats import hard_nulls as H

    slow = max(reps // 2, 50)
    for scen, kw in (("collapse-flat", {}), ("seed offset sd 2 (the seed dominates)",
                                             {"seed_offset": 2.0}),
                     ("network drift sd 1, no slope", {"net_drift": 1.0})):
        for rule in ("2-gap", "2-slopes", "2-slopes-late"):
            add(f"{rule} (contradicted)", scen, "null", "-", reps, lambda g, kw=kw, rule=rule:
                H.claim2_verdicts(*H.runs(g, **kw))[rule] == R.CONTRADICTED)
    for scen, kw in (("training speed log-sd 0.6, no link", {"speed": 0.6}),
                     ("seed effects sd 1 per metric", {"seed_sd": 1.0})):
        add("3 (contradicted)", scen, "null", "-", slow,
            lambda g, kw=kw: H.claim3_verdict(g, **kw) == R.CONTRADICTED)
    for n in (6, 12):
        add("4 (any arm contradicted)", f"paired-null, {n} seeds", "null", "-", reps,
            lambda g, n=n: R.CONTRADICTED in claim4_verdicts(arm_deltas(g, n)).values())
        add("reality-check (contradicted)", f"paired-null, {n} seeds", "null", "-", reps,
            lambda g, n=n: R.all_lower_rule(g.normal(0, 1, n)) == R.CONTRADICTED)


def coverage_rows(add: Callable[..., None], reps: int) -> None:
    """The share of simulated studies whose printed 95% interval of claim 4's mean paired
    delta covers the true mean (kind ``coverage``): the t interval the report prints, and
    the BCa it printed before (retired), under normal and skewed (speed-driven) deltas."""
    from qkgeom.stats.effects import bca_interval, bootstrap_means, t_interval

    dists = {"normal": lambda g, n: g.normal(0, 1, n),
             # a trial's end value as exp(0.6 z) of its speed: log-normal, mean exp(0.18)
             "skewed (log-normal)": lambda g, n: np.exp(0.6 * g.normal(size=n)) - math.exp(0.18),
             "heavy-tailed (t, 3 df)": lambda g, n: g.standard_t(3, n)}
    for n in (5, 6, 8, 12):
        for dist, draw in dists.items():
            add("4 interval (t)", f"{dist} deltas, {n} seeds", "coverage", "mean 0", reps,
                lambda g, n=n, draw=draw: _covers(t_interval(draw(g, n))))
            add("4 interval (retired: BCa)", f"{dist} deltas, {n} seeds", "coverage",
                "mean 0", max(reps // 4, 50), lambda g, n=n, draw=draw: _covers(
                    _bca(draw(g, n), g, bca_interval, bootstrap_means)))


def _covers(ci: tuple[float, ...]) -> bool:
    return bool(ci[0] <= 0.0 <= ci[1])


def _bca(d: np.ndarray, g: np.random.Generator, bca: Any, boot: Any) -> tuple[float, float]:
    lo, hi, _, _ = bca(d, boot(d, 2000, g))
    return lo, hi


# --------------------------------------------------------------------------- the record

RECORD = "calibration.json"  # beside this module, written by benchmarks/calibration.py
# claim key -> the rule names of its rows, from the registry of claims
CLAIM_RULES = {k: list(s.calibration) for k, s in REGISTRY.items()}


def load_record() -> dict[str, Any] | None:
    """The recorded calibration (None when it was never run in this checkout)."""
    import json
    from pathlib import Path

    path = Path(__file__).with_name(RECORD)
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _seeds_in(scenario: str) -> int | None:
    """The seed count a row's scenario names (", 8 seeds" or "... 8 seeds"), if any."""
    import re

    m = re.search(r"(\d+) seeds", scenario)
    return int(m.group(1)) if m else None


def rule_error(key: str, record: dict[str, Any] | None, *, n_seeds: int | None = None
               ) -> str:
    """One line for a claim: its rule's largest false-holds rate over the recorded nulls
    (with the Monte Carlo upper bound) and its power at the planted effects. For seed-based
    rules, the rows at the claim's seed count, or, when that count was not calibrated, at
    the nearest calibrated counts either side (named); claim 4's power rows are the arm's
    own role's (the primary's rows for shrink, a secondary's for hold and shrink_act)."""
    if record is None or key not in CLAIM_RULES:
        return "not calibrated (run benchmarks/calibration.py)"
    rows = [r for r in record["rows"] if r["rule"] in CLAIM_RULES[key]]
    seeded = key.startswith("4-") or key.startswith("reality")
    where = ""
    if seeded:
        counts = sorted({c for r in rows if (c := _seeds_in(r["scenario"])) is not None})
        near = [c for c in counts if c == n_seeds] or [
            c for c in ([max((c for c in counts if c < (n_seeds or 0)), default=None),
                         min((c for c in counts if c > (n_seeds or 0)), default=None)])
            if c is not None]
        if not near:
            return f"not calibrated at {n_seeds} seeds (run benchmarks/calibration.py)"
        if near != [n_seeds]:
            where = (f" (at {' and '.join(map(str, near))} seeds, the nearest calibrated to "
                     f"{n_seeds})")
        here = [r for r in rows if _seeds_in(r["scenario"]) in near]
    else:
        here = rows
    own = ("4-shrink" if key == f"4-{PRIMARY_ARM}" else "4-hold") if key.startswith("4-") \
        else None
    nulls = [r for r in here if r["kind"] == "null"]
    power = [r for r in here if r["kind"] == "power" and own in (None, r["rule"])]
    if not nulls:
        return "not calibrated"
    worst = max(nulls, key=lambda r: r["rate"])
    text = (f"false holds <= {_pct(worst['rate'])} (95% MC bound {_pct(worst['ci_high'])}) "
            f"under {len(nulls)} null(s){where}")
    if power:
        text += "; power " + ", ".join(
            f"{_pct(r['rate'])} at {r['effect']}"
            + (f" ({_seeds_in(r['scenario'])} seeds)" if where else "") for r in power)
    if own:
        need = sorted(c for r in rows if r["rule"] == own and r["kind"] == "power"
                      and r["effect"] == "1.0 sd" and r["rate"] >= 0.8
                      and (c := _seeds_in(r["scenario"])) is not None)
        text += ("; >= 80% power at 1 sd needs " + (f"{need[0]} seeds" if need else
                 "more seeds than calibrated"))
    return text
