"""Throughput of qkgeom's trial loop against a bare training loop of the same model.

Usage:  python benchmarks/train_throughput.py [--preset cpu] [--steps 300] [--repeats 3]
        [--data DIR]

In one process, interleaving the variants ``--repeats`` times:

* ``bare``: the same GPT, AdamW and batches, SDPA attention, no metrics, no evaluation;
* ``qkgeom``: ``train()`` with arm ``none`` and probes every 100 steps (probes, validation
  loss and step logging included; the final test-loss pass is not);
* ``hold`` / ``shrink``: ``train()`` with the weight-site arm, same probes;
* the cost of one probe, in training steps.

Reported as ratios against the bare loop measured in the same run. Each variant's figure is
the best of its repeats: on a shared machine the fastest run is the least disturbed one.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from qkgeom.config import preset
from qkgeom.data import Sampler, default_source, load_corpus
from qkgeom.model import GPT
from qkgeom.train import Trial, make_optimizer, train


def bare_loop(cfg, corpus) -> float:
    """Tokens/s of a plain loop: batches, forward (SDPA), backward, clip, AdamW."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg, corpus.vocab_size)
    opt = make_optimizer(cfg, model)
    sampler = Sampler(corpus.train, cfg.block_size, cfg.batch_size, cfg.seed)
    t0 = time.perf_counter()
    for _ in range(cfg.max_steps):
        x, y = sampler.next()
        loss = model.loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        float(loss.detach())
    return cfg.max_steps * cfg.batch_size * cfg.block_size / (time.perf_counter() - t0)


def qkgeom_loop(cfg, corpus) -> float:
    """Tokens/s of ``train()`` from its start to the end of the last step's probe."""
    done = {}
    t0 = time.perf_counter()

    def progress(step, info):
        if step == cfg.max_steps:
            done["t"] = time.perf_counter()

    train(cfg, None, progress=progress, corpus=corpus)
    return cfg.max_steps * cfg.batch_size * cfg.block_size / (done["t"] - t0)


def probe_cost_in_steps(cfg, corpus, n: int = 5) -> float:
    tr = Trial(cfg, corpus)
    t0 = time.perf_counter()
    for _ in range(20):
        tr.train_step()
    step_s = (time.perf_counter() - t0) / 20
    t0 = time.perf_counter()
    for _ in range(n):
        tr.probe(float("nan"), 0.0)
    return (time.perf_counter() - t0) / n / step_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data", default=default_source())
    args = ap.parse_args()
    base = preset(args.preset).with_overrides(
        {"max_steps": args.steps, "probe_every": 100, "eval_every": 100, "dataset": args.data}
    )
    if base.threads > 0:
        torch.set_num_threads(base.threads)
    corpus = load_corpus(base.dataset)
    variants = {
        "bare": lambda: bare_loop(base, corpus),
        "qkgeom": lambda: qkgeom_loop(base, corpus),
        "hold": lambda: qkgeom_loop(base.with_overrides({"arm": "hold"}), corpus),
        "shrink": lambda: qkgeom_loop(base.with_overrides({"arm": "shrink"}), corpus),
    }
    runs: dict[str, list[float]] = {k: [] for k in variants}
    variants["bare"]()  # warm-up (allocator, kernels)
    for _ in range(args.repeats):
        for k, fn in variants.items():
            runs[k].append(fn())
    med = {k: max(v) for k, v in runs.items()}  # best of repeats
    probe_steps = probe_cost_in_steps(base, corpus)
    out = {
        "preset": args.preset,
        "steps": args.steps,
        "threads": torch.get_num_threads(),
        "tokens_per_s": med,
        "ratio_qkgeom_vs_bare": med["qkgeom"] / med["bare"],
        "hold_step_overhead": med["qkgeom"] / med["hold"] - 1,
        "shrink_step_overhead": med["qkgeom"] / med["shrink"] - 1,
        "probe_cost_steps": probe_steps,
        "runs": runs,
    }
    print(f"preset {args.preset}, {args.steps} steps, {out['threads']} thread(s), "
          f"best of {args.repeats}")
    for k, v in med.items():
        print(f"  {k:<7} {v:>10,.0f} tokens/s  ({v / med['bare']:.3f} x bare)")
    print(f"  qkgeom / bare          : {out['ratio_qkgeom_vs_bare']:.3f}  (goal >= 0.95)")
    print(f"  hold per-step overhead : {out['hold_step_overhead']:+.1%}  (goal <= 5%)")
    print(f"  shrink per-step overhead: {out['shrink_step_overhead']:+.1%}  (goal <= 5%)")
    print(f"  one probe costs        : {probe_steps:.2f} training steps")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
