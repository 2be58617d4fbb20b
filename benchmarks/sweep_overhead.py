"""Orchestration overhead of a sweep: wall time against the trials' own run time.

    python benchmarks/sweep_overhead.py [--preset smoke] [--data DIR] [--set k=v ...]

Runs the sweep on a fresh local Ray instance into a throwaway SQLite file, then
overhead per trial = (sweep wall time - sum of trial run times / parallelism) / n_trials,
where a trial's run time is started_at..ended_at in the database (its own time on a worker,
Ray's actor start included) and parallelism = min(trials, cores / cpus-per-trial). The
sweep wall time includes starting and stopping Ray. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="smoke")
    ap.add_argument("--data", default=os.environ.get("QKGEOM_DATA") or str(
        Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext"))
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--cpus-per-trial", type=float, default=1.0)
    args = ap.parse_args()

    from qkgeom.engine.train import train
    from qkgeom.plan.spec import plan_from
    from qkgeom.store import open_store
    from qkgeom.sweeps.driver import SweepOptions, run_sweep, shutdown

    plan = plan_from(args.preset, data=args.data, sets=args.sets, name="bench")
    # the training itself, in this process, for comparison (corpus cached after the first)
    from qkgeom.config import TrialConfig

    t_direct = []
    for t in plan.trials:
        t0 = time.perf_counter()
        train(TrialConfig.from_dict(dict(t.config, threads=1)))
        t_direct.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory(prefix="qkbench-", dir="/tmp") as d:
        db = f"sqlite:///{d}/bench.db"
        t0 = time.perf_counter()
        try:
            s = run_sweep(plan, SweepOptions(db_url=db, storage=f"{d}/ray", quiet=True,
                                             cpus_per_trial=args.cpus_per_trial,
                                             progress_every_s=1e9))
        finally:
            shutdown()
        wall = time.perf_counter() - t0
        with open_store(db) as store:
            tr = store.trials("bench")
        run_s = [(e - b).total_seconds() for b, e in zip(tr["started_at"], tr["ended_at"])]
    n = len(plan.trials)
    par = max(1, min(n, int((os.cpu_count() or 1) / args.cpus_per_trial)))
    ideal = sum(t_direct) / par
    print(json.dumps({
        "preset": args.preset, "trials": n, "parallelism": par, "errors": s["errors"],
        "sweep_wall_s": round(wall, 2),
        "train_direct_sum_s": round(sum(t_direct), 2),
        "trial_run_sum_s": round(sum(run_s), 2),
        "overhead_per_trial_s": round((wall - ideal) / n, 2),
        "overhead_per_trial_excl_ray_start_s": round((wall - ideal - _ray_start_s()) / n, 2),
    }))


def _ray_start_s() -> float:
    """Time to start and stop an empty local Ray instance (paid once per sweep)."""
    import ray

    t0 = time.perf_counter()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             _temp_dir=tempfile.mkdtemp(prefix="qkray-", dir="/tmp"))
    ray.shutdown()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
