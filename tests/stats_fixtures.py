"""Synthetic results databases with known answers, written through the store API.

``make_synthetic_db(url)`` writes a geometry grid (arm ``none``) and, optionally, an
intervention study (arms hold/shrink paired by seed with the grid's baseline trials) as
real :class:`~qkgeom.records.ProbeRecord` s, so every statistic reads them exactly as it
reads a real sweep. The planted structure (``progress`` p in [0, 1]):

* ``pr_q = 12 + q_slope * p + layer`` and ``pr_k = pr_q - pr_gap * (0.5 + p)``, so the
  sign of PR_Q - PR_K at every probe is the sign of ``pr_gap``, the PR_Q slope is
  ``q_slope`` and the PR_K slope is ``q_slope - pr_gap`` (plus ``noise`` if non-zero).
* ``entropy = 2 - 0.5 p + 0.05 layer + e_seed`` for the baseline; an arm adds
  ``entropy_effect[arm] * p * (1 + j)``, with a per-(arm, seed) jitter ``j`` in
  [-jitter, jitter], so the arm-minus-baseline delta of each seed has the sign of the
  effect (when ``jitter < 1``).
* ``pr_wk = 60 - 50 p`` and the activation ``pr_k`` are scaled by
  ``1 + key_effect[arm] * p`` in an arm (the "did shrink contract the keys" check).
* ``qk_erank`` and ``token_erank`` rise with pr_k; head rows (``n_heads``) spread the
  layer value by +-``head_spread`` so their mean is the layer value.

The function takes any database URL, so it can also append a synthetic sweep to a copy
of a real database.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from qkgeom.records import ProbeRecord


def _records(*, depth: int, seed: int, arm: str, steps: list[int], max_steps: int,
             pr_gap: float, q_slope: float, entropy_effect: dict[str, float],
             key_effect: dict[str, float], jitter: float, noise: float, n_heads: int,
             head_spread: float, rng_seed: int, init_index: int, link: float = 0.0
             ) -> list[ProbeRecord]:
    # Randomness depends on (seed, depth, init) only for the baseline part, so paired
    # arms share it; the arm's jitter has its own stream.
    base = np.random.default_rng([rng_seed, seed, depth, init_index])
    e_seed = base.normal(0, 0.02)
    # ``link``: a per-trial PR_K offset that entropy follows (across-trial variation for
    # claim 3), from its own stream so that link = 0 leaves every other value as it was
    z_link = link * np.random.default_rng([rng_seed, seed, depth, init_index, 99]).normal()
    arm_rng = np.random.default_rng([rng_seed, seed, depth, init_index, 7 + len(arm)])
    j = arm_rng.uniform(-jitter, jitter)
    eff = entropy_effect.get(arm, 0.0)
    keff = key_effect.get(arm, 0.0)
    out = []
    for step in steps:
        p = step / max_steps
        metrics: list[tuple[int, int | None, str, float]] = []
        for layer in range(depth):
            eps = base.normal(0, 1, 2) * noise
            pr_q = 12 + q_slope * p + layer + eps[0]
            pr_k_base = pr_q - pr_gap * (0.5 + p) + eps[1] + z_link
            scale = 1 + keff * p
            pr_k = pr_k_base * scale if arm != "none" else pr_k_base
            pr_wk = (60 - 50 * p) * scale
            pr_wq = 60 - 20 * p
            ent = 2 - 0.5 * p + 0.05 * layer + e_seed + eff * p * (1 + j) + 0.1 * z_link
            vals = {
                "pr_q": pr_q, "pr_k": pr_k, "pr_wq": pr_wq, "pr_wk": pr_wk,
                "qk_pr": 0.4 * pr_k, "qk_erank": 0.5 * pr_k + 1, "token_erank": 0.3 * pr_k + 2,
                "entropy": ent, "entropy_norm": ent / 5.0,
            }
            if arm != "none":
                vals["wk_target_pr"] = pr_wk
            for name, v in vals.items():
                metrics.append((layer, None, name, float(v)))
                if name == "wk_target_pr":
                    continue
                for h in range(n_heads):
                    off = head_spread * (h - (n_heads - 1) / 2)
                    metrics.append((layer, h, name, float(v + off)))
        out.append(ProbeRecord(step=step, progress=p, tokens=step * 1024,
                               train_loss=float("nan") if step == 0 else 3 - p,
                               val_loss=3.1 - p, lr=1e-3, tokens_per_s=0.0 if step == 0 else 1e4,
                               metrics=metrics))
    return out


def make_synthetic_db(url: str, *, sweep: str = "synthetic", pr_gap: float = 1.0,
                      q_slope: float = 0.14,
                      entropy_effect: dict[str, float] | None = None,
                      key_effect: dict[str, float] | None = None,
                      seeds: int | Iterable[int] = 5, depths: tuple[int, ...] = (2, 3),
                      inits: tuple[str, ...] = ("gaussian", "tied", "orthogonal"),
                      arms: tuple[str, ...] = ("hold", "shrink"),
                      arm_seeds: Iterable[int] | None = None,
                      intervention_cell: tuple[int, str] | None = None,
                      max_steps: int = 100, probe_every: int = 10, jitter: float = 0.3,
                      noise: float = 0.0, n_heads: int = 2, head_spread: float = 0.1,
                      status: str = "terminated", rng_seed: int = 0, link: float = 0.0
                      ) -> dict[str, Any]:
    """Write a synthetic sweep to ``url`` (created if new); return what was planted.

    Grid: every (depth, init, seed) with arm ``none``. Intervention: each arm in ``arms``
    at ``intervention_cell`` (default: the first depth and init) for ``arm_seeds``
    (default: all seeds); its baseline is the grid trial of the same seed.
    """
    from qkgeom.store import open_store

    entropy_effect = {"shrink": -0.3, "hold": 0.3} if entropy_effect is None else entropy_effect
    key_effect = {"shrink": -0.4, "hold": 0.4} if key_effect is None else key_effect
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    arm_seed_list = seed_list if arm_seeds is None else list(arm_seeds)
    cell = intervention_cell or (depths[0], inits[0])
    steps = list(range(0, max_steps + 1, probe_every))
    if steps[-1] != max_steps:
        steps.append(max_steps)
    common = dict(steps=steps, max_steps=max_steps, pr_gap=pr_gap, q_slope=q_slope,
                  entropy_effect=entropy_effect, key_effect=key_effect, jitter=jitter,
                  noise=noise, n_heads=n_heads, head_spread=head_spread, rng_seed=rng_seed,
                  link=link)
    n_values = 0
    with open_store(url) as store:
        sid = store.ensure_sweep(sweep, {"synthetic": True, "pr_gap": pr_gap}, "synthetic")
        plan = [(d, i, "none", s) for d in depths for i in inits for s in seed_list]
        plan += [(cell[0], cell[1], a, s) for a in arms for s in arm_seed_list]
        for depth, init, arm, seed in plan:
            key = f"d{depth}-{init}-{arm}-s{seed}"
            cfg = {"depth": depth, "init": init, "arm": arm, "seed": seed,
                   "max_steps": max_steps}
            tid = store.ensure_trial(sid, key, cfg, depth=depth, init=init, arm=arm,
                                     seed=seed, status="pending")
            recs = _records(depth=depth, seed=seed, arm=arm, init_index=inits.index(init),
                            **common)
            n_values += store.write_probes(tid, recs)
            store.set_trial_status(tid, status)
    return {"sweep": sweep, "n_trials": len(plan), "n_values": n_values, "steps": steps,
            "seeds": seed_list, "arm_seeds": arm_seed_list, "cell": cell,
            "n_trajectories": len(inits) * sum(depths)}


def write_pretrained_family(url: str, model: str = "synthetic/pythia-like", *,
                            steps: tuple[int, ...] = (0, 1000, 2000, 4000, 8000, 16000, 32000,
                                                      64000),
                            n_layers: int = 3, peak_index: int = 3) -> None:
    """A pretrained model whose PR_Q - PR_K rises to a peak and then decays, per layer."""
    from qkgeom.store import open_store

    with open_store(url) as store:
        for k, step in enumerate(steps):
            gap = k if k <= peak_index else peak_index - 0.6 * (k - peak_index)
            rows: list[tuple[int, int | None, str, float]] = []
            for layer in range(n_layers):
                pr_k = 20.0 - k + layer
                rows += [(layer, None, "pr_k", pr_k), (layer, None, "pr_q", pr_k + gap + 1),
                         (layer, None, "qk_erank", 0.5 * pr_k),
                         (layer, None, "entropy", 1 + 0.1 * pr_k)]
            store.write_pretrained(model, f"step{step}", step, {"synthetic": True}, rows)


def collapse_curve(step: int, collapse: int, max_steps: int, *, q_up: float = 3.0,
                   k_down: float = 0.5, offset: float = 0.0) -> tuple[float, float]:
    """(PR_Q, PR_K) of a trajectory whose initial collapse ends at step ``collapse``.

    Before it both fall linearly (PR_Q 17 -> 2, PR_K 18 -> 1.5; the gap PR_Q - PR_K is
    negative for the first two thirds of the fall); after it PR_Q rises by ``q_up`` and
    PR_K falls by ``k_down`` per unit of progress, so PR_Q + PR_K is lowest exactly at
    ``collapse`` (when ``q_up > k_down``).
    """
    if step <= collapse:
        u = step / collapse
        return 17 - 15 * u + offset, 18 - 16.5 * u + offset
    dp = (step - collapse) / max_steps
    return 2 + q_up * dp + offset, 1.5 - k_down * dp + offset


def make_collapse_db(url: str, *, sweep: str = "collapse", depths: tuple[int, ...] = (2, 3),
                     inits: tuple[str, ...] = ("gaussian", "tied"), seeds: tuple[int, ...] = (0, 1),
                     max_steps: int = 100, probe_every: int = 5) -> dict[str, Any]:
    """A geometry grid whose (depth, init, layer) trajectories collapse at a known step:
    ``10 + 5 * layer`` (seeds differ by a constant offset, which keeps the point)."""
    from qkgeom.store import open_store

    steps = list(range(0, max_steps + 1, probe_every))
    with open_store(url) as store:
        sid = store.ensure_sweep(sweep, {"synthetic": "collapse"}, "synthetic")
        for depth in depths:
            for init in inits:
                for seed in seeds:
                    key = f"d{depth}-{init}-none-s{seed}"
                    tid = store.ensure_trial(sid, key, {"max_steps": max_steps}, depth=depth,
                                             init=init, arm="none", seed=seed)
                    recs = []
                    for step in steps:
                        rows: list[tuple[int, int | None, str, float]] = []
                        for layer in range(depth):
                            q, k = collapse_curve(step, 10 + 5 * layer, max_steps,
                                                  offset=0.1 * seed)
                            rows += [(layer, None, "pr_q", q), (layer, None, "pr_k", k)]
                        recs.append(ProbeRecord(step=step, progress=step / max_steps,
                                                tokens=step, train_loss=1.0, val_loss=1.0,
                                                lr=1e-3, tokens_per_s=1.0, metrics=rows))
                    store.write_probes(tid, recs)
                    store.set_trial_status(tid, "terminated")
    return {"sweep": sweep, "steps": steps, "max_steps": max_steps,
            "collapse": {layer: 10 + 5 * layer for layer in range(max(depths))}}


def write_trials(url: str, sweep: str, trials: list[dict[str, Any]], *,
                 steps: list[int], max_steps: int) -> None:
    """Write trials whose layer-level metrics are given exactly.

    Each entry of ``trials``: depth, init, arm, seed, optional status (default
    terminated), ``values(step, layer) -> {metric: value}`` and optional
    ``loss(step) -> validation loss`` (default 1.0 at every probe).
    """
    from qkgeom.store import open_store

    with open_store(url) as store:
        sid = store.ensure_sweep(sweep, {"synthetic": True}, "synthetic")
        for t in trials:
            key = f"d{t['depth']}-{t['init']}-{t['arm']}-s{t['seed']}"
            tid = store.ensure_trial(sid, key, {"max_steps": max_steps}, depth=t["depth"],
                                     init=t["init"], arm=t["arm"], seed=t["seed"],
                                     status="pending")
            recs = []
            for step in steps:
                rows = [(layer, None, name, float(v)) for layer in range(t["depth"])
                        for name, v in t["values"](step, layer).items()]
                loss = t["loss"](step) if "loss" in t else 1.0
                recs.append(ProbeRecord(step=step, progress=step / max_steps, tokens=step,
                                        train_loss=float("nan"), val_loss=loss, lr=1e-3,
                                        tokens_per_s=0.0, metrics=rows))
            store.write_probes(tid, recs)
            store.set_trial_status(tid, t.get("status", "terminated"))
