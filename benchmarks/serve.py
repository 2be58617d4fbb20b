"""``qkgeom serve``: the page's first load on the 5M-value benchmark database, and whether
readers polling the page slow a sweep's writes.

    python benchmarks/serve.py                       # both parts
    python benchmarks/serve.py --skip-load           # only the ingest ratio

Part 1 (first load): the stats benchmark's database (benchmarks/stats.py builds it once
under ~/.cache/qkgeom-bench/, ~5.0 M metric values). A real ``qkgeom serve`` starts in a
child process; times are wall clock of HTTP GETs from this process: the index, the sweep's
first page (which waits at most 1 s for verdicts and the chart, then shows them as being
computed), the time until the page carries its verdicts, and a reload with nothing new.

Part 2 (ingest): a fresh SQLite database; this process writes probes of depth-4,
4-head trials one probe per transaction (the live path of a trial: ~370 values each)
for ``--seconds`` per phase, while ``qkgeom serve`` runs in a child process. Phases
run in the order A B B A (a drift over the run, e.g. the database growing, cancels out):
A without readers, B with ``--readers`` threads each GETting the sweep's page once a
second (each page sees new data; the server recomputes verdicts and charts in background
threads, at most every ``--update-every`` seconds, 30 by default). Prints values/s per
phase and the ratio with / without.
"""

from __future__ import annotations

import argparse
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(url: str, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", "from qkgeom.cli import main; main()",
                             "serve", "--db", url, "--port", str(port), *extra], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("qkgeom serve did not start")


def get(url: str) -> tuple[float, str]:
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as r:
        body = r.read().decode()
    return time.perf_counter() - t, body


def first_load(db: str) -> None:
    proc, base = start_server(db)
    try:
        t_index, _ = get(base + "/")
        t_first, body = get(base + "/sweeps/bench")
        had = "id='claims'" in body
        t0 = time.perf_counter()
        while "id='claims'" not in body or "<figure id='chart'>" not in body:
            time.sleep(0.5)
            _, body = get(base + "/sweeps/bench")
        t_ready = time.perf_counter() - t0 + t_first
        t_again, _ = get(base + "/sweeps/bench")
    finally:
        proc.terminate()
        proc.wait()
    print("| request | wall s |\n|---|---|")
    print(f"| `/` (index) | {t_index:.2f} |")
    print(f"| `/sweeps/bench`, first load | {t_first:.2f} |")
    print(f"| first load already had the verdicts | {'yes' if had else 'no'} |")
    print(f"| until the page carries verdicts and chart | {t_ready:.2f} |")
    print(f"| reload, nothing new | {t_again:.2f} |")


def ingest(seconds: float, readers: int, update_every: float) -> None:
    from stats_fixtures import _records

    from qkgeom.store import open_store

    d = tempfile.mkdtemp(prefix="qkgeom-serve-bench-")
    url = f"sqlite:///{d}/ingest.db"
    store = open_store(url)
    sid = store.ensure_sweep("ingest", {"bench": True}, "bench")
    proc, base = start_server(url, "--update-every", str(update_every))
    recs = _records(depth=4, seed=0, arm="none", steps=list(range(0, 100_001, 10)),
                    max_steps=100_000, pr_gap=1.0, q_slope=0.1, entropy_effect={},
                    key_effect={}, jitter=0.0, noise=0.05, n_heads=4, head_spread=0.1,
                    rng_seed=0, init_index=0)
    counter = {"trial": 0}

    def phase(n_readers: int) -> float:
        counter["trial"] += 1
        tid = store.ensure_trial(sid, f"t{counter['trial']}", {"max_steps": 100_000},
                                 depth=4, init="gaussian", arm="none",
                                 seed=counter["trial"], status="running")
        stop = threading.Event()
        pages = []

        def reader() -> None:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    pages.append(get(base + "/sweeps/ingest")[0])
                except OSError:
                    pass
                stop.wait(max(0.0, 1.0 - (time.perf_counter() - t0)))

        threads = [threading.Thread(target=reader, daemon=True) for _ in range(n_readers)]
        for th in threads:
            th.start()
        n, i = 0, 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            if i == len(recs):  # this trial is complete: the next one
                counter["trial"] += 1
                tid = store.ensure_trial(sid, f"t{counter['trial']}", {"max_steps": 100_000},
                                         depth=4, init="gaussian", arm="none",
                                         seed=counter["trial"], status="running")
                i = 0
            n += store.write_probes(tid, [recs[i]])
            i += 1
        dt = time.perf_counter() - t0
        stop.set()
        for th in threads:
            th.join()
        rate = n / dt
        extra = (f", {len(pages)} page loads, median {statistics.median(pages):.2f} s"
                 if pages else "")
        print(f"  {n_readers} readers: {rate:,.0f} values/s ({n:,} values in {dt:.1f} s"
              f"{extra})", file=sys.stderr)
        return rate

    try:
        rates: dict[int, list[float]] = {0: [], readers: []}
        for k in (0, readers, readers, 0):  # ABBA: a drift over time cancels out
            rates[k].append(phase(k))
    finally:
        proc.terminate()
        proc.wait()
        store.close()
    base_rate = statistics.mean(rates[0])
    with_rate = statistics.mean(rates[readers])
    print("\n| phase | values/s (each run) | mean |\n|---|---|---|")
    print(f"| no readers | {', '.join(f'{r:,.0f}' for r in rates[0])} | {base_rate:,.0f} |")
    print(f"| {readers} readers, 1 page/s each | "
          f"{', '.join(f'{r:,.0f}' for r in rates[readers])} | {with_rate:,.0f} |")
    print(f"\nratio with / without readers: {with_rate / base_rate:.2f} "
          f"(server --update-every {update_every:g})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--db", default=None, help="part 1 database (default: the stats "
                    "benchmark's, built if missing)")
    ap.add_argument("--seconds", type=float, default=20.0, help="part 2: seconds per phase")
    ap.add_argument("--readers", type=int, default=5)
    ap.add_argument("--update-every", type=float, default=30.0,
                    help="part 2: the server's --update-every")
    ap.add_argument("--skip-load", action="store_true")
    ap.add_argument("--skip-ingest", action="store_true")
    a = ap.parse_args()
    print(f"# {platform.machine()}, Python {platform.python_version()}, "
          f"load average {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    if not a.skip_load:
        import stats as S

        db = a.db or "sqlite:///" + str(S.DEFAULT_DB)
        if a.db is None and not S.DEFAULT_DB.exists():
            S.DEFAULT_DB.parent.mkdir(parents=True, exist_ok=True)
            S.build(db)
        first_load(db)
    if not a.skip_ingest:
        ingest(a.seconds, a.readers, a.update_every)


if __name__ == "__main__":
    main()
