"""Numbers bit-identical to the previous layout: three short trainings (the three inits,
the arms none, hold and shrink_act, depths 2 and 3) rerun with today's code give exactly
the probe values, losses and learning rates that the flat layout (git 0268ac6, before the
layer packages of issue 27) wrote (tests/golden/train-smoke.json). A refactor that changes
one bit of a trained number fails here; a deliberate change of the numbers rewrites the
file and says why in its commit.

The last bits of float64 linear algebra depend on the CPU's instruction set (the machine of
2026-12-06 and an AVX-512 machine of 2026-12-07 differ from the first probe on), so the
file holds the flat layout's numbers per machine it was run on, and a run must equal one
of them exactly. On a machine none matches, record its numbers from the flat layout with
tests/golden/make_train_smoke.py (the one way the file gains an entry)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import invoke

GOLDEN = json.loads((Path(__file__).parent / "golden" / "train-smoke.json").read_text())


def same(a, b, where: str = "") -> list[str]:
    """Where ``a`` and ``b`` differ (floats exactly, NaN equal to NaN)."""
    if isinstance(a, float) and isinstance(b, float):
        return [] if a == b or (math.isnan(a) and math.isnan(b)) else [f"{where}: {a!r} != {b!r}"]
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} items != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in same(x, y, f"{where}[{i}]")]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in same(a[k], b[k], f"{where}.{k}")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


CASES = sorted(GOLDEN["machines"][0]["cases"])
assert all(sorted(m["cases"]) == CASES for m in GOLDEN["machines"])


@pytest.mark.parametrize("case", CASES)
def test_training_gives_the_previous_layouts_numbers_bit_for_bit(case, wikitext_dir, tmp_path):
    want = GOLDEN["machines"][0]["cases"][case]
    sets = [a for s in [*GOLDEN["common_sets"], *want["sets"]] for a in ("--set", s)]
    r = invoke("train", "--preset", "smoke", "--data", str(wikitext_dir), *sets,
               "--out", str(tmp_path / "run"), "--no-checkpoints", "--quiet")
    assert r.exit_code == 0, r.output
    got = []
    for line in (tmp_path / "run" / "probes.jsonl").read_text().splitlines():
        p = json.loads(line)
        got.append({"step": p["step"], "train_loss": p["train_loss"],
                    "val_loss": p["val_loss"], "lr": p["lr"], "metrics": p["metrics"],
                    "history": [{k: h[k] for k in ("step", "train_loss", "val_loss", "lr")}
                                for h in p.get("history", [])]})
    test_loss = json.loads((tmp_path / "run" / "result.json").read_text())["test_loss"]
    tried = []
    for machine in GOLDEN["machines"]:
        want = machine["cases"][case]
        diffs = same(want["probes"], got, "probes") + same(want["test_loss"], test_loss,
                                                          "test_loss")
        if not diffs:
            break
        tried.append(f"{machine['cpu']}: {len(diffs)} values differ, first: {diffs[:3]}")
    else:
        pytest.fail("no recorded machine's flat-layout numbers are reproduced (if this is a "
                    "machine none was recorded on, run tests/golden/make_train_smoke.py): "
                    + "; ".join(tried))
    assert len(got) == 4 and sum(len(p["metrics"]) for p in got) > 100  # it compared something
