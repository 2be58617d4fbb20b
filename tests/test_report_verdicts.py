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
          key: dict[str, list[float]] | None = None, wk_key: dict[str, list[float]] | None = None,
          drop: tuple[str, ...] = (),
          pretrained: dict[str, list[tuple[int, float]]] | None = None) -> None:
    """A planted sweep "s".

    Baseline (arm none): one trial per seed, depth ``len(layers)``, init gaussian. Layer l,
    with ``(q_slope, k_slope, gap) = layers[l]``, at progress p: PR_Q = 20 + l + q_slope p,
    PR_K = PR_Q(1) - gap + k_slope (p - 1), so the final gap is ``gap`` and the slopes are
    the given ones. qk_erank = 0.5 PR_K + 1, logit_erank = 0.3 PR_K + 2, entropy =
    2 + ent_coef PR_K / 100 (+ the arm's delta), pr_wk = 60 - 50 p.
    Arms: ``arms[arm][i]`` is seed i's entropy delta (arm - baseline, constant), and
    ``key[arm][i]`` scales that seed's pr_wk and PR_K by 1 + key (``wk_key[arm][i]``, when
    given, scales pr_wk instead, so the two sites can disagree).
    ``drop``: metrics not written. ``pretrained``: model -> [(step, PR_Q - PR_K)].
    """
    from qkgeom.store import open_store

    arms = arms or {}
    key = {"shrink": [-0.3] * len(seeds), "hold": [0.3] * len(seeds), **(key or {})}

    def values(arm: str, i: int, seed: int):
        d = arms[arm][i] if arm != "none" else 0.0
        kd = key[arm][i] if arm != "none" else 0.0
        wd = (wk_key or {}).get(arm, key.get(arm, [0.0] * len(seeds)))[i] if arm != "none" else 0.0

        def f(step: int, layer: int) -> dict[str, float]:
            p = step / MAX_STEPS
            qs, ks, gap = layers[layer]
            pr_q = 20 + layer + qs * p
            pr_k0 = 20 + layer + qs - gap + ks * (p - 1)  # the baseline's
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
    write_trials(url, "s", trials, steps=STEPS, max_steps=MAX_STEPS)
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

CASES = [
    # ---- claim 2 (gap): all trajectories positive at the final probe and p = 2^-n < 0.05
    ("gap-5-of-5", dict(layers=[GOOD] * 5), {"2-gap": HOLDS}),  # p = 1/32
    ("gap-4-of-4", dict(layers=[GOOD] * 4), {"2-gap": NO_DATA}),  # p = 1/16: too few
    ("gap-one-negative-among-15",
     dict(layers=[GOOD] * 14 + [(0.14, -0.04, -0.5)]), {"2-gap": FAILS}),
    ("gap-one-exact-zero", dict(layers=[GOOD] * 5 + [(0.14, -0.04, 0.0)]), {"2-gap": FAILS}),
    ("gap-no-pr-values", dict(layers=[GOOD] * 5, drop=("pr_q", "pr_k")),
     {"2-gap": NO_DATA, "2-slopes": NO_DATA}),
    # ---- claim 2 (slopes): sign tests on PR_Q up and PR_K down, each p < 0.05
    # GOOD's PR_Q + PR_K rises (+0.14 - 0.04 per unit), so its collapse point is step 0 and
    # the window from the collapse is the whole run: the same verdicts as from step 0
    ("slopes-5-of-5", dict(layers=[GOOD] * 5), {"2-slopes": HOLDS, "2-slopes-collapse": HOLDS}),
    ("slopes-4-of-4", dict(layers=[GOOD] * 4),  # n < 5, p = 1/16
     {"2-slopes": NO_DATA, "2-slopes-collapse": NO_DATA}),
    # 7 of 8 PR_Q slopes up: p = 9/256 = 0.035 (just below 0.05)
    ("slopes-7-of-8", dict(layers=[GOOD] * 7 + [(-0.1, -0.04, 1.0)]), {"2-slopes": HOLDS}),
    # 6 of 7 up: p = 8/128 = 0.0625 (just above)
    ("slopes-6-of-7", dict(layers=[GOOD] * 6 + [(-0.1, -0.04, 1.0)]), {"2-slopes": FAILS}),
    ("slopes-pr-k-expands", dict(layers=[(0.14, 0.04, 1.0)] * 5),
     {"2-slopes": FAILS, "2-slopes-collapse": FAILS}),
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
    # ---- claim 4 and the reality check for the activation-site arm (shrink_act): the same
    # directional rule; its reality check judges the key-activation PR_K in every seed
    ("act-clear", dict(layers=[GOOD], seeds=FIVE,
                       arms={"shrink_act": [-0.3, -0.2, -0.4, -0.3, -0.1]},
                       key={"shrink_act": [-0.3] * 5}),
     {"4-shrink_act": HOLDS, "reality-check-act": HOLDS}),
    ("act-4-seeds", dict(layers=[GOOD], seeds=FIVE[:4], arms={"shrink_act": [-0.3] * 4},
                         key={"shrink_act": [-0.3] * 4}), {"4-shrink_act": NO_DATA}),
    ("act-just-below-0.95", dict(layers=[GOOD], seeds=FIVE, arms={"shrink_act": JUST_BELOW},
                                 key={"shrink_act": [-0.3] * 5}),
     {"4-shrink_act": FAILS}),
    ("act-keys-one-seed-not-lower",
     dict(layers=[GOOD], seeds=FIVE, arms={"shrink_act": [-0.3] * 5},
          key={"shrink_act": [-0.3, -0.3, -0.3, -0.3, 0.05]},
          wk_key={"shrink_act": [-0.3] * 5}),  # W_K lower in every seed: not its site
     {"reality-check-act": FAILS, "4-shrink_act": HOLDS}),
    # and the other way round: the keys lower in every seed, W_K higher in one
    ("act-keys-lower-wk-not", dict(layers=[GOOD], seeds=FIVE, arms={"shrink_act": [-0.3] * 5},
                                   key={"shrink_act": [-0.3] * 5},
                                   wk_key={"shrink_act": [-0.3, -0.3, -0.3, -0.3, 0.05]}),
     {"reality-check-act": HOLDS}),
    ("act-no-pr-k", dict(layers=[GOOD], seeds=FIVE, arms={"shrink_act": [-0.3] * 5},
                         key={"shrink_act": [-0.3] * 5}, drop=("pr_k",)),
     {"reality-check-act": NO_DATA}),
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
    if case.startswith("dir-") and "4-shrink" in expected and expected["4-shrink"] != NO_DATA:
        deltas = planted["arms"]["shrink"]
        dc = claims["4-shrink"]["numbers"]["directional_confidence"]
        assert dc == pytest.approx(exact_directional(deltas, -1), abs=0.004)


def test_every_claim_has_every_verdict_in_the_matrix():
    seen: dict[str, set[str]] = {}
    for _, _, expected in CASES:
        for k, v in expected.items():
            seen.setdefault(k, set()).add(v)
    claims = {"2-gap", "2-slopes", "2-slopes-collapse", "3", "4-shrink", "4-hold",
              "reality-check", "4-shrink_act", "reality-check-act", "5"}
    assert set(seen) == claims
    for k in claims:
        assert seen[k] == {HOLDS, FAILS, NO_DATA}, k
