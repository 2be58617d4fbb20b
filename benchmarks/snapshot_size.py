"""Disk cost of a sweep's weight snapshots (``--snapshots all``), measured, not estimated.

For each depth of a sweep preset: save one weight snapshot and one resume checkpoint of
the real model (after one optimizer step, so that AdamW's moments exist) on the corpus
(``--data``, default ``$QKGEOM_DATA``) and multiply by trials and probe steps.

    python benchmarks/snapshot_size.py --preset paper --data ../shared/data/wikitext
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path


def main() -> None:
    from qkgeom.config import preset
    from qkgeom.engine.train import STATE_FILE, TrainingRun
    from qkgeom.plan.spec import plan_from

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="paper")
    ap.add_argument("--data", default=os.environ.get("QKGEOM_DATA"))
    a = ap.parse_args()
    plan = plan_from(a.preset, data=a.data)
    trial_preset = plan.spec["trial"]["preset"]
    by_depth: dict[int, int] = {}
    for t in plan.trials:
        by_depth[t.depth] = by_depth.get(t.depth, 0) + 1
    probes = plan.probes_per_trial(plan.trials[0].key)
    total = 0
    with tempfile.TemporaryDirectory() as d:
        for depth, n in sorted(by_depth.items()):
            over = {"n_layer": depth, "device": "cpu"}
            if a.data:
                over["dataset"] = a.data
            tr = TrainingRun(preset(trial_preset).with_overrides(over))
            tr.train_step()
            snap = Path(tr.save_weights(Path(d) / f"s{depth}")) / STATE_FILE
            ckpt = Path(tr.save(Path(d) / f"c{depth}")) / STATE_FILE
            sb, cb = snap.stat().st_size, ckpt.stat().st_size
            total += sb * n * probes
            print(f"depth {depth}: vocab {tr.corpus.vocab_size}, {tr.model.n_params():,} params, "
                  f"snapshot {sb / 1e6:.1f} MB, resume checkpoint {cb / 1e6:.1f} MB, "
                  f"{n} trials")
    print(f"{a.preset}: {len(plan.trials)} trials x {probes} probe steps: every snapshot "
          f"{total / 1e9:.1f} GB ({total:,} bytes)")


if __name__ == "__main__":
    main()
