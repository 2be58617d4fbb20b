"""The report's verdict matrix: for every claim, planted databases that must give "holds",
"does not hold" and "not enough data", with the rules' boundaries (RULES in
qkgeom/report.py).

Each row of CASES names a planted study (:func:`study`) and the verdicts it must produce
for the claims it is about (other claims are not checked for that row). To cover a new
rule, add rows. The expected verdicts are worked out by hand from the planted numbers; the
comments give the arithmetic (exact binomial tails, exact bootstrap probabilities).
"""

from __future__ import annotations

import itertools
import json
from math import factorial
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from stats_fixtures import write_trials

HOLDS, FAILS, NO_DATA = "holds", "does not hold", "not enough data"
STEPS, MAX_STEPS = [0, 5, 10], 10


def study(url: str, *, layers: list[tuple[float, float, float]], seeds=(0,),
          ent_coef: float = 1.0, arms: dict[str, list[float]] | None = None,
          key: dict[str, list[float]] | None = None, drop: tuple[str, ...] = (),
          pretrained: dict[str, list[tuple[int, float]]] | None = None,
          wk: dict[str, list[float]] | None = None,
          path: list[tuple[float, float]] | None = None, steps: list[int] = STEPS) -> None:
    """A planted sweep "s".

    Baseline (arm none): one trial per seed, depth ``len(layers)``, init gaussian. Layer l,
    with ``(q_slope, k_slope, gap) = layers[l]``, at progress p: PR_Q = 20 + l + q_slope p,
    PR_K = PR_Q(1) - gap + k_slope (p - 1), so the final gap is ``gap`` and the slopes are
    the given ones. qk_erank = 0.5 PR_K + 1, logit_erank = 0.3 PR_K + 2, entropy =
    2 + ent_coef PR_K / 100 (+ the arm's delta), pr_wk = 60 - 50 p.
    Arms: ``arms[arm][i]`` is seed i's entropy delta (arm - baseline, constant), and
    ``key[arm][i]`` scales that seed's pr_wk and PR_K by 1 + key; ``wk[arm][i]``, if
    given, scales pr_wk instead (so the two key measures can disagree).
    ``path``: (PR_Q, PR_K) at each of ``steps``, the same in every layer, instead of the
    linear trajectories (for the collapse window).
    ``drop``: metrics not written. ``pretrained``: model -> [(step, PR_Q - PR_K)].
    """
    from qkgeom.store import open_store

    arms = arms or {}
    key = {"shrink": [-0.3] * len(seeds), "hold": [0.3] * len(seeds),
           "shrink_act": [-0.3] * len(seeds), **(key or {})}
    wk = {**key, **(wk or {})}

    def values(arm: str, i: int, seed: int):
        d = arms[arm][i] if arm != "none" else 0.0
        kd = key[arm][i] if arm != "none" else 0.0
        wd = wk[arm][i] if arm != "none" else 0.0

        def f(step: int, layer: int) -> dict[str, float]:
            p = step / MAX_STEPS
            qs, ks, gap = layers[layer]
            pr_q = 20 + layer + qs * p
            pr_k0 = 20 + layer + qs - gap + ks * (p - 1)  # the baseline's
            if path is not None:
                pr_q, pr_k0 = path[steps.index(step)]
            pr_k = pr_k0 * (1 + kd)
            v = {"pr_q": pr_q, "pr_k": pr_k, "qk_erank": 0.5 * pr_k + 1,
                 "logit_erank": 0.3 * pr_k + 2, "entropy": 2 + ent_coef * pr_k0 / 100 + d,
                 "pr_wk": (60 - 50 * p) * (1 + wd)}
            return {m: x for m, x in v.items() if m not in drop}
        return f

    trials: list[dict[str, Any]] = []
    for arm in ["none", *arms]:
        trials += [dict(depth=len(layers), init="gaussian", arm=arm, seed=s,
                        values=values(arm, i, s)) for i, s in enumerate(seeds)]
    write_trials(url, "s", trials, steps=steps, max_steps=MAX_STEPS)
    with open_store(url) as store:
        for model, points in (pretrained or {}).items():
            for step, gap in points:
                store.write_pretrained(model, f"step{step}", step, {}, [
                    (0, None, "pr_k", 10.0), (0, None, "pr_q", 10.0 + gap)])


def exact_directional(deltas: list[float], sign: int) -> float:
    """P(sign of the bootstrap mean == sign), over all n**n equally likely resamples."""
    n, hit = len(deltas), 0
    for counts in itertools.product(range(n + 1), repeat=n):
        if sum(counts) != n:
            continue
        w = factorial(n)
        for c in counts:
            w //= factorial(c)
        hit += w * (np.sign(sum(c * x for c, x in zip(counts, deltas))) == sign)
    return hit / n**n


GOOD = (0.14, -0.04, 1.0)  # PR_Q up, PR_K down, PR_Q > PR_K at the end
FIVE = [0, 1, 2, 3, 4]
# directional confidence of these shrink deltas, exactly: 0.94528 (below 0.95) and
# 0.95488 (above); the bootstrap's 10,000 means estimate it to about +-0.002
JUST_BELOW, JUST_ABOVE = [-2, -1, -1, -1, 1], [-2, -2, -1, -1, 1]
RISE_DECAY_5 = [(0, 0.0), (10, 1.0), (20, 2.0), (30, 1.5), (40, 1.0)]  # peak in the middle
# Collapse-window trajectories: (PR_Q, PR_K) at progress 0, 0.2, 0.5, 0.8, 1. The collapse
# point is the probe with the lowest PR_Q + PR_K at progress <= 0.5.
PSTEPS = [0, 2, 5, 8, 10]
# totals 60, 19, 19.5, 20, 20.5: collapse at 0.2. From step 0 the PR_Q slope is negative
# (least squares: sum (p - 0.5)(y - 15.2) = -7.9); from 0.2 on PR_Q rises 10 -> 13 and
# PR_K falls 9 -> 7.5, both linearly
DIP_THEN_RISE = [(30, 30), (10, 9), (11, 8.5), (12, 8), (13, 7.5)]
# totals 60, 40, 19, 22, 25: collapse exactly at the search limit 0.5, after which PR_Q
# rises 10 -> 18 and PR_K falls 9 -> 7; from 0.2 the PR_Q slope would be negative
# (sum (p - 0.625)(y - 15.5) = -0.55), from step 0 too (-7.8)
COLLAPSE_AT_HALF = [(30, 30), (20, 20), (10, 9), (14, 8), (18, 7)]
# totals 60, 19, 17, 9, 9.5: the lowest total is at 0.8, outside the search, so the
# collapse is at 0.5, from where PR_Q falls (9, 5, 6: sum (p - 0.767)(y - 6.667) = -0.83);
# from 0.8 (search ignored) PR_Q would rise 5 -> 6 and PR_K fall 4 -> 3.5
LATE_MINIMUM = [(30, 30), (10, 9), (9, 8), (5, 4), (6, 3.5)]

CASES = [
    # ---- claim 2 (gap): all trajectories positive at the final probe and p = 2^-n < 0.05
    ("gap-5-of-5", dict(layers=[GOOD] * 5), {"2-gap": HOLDS}),  # p = 1/32
    ("gap-4-of-4", dict(layers=[GOOD] * 4), {"2-gap": NO_DATA}),  # p = 1/16: too few
    ("gap-one-negative-among-15",
     dict(layers=[GOOD] * 14 + [(0.14, -0.04, -0.5)]), {"2-gap": FAILS}),
    ("gap-one-exact-zero", dict(layers=[GOOD] * 5 + [(0.14, -0.04, 0.0)]), {"2-gap": FAILS}),
    ("gap-no-pr-values", dict(layers=[GOOD] * 5, drop=("pr_q", "pr_k")),
     {"2-gap": NO_DATA, "2-slopes": NO_DATA, "2-slopes-collapse": NO_DATA}),
    # ---- claim 2 (slopes): sign tests on PR_Q up and PR_K down, each p < 0.05
    ("slopes-5-of-5", dict(layers=[GOOD] * 5), {"2-slopes": HOLDS}),
    ("slopes-4-of-4", dict(layers=[GOOD] * 4), {"2-slopes": NO_DATA}),  # n < 5, p = 1/16
    # 7 of 8 PR_Q slopes up: p = 9/256 = 0.035 (just below 0.05)
    ("slopes-7-of-8", dict(layers=[GOOD] * 7 + [(-0.1, -0.04, 1.0)]), {"2-slopes": HOLDS}),
    # 6 of 7 up: p = 8/128 = 0.0625 (just above)
    ("slopes-6-of-7", dict(layers=[GOOD] * 6 + [(-0.1, -0.04, 1.0)]), {"2-slopes": FAILS}),
    ("slopes-pr-k-expands", dict(layers=[(0.14, 0.04, 1.0)] * 5), {"2-slopes": FAILS}),
    # ---- claim 2 (slopes from the collapse): same rule, each trajectory fitted from its
    # collapse point; the linear GOOD trajectories collapse at step 0 (PR_Q + PR_K rises)
    ("collapse-good-from-step-0", dict(layers=[GOOD] * 5),
     {"2-slopes": HOLDS, "2-slopes-collapse": HOLDS}),
    ("collapse-dip-then-rise", dict(layers=[GOOD] * 5, path=DIP_THEN_RISE, steps=PSTEPS),
     {"2-slopes": FAILS, "2-slopes-collapse": HOLDS}),  # 5 of 5 up: p = 1/32
    ("collapse-dip-then-rise-4", dict(layers=[GOOD] * 4, path=DIP_THEN_RISE, steps=PSTEPS),
     {"2-slopes-collapse": NO_DATA}),  # 4 of 4 up: p = 1/16 and n < 5
    ("collapse-at-search-limit", dict(layers=[GOOD] * 5, path=COLLAPSE_AT_HALF,
                                      steps=PSTEPS),
     {"2-slopes": FAILS, "2-slopes-collapse": HOLDS}),
    ("collapse-late-minimum-ignored", dict(layers=[GOOD] * 5, path=LATE_MINIMUM,
                                           steps=PSTEPS),
     {"2-slopes": FAILS, "2-slopes-collapse": FAILS}),  # 0 of 5 up: p = 1
    # ---- claim 3: Spearman CIs of PR_K with qk_erank and with entropy both above 0
    ("corr-3-trials", dict(layers=[GOOD] * 2, seeds=(0, 1, 2)), {"3": HOLDS}),
    ("corr-2-trials", dict(layers=[GOOD] * 2, seeds=(0, 1)), {"3": NO_DATA}),
    ("corr-entropy-falls-with-pr-k", dict(layers=[GOOD] * 2, seeds=(0, 1, 2, 3),
                                          ent_coef=-1.0), {"3": FAILS}),
    ("corr-no-interaction-rank", dict(layers=[GOOD] * 2, seeds=(0, 1, 2),
                                      drop=("qk_erank",)), {"3": NO_DATA}),
    # ---- claim 4: directional confidence >= 0.95 with >= 5 paired seeds
    ("dir-clear", dict(layers=[GOOD], seeds=FIVE, arms={"shrink": [-0.3, -0.2, -0.4, -0.3, -0.1],
                                                      "hold": [0.3, 0.2, 0.1, 0.4, 0.2]}),
     {"4-shrink": HOLDS, "4-hold": HOLDS, "reality-check": HOLDS}),
    ("dir-4-seeds", dict(layers=[GOOD], seeds=FIVE[:4], arms={"shrink": [-0.3] * 4,
                                                            "hold": [0.3] * 4}),
     {"4-shrink": NO_DATA, "4-hold": NO_DATA}),
    ("dir-just-below-0.95", dict(layers=[GOOD], seeds=FIVE, arms={"shrink": JUST_BELOW}),
     {"4-shrink": FAILS, "4-hold": NO_DATA}),
    ("dir-just-above-0.95", dict(layers=[GOOD], seeds=FIVE, arms={"shrink": JUST_ABOVE}),
     {"4-shrink": HOLDS}),
    ("dir-wrong-sign", dict(layers=[GOOD], seeds=FIVE, arms={"shrink": [0.2] * 5,
                                                           "hold": [-0.2] * 5}),
     {"4-shrink": FAILS, "4-hold": FAILS}),
    # ---- reality check: shrink's W_K PR and PR_K below the baseline in every seed
    ("keys-one-seed-not-lower",
     dict(layers=[GOOD], seeds=FIVE, arms={"shrink": [-0.3] * 5},
          key={"shrink": [-0.3, -0.3, -0.3, -0.3, 0.05]}),
     {"reality-check": FAILS, "4-shrink": HOLDS}),
    ("keys-no-arms", dict(layers=[GOOD] * 5), {"reality-check": NO_DATA, "4-shrink": NO_DATA}),
    ("keys-no-pr-wk", dict(layers=[GOOD], seeds=FIVE, arms={"shrink": [-0.3] * 5},
                           drop=("pr_wk",)), {"reality-check": NO_DATA}),
    # ---- claim 4, activation site (shrink_act): the same rule as 4-shrink; its reality
    # check judges the key-activation PR_K (below the paired baseline in every seed), not
    # W_K PR, which these rows move the other way (wk) where the two must disagree
    ("act-clear", dict(layers=[GOOD], seeds=FIVE,
                       arms={"shrink_act": [-0.3, -0.2, -0.4, -0.3, -0.1]},
                       wk={"shrink_act": [0.1] * 5}),
     {"4-shrink_act": HOLDS, "reality-check-act": HOLDS}),
    ("act-4-seeds", dict(layers=[GOOD], seeds=FIVE[:4], arms={"shrink_act": [-0.3] * 4}),
     {"4-shrink_act": NO_DATA}),
    ("act-just-below-0.95", dict(layers=[GOOD], seeds=FIVE, arms={"shrink_act": JUST_BELOW}),
     {"4-shrink_act": FAILS}),
    ("act-just-above-0.95", dict(layers=[GOOD], seeds=FIVE, arms={"shrink_act": JUST_ABOVE}),
     {"4-shrink_act": HOLDS}),
    # each arm is judged on its own trials: shrink sharpens, shrink_act softens
    ("act-wrong-sign-beside-shrink", dict(layers=[GOOD], seeds=FIVE,
                                          arms={"shrink": [-0.3] * 5,
                                                "shrink_act": [0.2] * 5}),
     {"4-shrink": HOLDS, "4-shrink_act": FAILS, "reality-check-act": HOLDS}),
    # PR_K lower in 4 of 5 seeds (seed 4 up 5%) while W_K PR is lower in all 5
    ("act-keys-one-seed-not-lower",
     dict(layers=[GOOD], seeds=FIVE, arms={"shrink_act": [-0.3] * 5},
          key={"shrink_act": [-0.3, -0.3, -0.3, -0.3, 0.05]}, wk={"shrink_act": [-0.3] * 5}),
     {"reality-check-act": FAILS, "4-shrink_act": HOLDS}),
    ("act-keys-no-pr-k", dict(layers=[GOOD], seeds=FIVE, arms={"shrink_act": [-0.3] * 5},
                              drop=("pr_k",)), {"reality-check-act": NO_DATA}),
    # ---- claim 5: a model with >= 5 checkpoints rises then decays
    ("pre-5-rise-decay", dict(layers=[GOOD], pretrained={"m/a": RISE_DECAY_5}), {"5": HOLDS}),
    ("pre-4-checkpoints", dict(layers=[GOOD], pretrained={"m/a": RISE_DECAY_5[:4]}),
     {"5": NO_DATA}),
    ("pre-monotonic", dict(layers=[GOOD], pretrained={
        "m/a": [(s, s / 10) for s in range(0, 60, 10)]}), {"5": FAILS}),
    # only the 5-checkpoint model counts: the 4-checkpoint one peaks inside but is too short
    ("pre-short-model-ignored", dict(layers=[GOOD], pretrained={
        "m/a": [(0, 0.0), (10, 2.0), (20, 1.0), (30, 0.5)],
        "m/b": [(s, s / 10) for s in range(0, 50, 10)]}), {"5": FAILS}),
    ("pre-none", dict(layers=[GOOD]), {"5": NO_DATA}),
]


def report_json(url: str, out) -> dict:
    from qkgeom.cli import main

    r = CliRunner().invoke(main, ["report", "--db", url, "--out", str(out)],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return json.loads((out / "report.json").read_text())


@pytest.mark.parametrize("case, planted, expected", CASES, ids=[c[0] for c in CASES])
def test_verdict_matrix(case, planted, expected, tmp_path):
    url = "sqlite:///" + str(tmp_path / "v.db")
    study(url, **planted)
    rep = report_json(url, tmp_path / "rep")
    claims = {c["key"]: c for c in rep["claims"]}
    got = {k: claims[k]["verdict"] for k in expected}
    assert got == expected, {k: claims[k]["measured"] for k in expected}
    # the directional cases: the bootstrap's confidence is the exact resampling probability
    for arm in ("shrink", "shrink_act"):
        k = f"4-{arm}"
        if case[:4] in ("dir-", "act-") and expected.get(k, NO_DATA) != NO_DATA:
            deltas = planted["arms"][arm]
            dc = claims[k]["numbers"]["directional_confidence"]
            assert dc == pytest.approx(exact_directional(deltas, -1), abs=0.004)


def test_every_claim_has_every_verdict_in_the_matrix():
    seen: dict[str, set[str]] = {}
    for _, _, expected in CASES:
        for k, v in expected.items():
            seen.setdefault(k, set()).add(v)
    claims = {"2-gap", "2-slopes", "2-slopes-collapse", "3", "4-shrink", "4-hold",
              "4-shrink_act", "reality-check", "reality-check-act", "5"}
    assert set(seen) == claims
    for k in claims:
        assert seen[k] == {HOLDS, FAILS, NO_DATA}, k
