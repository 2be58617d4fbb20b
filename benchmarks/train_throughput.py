"""Throughput of qkgeom's trial loop against a bare training loop of the same model.

Usage:  python benchmarks/train_throughput.py [--preset cpu] [--steps 300] [--repeats 3]
        [--chunk 10] [--data DIR]

Four variants, run in one process, interleaved ``--chunk`` steps at a time:

* ``bare``: the same GPT, AdamW and batches, SDPA attention, no metrics, no evaluation;
* ``qkgeom``: ``train()`` with arm ``none`` and probes every 100 steps (set-up, the step-0
  probe, probes, validation loss and step logging included; the final test-loss pass is
  not), stepped through :func:`qkgeom.engine.train.training`;
* ``hold`` / ``shrink``: the same with the weight-site arm;
* and the cost of one probe, in training steps.

Every repeat builds the four afresh and advances them in turn, ``--chunk`` steps each, the
starting variant rotating from chunk to chunk, so that a slow spell of a shared machine
falls on all of them alike. A variant's time is the sum over chunk positions of that
chunk's best (shortest) time over the repeats: a disturbance has to hit the same chunk in
every repeat to count. Reported as ratios against ``bare`` from the same run.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from qkgeom.config import preset
from qkgeom.engine.data import Sampler, default_source, load_corpus
from qkgeom.engine.model import GPT
from qkgeom.engine.train import TrainingRun, make_optimizer, training


def bare_steps(cfg, corpus) -> Iterator[None]:
    """A plain loop (batches, forward with SDPA, backward, clip, AdamW), one step per
    ``next`` after a first, untimed ``next`` that builds the model."""
    torch.manual_seed(cfg.seed)
    model = GPT(cfg, corpus.vocab_size)
    opt = make_optimizer(cfg, model)
    sampler = Sampler(corpus.train, cfg.block_size, cfg.batch_size, cfg.seed)
    yield
    for _ in range(cfg.max_steps):
        x, y = sampler.next()
        loss = model.loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        float(loss.detach())
        yield


def qkgeom_steps(cfg, corpus) -> Iterator[None]:
    """``train()`` one step per ``next``; its set-up and step-0 probe fall in the first
    timed chunk, as they fall in a trial's time."""
    yield
    yield from training(cfg, None, corpus=corpus)


def interleaved(variants: dict[str, Callable[[], Iterator]], steps: int, chunk: int,
                repeats: int) -> dict[str, np.ndarray]:
    """Seconds per (repeat, chunk) of each variant, advanced in turn ``chunk`` steps at a
    time."""
    n_chunks = -(-steps // chunk)
    names = list(variants)
    times = {k: np.zeros((repeats, n_chunks)) for k in names}
    for r in range(repeats):
        gens = {k: make() for k, make in variants.items()}
        for g in gens.values():
            next(g)  # untimed: what a variant builds before its clock starts
        for c in range(n_chunks):
            todo = min(chunk, steps - c * chunk)
            for k in names[c % len(names):] + names[:c % len(names)]:
                g = gens[k]
                t0 = time.perf_counter()
                for _ in range(todo):
                    next(g)
                times[k][r, c] = time.perf_counter() - t0
        for g in gens.values():
            g.close()
    return times


def probe_cost_in_steps(cfg, corpus, n: int = 5) -> float:
    tr = TrainingRun(cfg, corpus)
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
    ap.add_argument("--chunk", type=int, default=10, help="steps per turn of a variant")
    ap.add_argument("--data", default=default_source())
    args = ap.parse_args()
    base = preset(args.preset).with_overrides(
        {"max_steps": args.steps, "probe_every": 100, "eval_every": 100, "dataset": args.data}
    )
    if base.threads > 0:
        torch.set_num_threads(base.threads)
    corpus = load_corpus(base.dataset)
    variants = {
        "bare": lambda: bare_steps(base, corpus),
        "qkgeom": lambda: qkgeom_steps(base, corpus),
        "hold": lambda: qkgeom_steps(base.with_overrides({"arm": "hold"}), corpus),
        "shrink": lambda: qkgeom_steps(base.with_overrides({"arm": "shrink"}), corpus),
    }
    interleaved({"bare": variants["bare"]}, min(args.steps, 20), args.chunk, 1)  # warm-up
    times = interleaved(variants, args.steps, args.chunk, args.repeats)
    tokens = args.steps * base.batch_size * base.block_size
    rate = {k: tokens / t.min(0).sum() for k, t in times.items()}
    whole = {k: (tokens / t.sum(1)).tolist() for k, t in times.items()}  # per repeat
    probe_steps = probe_cost_in_steps(base, corpus)
    out = {
        "preset": args.preset,
        "steps": args.steps,
        "chunk": args.chunk,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "tokens_per_s": rate,
        "ratio_qkgeom_vs_bare": rate["qkgeom"] / rate["bare"],
        "hold_step_overhead": rate["qkgeom"] / rate["hold"] - 1,
        "shrink_step_overhead": rate["qkgeom"] / rate["shrink"] - 1,
        "probe_cost_steps": probe_steps,
        "runs": whole,
    }
    print(f"preset {args.preset}, {args.steps} steps, {out['threads']} thread(s), "
          f"{args.repeats} repeats interleaved {args.chunk} steps at a time, "
          "best time per chunk")
    for k, v in rate.items():
        per_rep = ", ".join(f"{x:,.0f}" for x in whole[k])
        print(f"  {k:<7} {v:>10,.0f} tokens/s  ({v / rate['bare']:.3f} x bare; "
              f"whole repeats: {per_rep})")
    print(f"  qkgeom / bare          : {out['ratio_qkgeom_vs_bare']:.3f}  (goal >= 0.95)")
    print(f"  hold per-step overhead : {out['hold_step_overhead']:+.1%}  (goal <= 5%)")
    print(f"  shrink per-step overhead: {out['shrink_step_overhead']:+.1%}  (goal <= 5%)")
    print(f"  one probe costs        : {probe_steps:.2f} training steps")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
