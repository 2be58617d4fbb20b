"""How many `paper` trials to pack on one GPU: aggregate throughput of N trials at once.

Usage:  python benchmarks/gpu_study.py [--ns 1,2,4,8,16] [--window 15] [--data DIR]
        [--compile]
        python benchmarks/gpu_study.py --device cpu --preset smoke --ns 1,2 --window 3
                                       # the harness itself, on CPU (no GPU figures)

For each N, N copies of the `paper` preset's trial (depth 6, arm none, qkgeom's own
``TrainingRun.train_step``: bf16 autocast, fused AdamW) train at once on one GPU:

* ``ray``: N Ray actors with ``num_gpus=1/N`` (Ray's fractional GPUs, as
  ``qkgeom sweep --gpus-per-trial 1/N`` places trials);
* ``procs``: N plain processes (multiprocessing, spawn), the baseline without Ray.

Every trial is built and warmed up first; then all start together (an actor call / a
barrier) and count the optimizer steps they finish in the same ``--window`` seconds
(a device sync every 5 steps). Printed per N and runner: aggregate tokens/s, its ratio to
N = 1 of the same runner, peak GPU memory per trial (allocated / reserved by torch; each
process also holds a CUDA context of a few hundred MiB), device memory in use, and the
projected wall time of the 52-trial `paper` study at that packing: the study's training
tokens, weighted by depth / 6 (step time grows about linearly with depth), over the
aggregate rate (training only: probes, evaluation and the arms' SVD are not included).
Budgeted at about 5 minutes on one GPU with the defaults (not yet run on one). Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import sys
import time
from typing import Any

SYNC_EVERY = 5


def _config(preset_name: str, device: str, data: str, compile_: bool):
    from qkgeom.config import preset

    return preset(preset_name).with_overrides(
        {"device": device, "dataset": data, "compile": compile_, "threads": 1, "seed": 0})


class TrialRunner:
    """One trial's model and optimizer, warmed up; ``run`` counts steps in a time window."""

    def __init__(self, preset_name: str, device: str, data: str, compile_: bool,
                 warmup: int) -> None:
        import torch

        from qkgeom.engine.train import TrainingRun

        self.torch = torch
        self.cfg = _config(preset_name, device, data, compile_)
        self.trial = TrainingRun(self.cfg)
        self.cuda = self.trial.device.type == "cuda"
        for _ in range(warmup):
            self.trial.train_step()
        self._sync()

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def ready(self) -> bool:
        return True

    def run(self, start_at: float, window_s: float) -> dict[str, Any]:
        torch = self.torch
        while time.time() < start_at:
            time.sleep(0.001)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        steps = done = 0
        while True:
            self.trial.train_step()
            steps += 1
            if steps % SYNC_EVERY == 0:
                self._sync()
                done = steps
                if time.time() - t0 >= window_s:
                    break
        t1 = time.time()
        out = {"steps": done, "tokens": done * self.cfg.batch_size * self.cfg.block_size,
               "t0": t0, "t1": t1}
        if self.cuda:
            free, total = torch.cuda.mem_get_info()
            out.update(alloc=torch.cuda.max_memory_allocated(),
                       reserved=torch.cuda.max_memory_reserved(), device_used=total - free)
        return out


def _proc_main(args: tuple, barrier: Any, start_box: Any, results: Any) -> None:
    preset_name, device, data, compile_, warmup, window = args
    runner = TrialRunner(preset_name, device, data, compile_, warmup)
    barrier.wait()  # everyone built and warmed up
    barrier.wait()  # the parent has set the start time
    results.put(runner.run(start_box.value, window))


def run_procs(n: int, args: tuple) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n + 1)
    start_box = ctx.Value("d", 0.0)
    results = ctx.Queue()
    procs = [ctx.Process(target=_proc_main, args=(args, barrier, start_box, results))
             for _ in range(n)]
    for p in procs:
        p.start()
    barrier.wait()
    start_box.value = time.time() + 0.5
    barrier.wait()
    out = [results.get(timeout=600) for _ in range(n)]
    for p in procs:
        p.join(timeout=60)
    return out


def run_ray(n: int, args: tuple, gpu: bool) -> list[dict[str, Any]]:
    import ray

    preset_name, device, data, compile_, warmup, window = args
    cpus = max(os.cpu_count() or 1, 1)
    actor = ray.remote(num_gpus=(1.0 / n) if gpu else 0, num_cpus=min(1.0, cpus / n / 2))(
        TrialRunner)
    actors = [actor.remote(preset_name, device, data, compile_, warmup) for _ in range(n)]
    ray.get([a.ready.remote() for a in actors])  # all built and warmed up
    start_at = time.time() + 0.5
    out = ray.get([a.run.remote(start_at, window) for a in actors])
    for a in actors:
        ray.kill(a)
    return out


def summarise(rs: list[dict[str, Any]]) -> dict[str, Any]:
    t0, t1 = max(r["t0"] for r in rs), min(r["t1"] for r in rs)  # all were running
    # each trial's own rate, summed: robust to start/end skew between processes
    agg = sum(r["tokens"] / (r["t1"] - r["t0"]) for r in rs)
    out = {"tokens_per_s": agg, "overlap_s": t1 - t0, "steps": [r["steps"] for r in rs]}
    if "alloc" in rs[0]:
        out.update(alloc_mib=max(r["alloc"] for r in rs) / 2**20,
                   reserved_mib=max(r["reserved"] for r in rs) / 2**20,
                   device_used_mib=max(r["device_used"] for r in rs) / 2**20)
    return out


def study_tokens(depth_ref: int) -> tuple[int, float]:
    """(trials, training tokens of the `paper` study weighted by depth / depth_ref)."""
    from qkgeom.plan.spec import plan_from

    plan = plan_from("paper")
    total = 0.0
    for t in plan.trials:
        c = t.config
        total += c["max_steps"] * c["batch_size"] * c["block_size"] * c["n_layer"] / depth_ref
    return len(plan.trials), total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="1,2,4,8,16", help="trials per GPU to try")
    ap.add_argument("--window", type=float, default=12.0, help="seconds measured per N")
    ap.add_argument("--warmup", type=int, default=10, help="steps before the window")
    ap.add_argument("--preset", default="paper")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--runners", default="ray,procs")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--data", default=None, help="corpus (default: $QKGEOM_DATA, else "
                    "wikitext-103)")
    args = ap.parse_args()

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA: torch.cuda.is_available() is False on this machine; "
              "gpu_study.py measures nothing here (run it on a GPU machine)")
        return
    from qkgeom.engine.data import default_source, load_corpus

    data = args.data or default_source()
    load_corpus(data)  # fetch/cache once, before N processes want it
    gpu = args.device == "cuda"
    if gpu:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")  # one GPU, for Ray and children
        print(f"GPU: {torch.cuda.get_device_name(0)}, "
              f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB; "
              f"torch {torch.__version__}")
    ns = [int(x) for x in args.ns.split(",")]
    runners = args.runners.split(",")
    t_start = time.time()
    if "ray" in runners:
        import ray

        ray.init(address="local", num_cpus=os.cpu_count(), num_gpus=1 if gpu else 0,
                 include_dashboard=False, log_to_driver=False)
    job = (args.preset, args.device, data, args.compile, args.warmup, args.window)
    results: dict[str, dict[int, dict[str, Any]]] = {r: {} for r in runners}
    for n in ns:
        for r in runners:
            rs = run_ray(n, job, gpu) if r == "ray" else run_procs(n, job)
            results[r][n] = summarise(rs)
            print(f"  {r:<5} N={n:<2} {results[r][n]['tokens_per_s']:>12,.0f} tokens/s "
                  f"({time.time() - t_start:.0f} s elapsed)", flush=True)
    if "ray" in runners:
        import ray

        ray.shutdown()

    n_trials, tokens = study_tokens(_config(args.preset, "cpu", data, False).n_layer)
    print(f"\n{args.preset} trial (depth {_config(args.preset, 'cpu', data, False).n_layer}, "
          f"arm none), {args.window:g} s window per N, device {args.device}"
          f"{', torch.compile' if args.compile else ''}")
    head = f"{'runner':<6} {'N':>3} {'tokens/s':>12} {'vs N=1':>7} {'alloc MiB':>10} " \
           f"{'resv MiB':>9} {'dev MiB':>8} {'52-trial study':>15}"
    print(head)
    for r in runners:
        base = results[r][ns[0]]["tokens_per_s"] if ns[0] == 1 else math.nan
        for n in ns:
            x = results[r][n]
            hours = tokens / x["tokens_per_s"] / 3600 if args.preset == "paper" else math.nan
            mem = (f"{x['alloc_mib']:>10,.0f} {x['reserved_mib']:>9,.0f} "
                   f"{x['device_used_mib']:>8,.0f}") if "alloc_mib" in x else \
                f"{'-':>10} {'-':>9} {'-':>8}"
            print(f"{r:<6} {n:>3} {x['tokens_per_s']:>12,.0f} "
                  f"{x['tokens_per_s'] / base:>7.2f} {mem} {hours:>13.1f} h")
    print(f"(study: {n_trials} trials, {tokens:.3g} depth-weighted training tokens; "
          f"total run {time.time() - t_start:.0f} s)")
    print(json.dumps({"results": results, "study_trials": n_trials,
                      "study_tokens_depth_weighted": tokens, "args": vars(args)}))


if __name__ == "__main__":
    sys.exit(main())
