"""What the statistics share: the result base class and the handling of non-finite
inputs."""

from __future__ import annotations

import math
from dataclasses import asdict
from fractions import Fraction
from typing import Any

import numpy as np

from qkgeom.records import to_jsonable


class ResultDict:
    """Base of the result dataclasses: ``to_dict()`` gives plain Python values (NaN kept)."""

    def to_dict(self) -> dict[str, Any]:
        return to_jsonable(asdict(self), finite=False)  # type: ignore[call-overload]


def finite_values(x: Any) -> tuple[np.ndarray, int]:
    """The finite values of ``x`` (flattened, as floats) and how many were dropped."""
    a = np.asarray(x, dtype=float).ravel()
    keep = np.isfinite(a)
    return a[keep], int(a.size - keep.sum())


def binom_tail_half(k: int, n: int) -> float:
    """Exact ``P(X >= k)`` for ``X ~ Binomial(n, 1/2)``; 1.0 when ``k <= 0``, 0.0 if ``k > n``."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    tail = sum(math.comb(n, i) for i in range(k, n + 1))
    return float(Fraction(tail, 2**n))
