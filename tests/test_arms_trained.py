"""The arms in real training: the stored PR reaches the target at every probe.

A short smoke-size run (2 layers, n_embd 32, 40 steps, probes at 0, 20 and 40) on the real
WikiText files per arm. Each probe is stored in a SQLite results database and read back
with plain SQL. The targets are computed here, independently of qkgeom.engine.intervention: PR_0
from numpy's SVD of the step-0 W_K (read from the step-0 checkpoint), the schedule in
closed form. The achieved PR is checked twice: the stored ``pr_wk`` and numpy's SVD of the
W_K saved in each probe's checkpoint.

Tolerance: 1e-4 relative. The arm solves for the power map in float64 to ~1e-6 and writes
W_K back in float32, so the achieved PR differs from the target by ~1e-6 relative (the
smoke preset's shrink hits 12.1733 for a target of 12.1733 at step 20).

The activation site shapes keys with a map built from a running (EMA) covariance of the
training batches; what it guarantees exactly is that this covariance, mapped, has the target
PR. That is checked here after training; the keys the probe measures are checked against
the target in a strict xfail (see there for the numbers).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from qkgeom.engine.data import Sampler
from qkgeom.engine.model import GPT
from qkgeom.engine.train import train

MAX_STEPS = 40
PROBES = (0, 20, 40)
REL = 1e-4
BASELINE = [[0, [14.0, 13.0]], [40, [10.0, 9.0]]]  # a paired baseline's W_K PR per layer


def np_pr(lam: np.ndarray) -> float:
    lam = np.clip(lam, 0, None)
    return float(lam.sum() ** 2 / (lam**2).sum())


def np_weight_pr(w: torch.Tensor) -> float:
    s = np.linalg.svd(w.detach().double().numpy(), compute_uv=False)
    return np_pr(s**2)


def g_closed(sched: str, f: float, step: int, start: float = 0.0) -> float:
    u = min(max((step / MAX_STEPS - start) / (1 - start), 0.0), 1.0)
    return {"linear": 1 + (f - 1) * u, "exp": f**u,
            "cosine": 1 + (f - 1) * (1 - math.cos(math.pi * u)) / 2}[sched]


def baseline_closed(step: int) -> list[float]:
    # BASELINE interpolated by hand: linear from step 0 to 40
    return [14.0 - 4.0 * step / 40, 13.0 - 4.0 * step / 40]


# arm id -> (config overrides, target(step, pr0 per layer) -> per-layer targets)
ARMS = {
    "hold": (dict(arm="hold"), lambda s, pr0: list(pr0)),
    "shrink-init_fraction": (
        dict(arm="shrink", shrink_to=0.5),
        lambda s, pr0: [g_closed("linear", 0.5, s) * p for p in pr0]),
    "shrink-init_fraction-exp-start": (
        dict(arm="shrink", shrink_to=0.5, shrink_schedule="exp", shrink_start=0.25),
        lambda s, pr0: [g_closed("exp", 0.5, s, 0.25) * p for p in pr0]),
    "shrink-absolute": (
        dict(arm="shrink", target_mode="absolute", shrink_to=4.0),
        lambda s, pr0: [p + (4.0 - p) * s / MAX_STEPS for p in pr0]),
    "shrink-baseline_fraction": (
        dict(arm="shrink", target_mode="baseline_fraction", shrink_to=0.5, baseline_pr=BASELINE),
        lambda s, pr0: [g_closed("linear", 0.5, s) * b for b in baseline_closed(s)]),
}


def run_stored(cfg, tmp_path: Path, corpus) -> tuple[dict, dict]:
    """Train ``cfg`` recording every probe into SQLite; return the stored layer-level
    ``{(step, layer, metric): value}`` and the checkpoint directory per probe step."""
    from sqlalchemy import create_engine, text

    from qkgeom.store import open_store

    url = f"sqlite:///{tmp_path / 'arm.db'}"
    ckpts: dict[int, str] = {}
    with open_store(url) as store:
        sid = store.ensure_sweep("arms", {}, "test")
        tid = store.ensure_trial(sid, "t", cfg.to_dict(), depth=cfg.n_layer, init=cfg.init,
                                 arm=cfg.arm, seed=cfg.seed)

        def report(rec, ckpt):
            store.write_probe(tid, rec)
            ckpts[rec.step] = ckpt

        train(cfg, report, checkpoint_dir=tmp_path / "ckpt", corpus=corpus)
    eng = create_engine(url)
    with eng.connect() as conn:
        rows = conn.execute(text("SELECT step, layer, metric, value FROM probe_metrics "
                                 "WHERE head_key = -1")).all()
    eng.dispose()
    return {(s, la, m): v for s, la, m, v in rows}, ckpts


def state(ckpt: str) -> dict:
    return torch.load(Path(ckpt) / "state.pt", map_location="cpu", weights_only=False)


def wk_of(st: dict, n_layer: int) -> list[torch.Tensor]:
    return [st["model"][k] for k in sorted(st["model"]) if k.endswith("k_proj.weight")][
        :n_layer]


@pytest.mark.parametrize("arm_id", list(ARMS))
def test_weight_arm_reaches_its_target_at_every_probe(arm_id, tiny_cfg, corpus, tmp_path):
    sets, target = ARMS[arm_id]
    cfg = tiny_cfg.with_overrides(sets)
    assert (cfg.max_steps, cfg.probe_every, cfg.n_layer) == (MAX_STEPS, 20, 2)
    stored, ckpts = run_stored(cfg, tmp_path, corpus)
    assert sorted(ckpts) == list(PROBES)
    pr0 = [np_weight_pr(w) for w in wk_of(state(ckpts[0]), 2)]
    assert all(5 < p < 32 for p in pr0)  # a 32 x 32 Gaussian init: far from both ends
    for step in PROBES:
        want = target(step, pr0)
        achieved = [np_weight_pr(w) for w in wk_of(state(ckpts[step]), 2)]
        for layer in (0, 1):
            if step == 0 and arm_id == "shrink-baseline_fraction":
                # nothing is applied before the first optimizer step; the baseline's PR
                # at step 0 is not the model's
                assert achieved[layer] == pytest.approx(pr0[layer], rel=1e-12)
                continue
            assert stored[step, layer, "pr_wk"] == pytest.approx(want[layer], rel=REL), \
                (step, layer)
            assert achieved[layer] == pytest.approx(want[layer], rel=REL), (step, layer)
            if step > 0:  # the arm records the target it used after each step
                assert stored[step, layer, "wk_target_pr"] == pytest.approx(want[layer],
                                                                            rel=1e-9)
    # the run moved: the last target differs from the first (except hold)
    if arm_id != "hold":
        assert abs(target(40, pr0)[0] - target(0, pr0)[0]) > 1.0


def first_batch_key_pr(cfg, corpus, ckpt0: str) -> list[float]:
    """PR of the key covariance of the first training batch under the initial weights:
    the activation arm's PR_0, recomputed with a fresh model and numpy."""
    model = GPT(cfg.with_overrides({"arm": "none"}), corpus.vocab_size)
    model.load_state_dict(state(ckpt0)["model"])
    x, _ = Sampler(corpus.train, cfg.block_size, cfg.batch_size, cfg.seed).next()
    keys = {}
    for li, a in enumerate(model.attn_layers()):
        a.hook_k.register_forward_hook(lambda m, i, o, li=li: keys.__setitem__(li, o))
    with torch.no_grad():
        model(x)
    out = []
    for li in range(cfg.n_layer):
        k = keys[li]
        flat = k.transpose(1, 2).reshape(-1, k.shape[1] * k.shape[3]).double().numpy()
        out.append(np_pr(np.linalg.eigvalsh(np.cov(flat.T))))
    return out


ACT_ARMS = {
    "hold": (dict(arm="hold"), lambda s, pr0: list(pr0)),
    "shrink": (dict(arm="shrink", shrink_to=0.5),
               lambda s, pr0: [g_closed("linear", 0.5, s) * p for p in pr0]),
}


@pytest.mark.parametrize("arm_id", list(ACT_ARMS))
def test_activation_arm_maps_the_running_key_covariance_to_its_target(arm_id, tiny_cfg,
                                                                      corpus, tmp_path):
    sets, target = ACT_ARMS[arm_id]
    cfg = tiny_cfg.with_overrides({"site": "activation", **sets})
    stored, ckpts = run_stored(cfg, tmp_path, corpus)
    pr0 = first_batch_key_pr(cfg, corpus, ckpts[0])
    for step in PROBES[1:]:
        want = target(step, pr0)
        shapers = state(ckpts[step])["control"]["shapers"]
        for layer, sh in enumerate(shapers):
            cov, a = sh["cov"].double().numpy(), sh["a"].double().numpy()
            mapped = np_pr(np.linalg.eigvalsh(a.T @ cov @ a))
            assert stored[step, layer, "wk_target_pr"] == pytest.approx(want[layer], rel=1e-6)
            assert mapped == pytest.approx(want[layer], rel=1e-3), (step, layer)
        # W_K itself is not reshaped at the activation site: its PR is the trained one
        assert stored[step, 0, "pr_wk"] != pytest.approx(want[0], rel=1e-2)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "the activation arm's map comes from a running covariance of past training batches, so "
    "the probe batch's key PR misses the target by far (smoke, shrink 0.5: target 8.86, "
    "measured PR_K 4.65 at step 20, layer 0); reported in issue 18's note"))
def test_activation_arm_key_pr_reaches_its_target(tiny_cfg, corpus, tmp_path):
    sets, target = ACT_ARMS["shrink"]
    cfg = tiny_cfg.with_overrides({"site": "activation", **sets})
    stored, ckpts = run_stored(cfg, tmp_path, corpus)
    pr0 = first_batch_key_pr(cfg, corpus, ckpts[0])
    for step in PROBES[1:]:
        want = target(step, pr0)
        for layer in (0, 1):
            assert stored[step, layer, "pr_k"] == pytest.approx(want[layer], rel=0.1)
