"""Calibrate every verdict rule: the share of simulated studies in which it says "holds"
under each null model, and its power at planted effects, with Monte Carlo 95% intervals
(:mod:`qkgeom.stats.calibration` describes the models).

    python benchmarks/calibration.py                 # 2,000 studies per claim-4 scenario
    python benchmarks/calibration.py --reps 400 --no-record   # a quick look

It prints one row per (rule, scenario) and a markdown table, and records the rows in
``qkgeom/stats/calibration.json`` with the commit they were measured at; ``qkgeom report``
prints each verdict's rule rate from that record. Exit status 1 when a rule's false-holds
rate is shown to be above 5% (its whole Wilson 95% interval above 5%) or its upper 95% bound
is above 7%. An exact-size test (a sign-flip or permutation p at exactly 5%) has an estimate
above 5% in about half of all calibrations by Monte Carlo noise alone; such rows are listed
apart.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qkgeom.stats import calibration as C  # noqa: E402

VERDICT_CODE = ("qkgeom/stats", "qkgeom/analysis", "qkgeom/report", "qkgeom/store/queries.py",
                "benchmarks/calibration.py")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def markdown(rows: list[dict]) -> str:
    out = ["| rule | scenario | kind | effect | studies | 'holds' | 95% MC interval |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['rule']} | {r['scenario']} | {r['kind']} | {r['effect']} | "
                   f"{r['reps']} | {100 * r['rate']:.1f}% | "
                   f"[{100 * r['ci_low']:.1f}%, {100 * r['ci_high']:.1f}%] |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-record", action="store_true",
                    help="do not write qkgeom/stats/calibration.json")
    ap.add_argument("--no-retired", action="store_true",
                    help="skip the retired rules (shown for comparison)")
    a = ap.parse_args()
    t0 = time.perf_counter()
    rows = C.calibrate(a.reps, seed=a.seed, retired=not a.no_retired, say=print)
    wall = time.perf_counter() - t0
    print()
    print(markdown(rows))
    current = [r for r in rows if r["kind"] == "null" and "retired" not in r["rule"]]
    bad = [r for r in current if r["ci_low"] > 0.05 or r["ci_high"] > 0.07]
    noise = [r for r in current if r["rate"] > 0.05 and r not in bad]
    name = ", ".join
    print(f"\n{len(rows)} rows in {wall:.0f} s; rules over the limits (whole 95% interval "
          f"above 5%, or upper bound > 7%): "
          f"{name(r['rule'] + ' / ' + r['scenario'] for r in bad) or 'none'}")
    if noise:
        print("estimate above 5% but its interval covers 5% (Monte Carlo noise around an "
              "exact-size test, or a rule to watch): "
              + name(f"{r['rule']} / {r['scenario']} {100 * r['rate']:.2f}%" for r in noise))
    if not a.no_record:
        rec = {"commit": _git("rev-parse", "HEAD") or "unknown",
               # every module a verdict depends on: the rules and their simulations
               # (stats), the data selection (analysis, store queries) and the report
               "dirty": bool(_git("status", "--porcelain", "--", *VERDICT_CODE,
                                   f":(exclude)qkgeom/stats/{C.RECORD}")),
               "date": dt.date.today().isoformat(), "reps": a.reps, "seed": a.seed,
               "wall_s": round(wall, 1), "rows": rows}
        path = ROOT / "qkgeom" / "stats" / C.RECORD
        path.write_text(json.dumps(rec, indent=1) + "\n", encoding="utf-8")
        print(f"recorded in {path.relative_to(ROOT)}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
