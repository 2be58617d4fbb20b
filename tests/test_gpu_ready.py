"""GPU-ready trials: no host-device sync per step, one-transfer probes, fused AdamW, compile.

The CPU tests check that the device-side bookkeeping gives the numbers a plain Python
computation gives. The ``gpu`` tests count synchronisations with
``torch.cuda.set_sync_debug_mode`` (they need CUDA).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch


def _cfg(tiny_cfg, **kw):
    return tiny_cfg.with_overrides(kw)


def test_loss_sum_matches_a_python_float_sum():
    from qkgeom.engine.train import LossSum

    rng = np.random.default_rng(0)
    losses = rng.uniform(0.5, 6.0, size=37).astype(np.float32)
    acc = LossSum(torch.device("cpu"))
    ref = 0.0
    for v in losses:
        acc.add(torch.tensor(v))
        ref += float(v)
    assert acc.state() == [ref, 37]  # bit for bit: the same float64 additions
    assert acc.take() == (ref, 37) and acc.take() == (0.0, 0)


def test_train_history_is_the_mean_of_the_step_losses(tiny_cfg, corpus):
    """StepRecord.train_loss = mean of the losses train_step returned since the last one."""
    from qkgeom.engine.train import TrainingRun

    cfg = _cfg(tiny_cfg, max_steps=12, log_every=4)
    tr = TrainingRun(cfg, corpus)
    losses = [float(tr.train_step()) for _ in range(4)]
    s, n = tr.loss_acc.take()
    assert n == 4 and s / n == pytest.approx(sum(losses) / 4, rel=0, abs=1e-12)


def test_probe_rows_match_the_float_metrics(tiny_cfg, corpus):
    """The one-transfer probe gives what the float metric functions give, row by row."""
    from qkgeom.engine import metrics as M
    from qkgeom.engine.train import TrainingRun

    tr = TrainingRun(_cfg(tiny_cfg, max_steps=5), corpus)
    for _ in range(3):
        tr.train_step()
    rows = {(li, h, n): v for li, h, n, v in tr.probe(math.nan, 0.0).metrics}
    hs = tr.model.cfg.d_head
    for li, a in enumerate(tr.model.attn_layers()):
        wq, wk = a.q_proj.weight, a.k_proj.weight
        assert rows[(li, None, "pr_wk")] == M.weight_pr(wk)
        per_head = []
        for h in range(tr.model.cfg.n_head):
            sl = slice(h * hs, (h + 1) * hs)
            s = np.linalg.svd(wq[sl].detach().double().numpy().T @ wk[sl].detach().double()
                              .numpy(), compute_uv=False)  # the full d_model x d_model matrix
            lam = s[: hs] ** 2
            per_head.append(lam.sum() ** 2 / (lam * lam).sum())
            assert rows[(li, h, "qk_pr")] == pytest.approx(per_head[-1], rel=1e-9)
        assert rows[(li, None, "qk_pr")] == pytest.approx(np.mean(per_head), rel=1e-9)


def test_optimizer_is_fused_only_on_cuda(tiny_cfg, corpus):
    from qkgeom.engine.model import GPT
    from qkgeom.engine.train import make_optimizer

    opt = make_optimizer(tiny_cfg, GPT(tiny_cfg, corpus.vocab_size))
    assert not opt.defaults.get("fused")
    if torch.cuda.is_available():
        opt = make_optimizer(tiny_cfg, GPT(tiny_cfg, corpus.vocab_size).cuda())
        assert opt.defaults["fused"]


@pytest.mark.slow
def test_compile_flag_trains_like_eager(tiny_cfg, corpus):
    """``compile=True`` (torch.compile) gives the eager losses to float tolerance."""
    from qkgeom.engine.train import TrainingRun

    out = {}
    for flag in (False, True):
        tr = TrainingRun(_cfg(tiny_cfg, max_steps=4, compile=flag), corpus)
        out[flag] = [float(tr.train_step()) for _ in range(3)]
    assert out[True] == pytest.approx(out[False], rel=1e-4)


def _syncs(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_steps_do_not_wait_for_the_device(tiny_cfg, corpus):
    from qkgeom.engine.train import TrainingRun

    tr = TrainingRun(_cfg(tiny_cfg, device="cuda", max_steps=50), corpus)
    tr.train_step()  # warm-up (allocations, autotuning)
    assert _syncs(lambda: [tr.train_step() for _ in range(10)]) == 0
    n_layer = tr.model.cfg.n_layer
    # one read of all values, plus the linear algebra's own checks (QR/SVD per layer)
    assert _syncs(lambda: tr.probe(math.nan, 0.0)) <= 1 + 3 * n_layer


def test_gpu_study_without_cuda_says_so_and_exits_0():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    # no CUDA device visible to the child, also on a machine that has one (no skip there)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    p = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu_study.py")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().splitlines() == [
        "no CUDA: torch.cuda.is_available() is False on this machine; gpu_study.py measures "
        "nothing here (run it on a GPU machine)"]
