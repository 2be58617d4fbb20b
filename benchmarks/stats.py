"""Time every ``qkgeom stats`` command on a database with >= 5 million metric values.

    python benchmarks/stats.py                      # build (once) and time
    python benchmarks/stats.py --db sqlite:///big.db --repeat 3

The database is synthetic (tests/stats_fixtures.py) but shaped like the paper's study: a
geometry grid of depths 4/6/8 x 3 inits x 4 seeds plus hold/shrink arms at depth 4, 4 heads,
451 probes per trial, every metric at layer and head level (~5.0 M probe_metrics rows),
plus a pretrained family of 154 checkpoints x 12 layers. Each command runs as a user runs
it, in a fresh process (``python -m qkgeom.cli`` equivalent), so the time includes Python
start-up and imports. Prints a markdown table (median of ``--repeat`` runs), then times the
Spearman CI three ways in-process as ratios to the per-point cluster bootstrap.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
# outside the checkout: a ~1 GB file must never be picked up by git
CACHE = Path(os.environ.get("QKGEOM_BENCH_CACHE", Path.home() / ".cache" / "qkgeom-bench"))
DEFAULT_DB = CACHE / "stats-5M.db"
GOAL_S = 5.0


def build(url: str) -> int:
    from stats_fixtures import make_synthetic_db, write_pretrained_family

    t = time.perf_counter()
    info = make_synthetic_db(url, sweep="bench", seeds=4, depths=(4, 6, 8),
                             arms=("hold", "shrink"), max_steps=4500, probe_every=10,
                             n_heads=4, noise=0.05)
    steps = tuple(int(round(1000 * 1.06**k)) for k in range(154))
    write_pretrained_family(url, "bench/pythia-like", steps=tuple(sorted(set(steps))),
                            n_layers=12, peak_index=40)
    print(f"built {url}: {info['n_values']:,} metric values, {info['n_trials']} trials "
          f"in {time.perf_counter() - t:.0f} s", file=sys.stderr)
    return info["n_values"]


COMMANDS = [
    "stats sign-test",
    "stats sign-test --level run --summary all",
    "stats slopes",
    "stats slopes --level run",
    "stats directional-confidence --arm shrink",
    "stats directional-confidence --arm hold --per-layer",
    "stats correlate --x pr_k --y entropy",
    "stats correlate --x qk_erank --y entropy --arm none",
    "stats checkpoint-trend --model bench/pythia-like",
]
EXTRA = ["plot trajectories --out {tmp}/t.png", "report --out {tmp}/report"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", default="sqlite:///" + str(DEFAULT_DB))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--extra", action="store_true", help="also time plot and report")
    a = ap.parse_args()
    from qkgeom.store import open_store

    path = a.db.removeprefix("sqlite:///")
    if a.db.startswith("sqlite:///") and not Path(path).exists():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        build(a.db)
    store = open_store(a.db, create=False, readonly=True)
    n = int(store.sql("SELECT COUNT(*) AS n FROM probe_metrics")["n"][0])
    store.close()
    if n < 5_000_000:
        sys.exit(f"{a.db} holds {n:,} metric values; the benchmark needs >= 5,000,000")
    tmp = CACHE / "out"
    tmp.mkdir(parents=True, exist_ok=True)
    qk = [sys.executable, "-c", "from qkgeom.cli import main; main()"]
    print(f"{n:,} metric values; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, load average "
          f"{os.getloadavg()[0]:.1f} at start\n")
    print("| command | median wall s | median CPU s | runs, wall (s) | under 5 s |")
    print("|---|---|---|---|---|")
    for cmd in COMMANDS + (EXTRA if a.extra else []):
        args = shlex.split(cmd.format(tmp=tmp)) + ["--db", a.db]
        times, cpus = [], []
        for _ in range(a.repeat):
            u0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            r = subprocess.run(qk + args, capture_output=True, text=True)
            times.append(time.perf_counter() - t)
            u1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(u1.ru_utime + u1.ru_stime - u0.ru_utime - u0.ru_stime)
            if r.returncode:
                sys.exit(f"`qkgeom {cmd}` failed:\n{r.stdout}{r.stderr}")
        med = statistics.median(times)
        print(f"| `qkgeom {cmd}` | {med:.2f} | {statistics.median(cpus):.2f} | "
              f"{', '.join(f'{x:.2f}' for x in times)} | "
              f"{'yes' if med < GOAL_S else 'no'} |", flush=True)
    bootstrap_methods(a.db, a.repeat)


def bootstrap_methods(url: str, repeat: int) -> None:
    """The Spearman CI of ``correlate`` (pr_k vs entropy, B = 1000) three ways, in-process
    on the same points: the cluster bootstrap's O(T^3) path, the same resamples point by
    point (the baseline for the ratio), and the pair bootstrap it replaced. Best of
    ``repeat`` each; the two cluster paths must give the same CI ends."""
    import numpy as np

    from qkgeom import analysis as A
    from qkgeom import stats as S
    from qkgeom.store import open_store

    store = open_store(url, create=False, readonly=True)
    pts = A.correlation_points(store, "bench", x="pr_k", y="entropy")
    store.close()
    x, y, trial = pts["pr_k"].to_numpy(), pts["entropy"].to_numpy(), pts["trial_id"].to_numpy()
    runs = {
        "cluster bootstrap, O(T^3) per resample": dict(clusters=trial, method="tensor"),
        "cluster bootstrap, O(n) per resample (baseline)": dict(clusters=trial,
                                                                method="points"),
        "pair bootstrap (before)": {},
    }
    best, res = {}, {}
    for name, kw in runs.items():
        ts = []
        for _ in range(repeat):
            t = time.perf_counter()
            res[name] = S.spearman_ci(x, y, n_boot=1000, rng=np.random.default_rng(0), **kw)
            ts.append(time.perf_counter() - t)
        best[name] = min(ts)
    a, b = (res[k] for k in list(runs)[:2])
    if abs(a.ci_low - b.ci_low) > 1e-12 or abs(a.ci_high - b.ci_high) > 1e-12:
        sys.exit(f"cluster paths disagree: {a} vs {b}")
    base = best[list(runs)[1]]
    print(f"\nSpearman CI, pr_k vs entropy: {x.size:,} points, {len(set(trial.tolist()))} "
          f"trials, B = 1000, best of {repeat}\n")
    print("| method | s | ratio to baseline | CI |")
    print("|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {best[name]:.2f} | {best[name] / base:.2f} | "
              f"[{r.ci_low:.4f}, {r.ci_high:.4f}] |")


if __name__ == "__main__":
    main()
