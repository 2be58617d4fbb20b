"""What a verdict rule can decide at a study's design: the exact size of the seed-level
sign tests at the study's seed count, and each rule's power at a stated effect, computed
when the report runs (cached by design).

* :func:`sign_design` -- the one-sided sign test over n independent units (claim 2's seeds):
  the smallest count that passes, its exact size under a median-0 null, and its power when
  each unit is in the predicted direction with probability ``q``.
* :func:`family_power` -- claim 4's family (sign-flip per arm, Holm over the arms that share
  a baseline) at n paired seeds: power for one arm with a paired effect of ``effect`` sd
  (the others null), by Monte Carlo with a fixed seed (the deltas are normal; the three
  arms share the baseline, so their deltas correlate 0.5).
* :func:`all_lower_design` -- the reality check (every seed lower): size 2^-n, power
  Phi(effect)^n for a paired effect of ``effect`` sd.

Claims 3 and 5 use permutation tests whose size is at most alpha by the exchangeability of
their units; their power depends on more of the design than a count and is read from the
calibration record (:mod:`qkgeom.stats.calibration`), at the design it was measured at.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from qkgeom.stats import rules as R
from qkgeom.stats.common import ResultDict, binom_tail_half
from qkgeom.stats.rules import binom_tail

ALPHA = R.ALPHA


@dataclass(frozen=True)
class Design(ResultDict):
    """A test at a design: ``n`` units, the count ``k`` needed to pass (0: none can),
    the exact size, and the power at ``effect`` (a sentence)."""

    n: int
    k: int
    size: float
    power: float
    effect: str


def sign_design(n: int, q: float = 0.95, alpha: float = ALPHA, halves: int = 1) -> Design:
    """The one-sided sign test over ``n`` units at level ``alpha``. ``halves``: how many
    independent such tests must all pass (claim 2's slopes: PR_Q up and PR_K down), so the
    power is the one-test power to that power."""
    k = next((j for j in range(n + 1) if binom_tail_half(j, n) < alpha), 0)
    if n == 0 or k == 0:
        return Design(n, 0, 0.0, 0.0, f"each unit in the predicted direction with "
                      f"probability {q:g}")
    size = binom_tail_half(k, n)
    power = binom_tail(k, n, q) ** halves
    return Design(n, k, size, power, f"each seed in the predicted direction with "
                  f"probability {q:g}" + (" in both halves" if halves > 1 else ""))


@lru_cache(maxsize=64)
def family_power(n: int, arms: int, effect: float = 1.0, alpha: float = ALPHA,
                 reps: int = 2000, seed: int = 0) -> float:
    """Claim 4: the share of simulated studies of ``n`` paired seeds and ``arms`` arms
    sharing one baseline in which an arm with a paired entropy effect of ``effect`` sd (in
    its predicted direction; the other arms null) holds under
    :func:`qkgeom.stats.rules.arm_family_rule`."""
    if n < 2 or arms < 1:
        return 0.0
    rng = np.random.default_rng(seed)
    names = [f"a{i}" for i in range(arms)]
    signs = {a: 1 for a in names}
    hit = 0
    for _ in range(reps):
        base = rng.normal(0, 1, n)
        d = {a: (rng.normal(0, 1, n) - base) / math.sqrt(2) for a in names}
        d[names[0]] = d[names[0]] + effect
        hit += R.arm_family_rule(d, signs, alpha)[names[0]]["verdict"] == R.HOLDS
    return hit / reps


def all_lower_design(n: int, effect: float = 2.0, alpha: float = ALPHA) -> Design:
    """The reality check at ``n`` paired seeds: size 2^-n when it can pass (2^-n < alpha),
    power Phi(effect)^n for a normal paired delta of mean -``effect`` sd."""
    if n == 0 or 2.0**-n >= alpha:
        return Design(n, 0, 0.0, 0.0, f"a paired effect of {effect:g} sd")
    phi = 0.5 * (1 + math.erf(effect / math.sqrt(2)))
    return Design(n, n, 2.0**-n, phi**n, f"a paired effect of {effect:g} sd")
