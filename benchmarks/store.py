"""Storage benchmark: ingest rate into SQLite and PostgreSQL, and view query times on a
database holding >= 5 million metric values.

    python benchmarks/store.py                 # SQLite + PostgreSQL ($QKGEOM_TEST_PG_URL,
                                               # else starts one with .ci/postgres.sh)
    python benchmarks/store.py --no-pg --json out.json

Records are realistic: 8 layers x 4 heads, every metric of qkgeom.records.METRICS (layer
rows for all, head rows for the per-head ones: 368 values per probe) plus 25 StepRecords
of history per probe. Ingest is measured two ways: one transaction per probe (what a
trial reporting live does) and ``write_probes`` batches of 20 probes (a driver flushing a
backlog). The large database is a sweep of depths 4/6/8 x 3 inits x 3 arms x 7 seeds,
101 probes per trial, 46 values per layer (5,268,564 values), written through
``write_probes`` in one batch (one transaction) per trial.
Every figure printed comes from this run; results go to docs/benchmarks.md by hand.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qkgeom.records import METRICS, ProbeRecord, StepRecord  # noqa: E402
from qkgeom.store import open_store, safe_url  # noqa: E402

N_LAYER, N_HEAD, MAX_STEPS = 8, 4, 5000
QUERIES = {
    "v_trajectories, all rows": "SELECT * FROM v_trajectories",
    "v_trajectories, one metric": "SELECT * FROM v_trajectories WHERE metric = 'pr_q'",
    "v_final, all rows": "SELECT * FROM v_final",
}


def record(step: int, rng: random.Random, *, history: int = 25,
           n_layer: int = N_LAYER) -> ProbeRecord:
    rows = []
    for layer in range(n_layer):
        for name, info in METRICS.items():
            rows.append((layer, None, name, rng.random() * 64))
            if info["per_head"]:
                rows.extend((layer, h, name, rng.random() * 16) for h in range(N_HEAD))
    hist = [StepRecord(step=step - 10 * k, train_loss=2.0, val_loss=math.nan, lr=1e-3,
                       tokens_per_s=5e4) for k in range(history, 0, -1) if step - 10 * k >= 0]
    return ProbeRecord(step=step, progress=step / MAX_STEPS, tokens=step * 16384,
                       train_loss=2.0, val_loss=2.1, lr=1e-3, tokens_per_s=5e4,
                       metrics=rows, history=hist)


def ingest(url: str, n_single: int, n_batched: int, batch: int) -> dict:
    rng = random.Random(0)
    singles = [record(250 * i, rng) for i in range(n_single)]
    batched = [record(250 * i, rng) for i in range(n_batched)]
    per_probe = len(singles[0].metrics)
    with open_store(url) as store:
        sid = store.ensure_sweep("bench-ingest", {}, "bench")
        t1 = store.ensure_trial(sid, "single", {}, depth=N_LAYER, init="gaussian", arm="none",
                                seed=0)
        t2 = store.ensure_trial(sid, "batched", {}, depth=N_LAYER, init="gaussian",
                                arm="none", seed=1)
        t0 = time.perf_counter()
        for rec in singles:
            store.write_probe(t1, rec)
        dt_single = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(0, len(batched), batch):
            store.write_probes(t2, batched[i:i + batch])
        dt_batched = time.perf_counter() - t0
        # a retry of everything: the upsert path with every key already present
        t0 = time.perf_counter()
        for i in range(0, len(batched), batch):
            store.write_probes(t2, batched[i:i + batch])
        dt_rewrite = time.perf_counter() - t0
        n = int(store.sql("SELECT COUNT(*) FROM probe_metrics").item())
    assert n == per_probe * (n_single + n_batched), n
    return {
        "values_per_probe": per_probe,
        "single_probes": n_single, "single_s": dt_single,
        "single_values_per_s": per_probe * n_single / dt_single,
        "batched_probes": n_batched, "batch": batch, "batched_s": dt_batched,
        "batched_values_per_s": per_probe * n_batched / dt_batched,
        "rewrite_values_per_s": per_probe * n_batched / dt_rewrite,
    }


def build_large(url: str, seeds: int, probes: int) -> dict:
    rng = random.Random(1)
    t0 = time.perf_counter()
    n_values = 0
    with open_store(url) as store:
        sid = store.ensure_sweep("bench-5m", {"seeds": seeds}, "bench")
        for depth in (4, 6, 8):
            for init in ("gaussian", "tied", "orthogonal"):
                for arm in ("none", "hold", "shrink"):
                    for seed in range(seeds):
                        tid = store.ensure_trial(
                            sid, f"d{depth}-{init}-{arm}-s{seed}", {}, depth=depth,
                            init=init, arm=arm, seed=seed, status="terminated")
                        recs = [record(i * (MAX_STEPS // (probes - 1)), rng, history=0,
                                       n_layer=depth) for i in range(probes)]
                        n_values += store.write_probes(tid, recs)
    dt = time.perf_counter() - t0
    return {"values": n_values, "build_s": dt, "build_values_per_s": n_values / dt}


def time_queries(url: str, repeat: int = 3) -> dict:
    out = {}
    with open_store(url, create=False, readonly=True) as store:
        for label, sql in QUERIES.items():
            times, rows = [], 0
            for _ in range(repeat):
                t0 = time.perf_counter()
                rows = store.sql(sql).height
                times.append(time.perf_counter() - t0)
            out[label] = {"rows": rows, "first_s": times[0], "best_s": min(times)}
    return out


def start_pg() -> str:
    script = ROOT / ".ci" / "postgres.sh"
    line = subprocess.run(["bash", str(script)], check=True, capture_output=True,
                          text=True).stdout.strip().splitlines()[-1]
    return line.split("=", 1)[1]


def fresh_pg_schema(server: str) -> tuple[str, callable]:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    u = make_url(server)
    name = f"qkgeom_bench_{uuid.uuid4().hex[:8]}"
    admin = create_engine(u, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(text(f'CREATE SCHEMA "{name}"'))

    def drop() -> None:
        with admin.connect() as c:
            c.execute(text(f'DROP SCHEMA "{name}" CASCADE'))
        admin.dispose()

    url = u.update_query_dict({"options": f"-csearch_path={name}"})
    return url.render_as_string(hide_password=False), drop


def run_backend(name: str, make_url, args) -> dict:
    res: dict = {"backend": name}
    url, cleanup = make_url("ingest")
    try:
        res["ingest"] = ingest(url, args.single, args.batched, args.batch)
    finally:
        cleanup()
    print(f"[{name}] ingest: {json.dumps(res['ingest'])}", flush=True)
    url, cleanup = make_url("large")
    try:
        res["large"] = build_large(url, args.seeds, args.probes)
        print(f"[{name}] 5M build: {json.dumps(res['large'])}", flush=True)
        res["queries"] = time_queries(url)
        print(f"[{name}] queries: {json.dumps(res['queries'])}", flush=True)
        res["size_mb"] = res_size(url)
    finally:
        cleanup()
    return res


def res_size(url: str) -> float | None:
    from sqlalchemy import create_engine, text

    if url.startswith("sqlite"):
        p = Path(url.removeprefix("sqlite:///"))
        return sum(f.stat().st_size for f in p.parent.glob(p.name + "*")) / 1e6
    eng = create_engine(url)
    with eng.connect() as c:
        n = c.execute(text("SELECT SUM(pg_total_relation_size(c.oid)) FROM pg_class c JOIN "
                           "pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = "
                           "current_schema()")).scalar()
    eng.dispose()
    return float(n) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pg-url", default=os.environ.get("QKGEOM_TEST_PG_URL"))
    ap.add_argument("--no-pg", action="store_true")
    ap.add_argument("--single", type=int, default=500, help="probes written one by one")
    ap.add_argument("--batched", type=int, default=3000, help="probes written in batches")
    ap.add_argument("--batch", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=7, help="seeds of the large sweep")
    ap.add_argument("--probes", type=int, default=101, help="probes per trial, large sweep")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    results = {"date": date.today().isoformat(), "python": platform.python_version(),
               "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
               "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
               "loadavg_start": os.getloadavg()[0], "backends": []}
    tmp = Path(tempfile.mkdtemp(prefix="qkgeom-bench-"))

    def sqlite_url(tag: str):
        p = tmp / f"{tag}.db"

        def cleanup() -> None:
            for f in tmp.glob(p.name + "*"):
                f.unlink()

        return f"sqlite:///{p}", cleanup

    import sqlite3

    results["sqlite_version"] = sqlite3.sqlite_version
    results["backends"].append(run_backend("sqlite", sqlite_url, args))
    if not args.no_pg:
        server = args.pg_url or start_pg()
        print(f"PostgreSQL: {safe_url(server)}", flush=True)
        from sqlalchemy import create_engine, text

        eng = create_engine(server)
        with eng.connect() as c:
            results["postgres_version"] = c.execute(text("SHOW server_version")).scalar()
        eng.dispose()
        results["backends"].append(run_backend("postgresql", lambda tag: fresh_pg_schema(
            server), args))

    print()
    print("| backend | 1 probe/transaction | 20 probes/transaction | rewrite (upsert) | "
          "5M build |")
    print("|---|---|---|---|---|")
    for b in results["backends"]:
        i, lg = b["ingest"], b["large"]
        print(f"| {b['backend']} | {i['single_values_per_s']:,.0f} values/s | "
              f"{i['batched_values_per_s']:,.0f} values/s | {i['rewrite_values_per_s']:,.0f} "
              f"values/s | {lg['values']:,} values in {lg['build_s']:.1f} s "
              f"({lg['build_values_per_s']:,.0f}/s), {b['size_mb']:,.0f} MB |")
    print()
    print("| backend | query | rows | first | best of 3 |")
    print("|---|---|---|---|---|")
    for b in results["backends"]:
        for label, q in b["queries"].items():
            print(f"| {b['backend']} | {label} | {q['rows']:,} | {q['first_s']:.2f} s | "
                  f"{q['best_s']:.2f} s |")
    results["loadavg_end"] = os.getloadavg()[0]
    print(f"\n1-min load average: {results['loadavg_start']:.1f} at start, "
          f"{results['loadavg_end']:.1f} at the end ({os.cpu_count()} CPUs); "
          f"SQLite {results['sqlite_version']}, "
          f"PostgreSQL {results.get('postgres_version', '-')}, {results['date']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    tmp.rmdir()


if __name__ == "__main__":
    main()
