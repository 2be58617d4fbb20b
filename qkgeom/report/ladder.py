"""What the scale x learning-rate ladder says about each claim's robustness.

The ladder (docs/findings.md) runs the same study at several widths (n_embd = context) and
peak learning rates; ``qkgeom/report/ladder.json`` holds each measured cell's verdicts, written by
``python studies/ladder.py --json qkgeom/report/ladder.json`` from the cells' databases (never by
hand). The report puts, next to each verdict, whether the ladder saw that claim's verdict
change with the learning rate at a fixed width, with the width at a fixed learning rate,
with both, or with neither, so that a reader knows which verdicts of a small study say more
about its optimiser or size than about the paper.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qkgeom.errors import QkgeomError

LADDER_FILE = Path(__file__).with_name("ladder.json")
DECIDED = ("holds", "does not hold")
FINDINGS = "docs/findings.md"


# the verdict rules a cell was decided under: 1 = before the calibration of issue 25
# (argmin trend window, pooled claim 3, directional confidence >= 0.95, any model for claim
# 5), 2 = the calibrated rules (docs/statistics.md, "Calibration"). Only cells decided
# under the current rules are compared; a cell file without the field is version 1.
RULES_VERSION = 2
# claims whose rule is the same since an older version: cells decided under it still count
RULE_SINCE = {"2-gap": 1, "2-slopes": 1}


@dataclass(frozen=True)
class Cell:
    label: str
    n_embd: int
    lr: float
    verdicts: dict[str, str]
    rules_version: int = 1


def load_cells(path: str | Path | None = None) -> list[Cell]:
    """The measured cells (empty when the file is absent: the ladder has not run)."""
    p = Path(path) if path is not None else LADDER_FILE
    if not p.is_file():
        return []
    cells = []
    try:
        for c in json.loads(p.read_text()):
            sc = c.get("scale") or {}
            (n_embd,), (lr,) = sc["n_embd"], sc["lr"]  # a cell has one width and one lr
            cells.append(Cell(c["label"], int(n_embd), float(lr), dict(c["verdicts"]),
                              int(c.get("rules_version", 1))))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise QkgeomError(f"{p} is not a ladder file ({type(e).__name__}: {e}); rewrite it "
                          "with `python studies/ladder.py --cell ... --json` from the cells' "
                          "databases (docs/findings.md, Commands)") from None
    return cells


def _flips(cells: list[Cell], claim: str, fixed: str) -> list[Any]:
    """Values of the ``fixed`` factor (n_embd or lr) at which the other factor changes
    the claim's decided verdict."""
    groups: dict[Any, set[str]] = {}
    for c in cells:
        v = c.verdicts.get(claim)
        if v in DECIDED:
            groups.setdefault(getattr(c, fixed), set()).add(v)
    return sorted(k for k, vs in groups.items() if len(vs) > 1)


def robustness(cells: list[Cell], claim: str) -> dict[str, Any]:
    """How the claim's verdict behaves on the ladder: ``summary`` (one line) and the
    facts behind it (cells with a decided verdict; widths where the lr flips it; lrs where
    the width flips it). Only cells decided under the claim's current rule
    (:data:`RULES_VERSION`, or the older version in :data:`RULE_SINCE` from which the rule
    is unchanged) are compared; the others are counted in the summary."""
    since = RULE_SINCE.get(claim, RULES_VERSION)
    old = [c for c in cells if c.rules_version < since]
    cells = [c for c in cells if c.rules_version >= since]
    decided = [c for c in cells if c.verdicts.get(claim) in DECIDED]
    by_lr = _flips(cells, claim, "n_embd")  # widths at which changing the lr flips it
    by_width = _flips(cells, claim, "lr")  # lrs at which changing the width flips it
    if not decided:
        summary = "not measured on the ladder" if not cells else "undecided on the ladder"
        if not cells and old:
            summary = "not yet measured on the ladder under the current rules"
    elif by_lr and by_width:
        summary = (f"flips with the learning rate (at n_embd {_join(by_lr)}) and with the "
                   f"width (at lr {_join(by_width, lr=True)})")
    elif by_lr:
        summary = f"flips with the learning rate (at n_embd {_join(by_lr)})"
    elif by_width:
        summary = f"flips with the width (at lr {_join(by_width, lr=True)})"
    else:
        verdicts = {c.verdicts[claim] for c in decided}
        summary = (f"'{verdicts.pop()}' in all {len(decided)} ladder cells" if len(verdicts) == 1
                   else f"differs between cells that share no factor ({len(decided)} cells)")
    if old:
        summary += (f" ({len(old)} cell(s) decided under the retired rules not compared; "
                    f"{FINDINGS})")
    return {"summary": summary, "cells": {c.label: c.verdicts.get(claim) for c in cells},
            "flips_with_lr_at_n_embd": by_lr, "flips_with_width_at_lr": by_width}


def _join(values: list[Any], lr: bool = False) -> str:
    return ", ".join(f"{v:g}" if lr else str(v) for v in values)
