"""The key-spectrum arms: targets hit, singular vectors kept, Frobenius norm preserved."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qkgeom.config import TrialConfig
from qkgeom.engine.intervention import (
    KeySpectrumControl,
    reshape_singular_values,
    schedule_factor,
    solve_power,
)
from qkgeom.engine.metrics import weight_pr
from qkgeom.engine.model import GPT

RNG = np.random.default_rng(1)


def np_pr_sq(s):
    s2 = np.asarray(s) ** 2
    return s2.sum() ** 2 / (s2**2).sum()


@pytest.mark.parametrize("target", [1.5, 5.0, 20.0, 40.0])
def test_reshape_hits_target_and_keeps_norm(target):
    s = np.sort(np.abs(RNG.standard_normal(48)))[::-1] * 0.3
    new = reshape_singular_values(torch.tensor(s)[None], torch.tensor([target]))[0].numpy()
    assert np_pr_sq(new) == pytest.approx(target, rel=1e-6)
    assert np.linalg.norm(new) == pytest.approx(np.linalg.norm(s), rel=1e-12)
    assert (np.diff(new) <= 1e-15).all()  # order (hence the singular vectors' roles) kept


def test_warm_started_solve_matches_the_grid_search():
    """The previous step's exponents as ``start``: Newton from there lands on the grid
    search's root; a start that cannot reach it (an unreachable target) falls back."""
    w = torch.tensor(np.sort(np.abs(RNG.standard_normal((3, 40))), -1)[:, ::-1] ** 2)
    target = torch.tensor([2.5, 7.0, 15.0], dtype=torch.float64)
    grid = solve_power(w, target)
    for start, rel in ((grid * 1.002, 1e-10), (grid - 0.002, 1e-10), (grid * 1.5, 1e-6)):
        warm = solve_power(w, target, start=start)
        prs = [np_pr_sq(np.sqrt(w[i].numpy()) ** float(warm[i])) for i in range(3)]
        assert prs == pytest.approx(target.tolist(), rel=rel)  # 1e-10: Newton's precision
        assert warm.tolist() == pytest.approx(grid.tolist(), rel=1e-6)
    # a target above the rank is unreachable: Newton cannot land on it, the grid clips
    over = torch.tensor([50.0, 7.0, 15.0], dtype=torch.float64)
    assert solve_power(w, over, start=grid).tolist() == solve_power(w, over).tolist()


def test_unreachable_targets_clip_to_the_reachable_range():
    w = torch.tensor([[4.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    p_hi = solve_power(w, torch.tensor([10.0], dtype=torch.float64))  # above 3 non-zero
    assert float(p_hi) == pytest.approx(0.0, abs=1e-9)
    p_lo = solve_power(w, torch.tensor([0.5], dtype=torch.float64))  # below PR 1
    assert float(p_lo) == pytest.approx(64.0, abs=1e-9)  # the end of the search range
    # a tied largest entry: PR(w**p) never goes below its multiplicity 2
    p_tie = solve_power(torch.tensor([[4.0, 4.0, 1.0]], dtype=torch.float64),
                        torch.tensor([1.2], dtype=torch.float64))
    assert float(p_tie) == pytest.approx(64.0, abs=1e-9)
    # as singular values: above the rank -> every non-zero value equal (PR = rank 3), the
    # zero stays zero and the norm is kept; below 1 -> s**64, closed form
    s = torch.tensor([[2.0, 1.0, 0.5, 0.0]], dtype=torch.float64)
    flat = reshape_singular_values(s, torch.tensor([10.0]))[0].numpy()
    norm = float(s.norm())
    assert flat == pytest.approx([norm / np.sqrt(3)] * 3 + [0.0], rel=1e-9, abs=1e-12)
    sharp = reshape_singular_values(s, torch.tensor([0.5]))[0].numpy()
    want = s[0].numpy() ** 64
    assert sharp == pytest.approx(want * norm / np.linalg.norm(want), rel=1e-9, abs=1e-300)
    assert np_pr_sq(sharp) == pytest.approx(np_pr_sq(s[0].numpy() ** 64), rel=1e-9)


def test_unreachable_absolute_target_through_the_arm():
    """shrink_to = 0.5 (absolute) is below any PR: W_K gets its singular values to the
    power 64, the steepest map the arm can apply, rather than failing."""
    m, ctl = model_with("shrink", target_mode="absolute", shrink_to=0.5,
                        shrink_schedule="constant")
    s0 = [np.linalg.svd(a.k_proj.weight.detach().double().numpy(), compute_uv=False)
          for a in m.attn_layers()]
    ctl.after_step(1)
    assert ctl.targets_now() == pytest.approx([0.5, 0.5])
    for a, s in zip(m.attn_layers(), s0):
        got = np.linalg.svd(a.k_proj.weight.detach().double().numpy(), compute_uv=False)
        assert np_pr_sq(got) == pytest.approx(np_pr_sq(s**64), rel=1e-4)
        assert 1.0 <= np_pr_sq(got) < 2.0


def model_with(arm: str, **kw) -> tuple[GPT, KeySpectrumControl]:
    cfg = TrialConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, arm=arm, max_steps=100, **kw)
    torch.manual_seed(0)
    m = GPT(cfg, vocab_size=30)
    return m, KeySpectrumControl(cfg, m)


def perturb(m: GPT) -> None:
    """Stand in for an optimizer step that sharpens the key spectrum."""
    with torch.no_grad():
        for a in m.attn_layers():
            w = a.k_proj.weight
            u, s, vh = torch.linalg.svd(w)
            a.k_proj.weight.copy_(u @ torch.diag(s * torch.linspace(3, 0.2, len(s))) @ vh)


@pytest.mark.parametrize("arm,step", [("hold", 10), ("shrink", 50), ("shrink", 100)])
def test_arm_sets_weight_pr_to_target_with_same_singular_vectors(arm, step):
    m, ctl = model_with(arm, shrink_to=0.4)
    pr0 = [weight_pr(a.k_proj.weight) for a in m.attn_layers()]
    perturb(m)
    before = [a.k_proj.weight.detach().double().clone() for a in m.attn_layers()]
    ctl.after_step(step)
    expected = pr0 if arm == "hold" else [p * (1 + (0.4 - 1) * step / 100) for p in pr0]
    for a, w0, tgt, t_used in zip(m.attn_layers(), before, expected, ctl.targets_now()):
        w1 = a.k_proj.weight.detach().double()
        assert t_used == pytest.approx(tgt, rel=1e-12)
        assert weight_pr(w1) == pytest.approx(tgt, rel=1e-3)
        assert float(w1.norm()) == pytest.approx(float(w0.norm()), rel=1e-5)
        u0, _, v0 = torch.linalg.svd(w0)
        u1, _, v1 = torch.linalg.svd(w1)
        # same singular vectors up to sign: |<u0_i, u1_i>| = 1 (top directions, distinct values)
        cos_u = (u0[:, :8] * u1[:, :8]).sum(0).abs()
        cos_v = (v0[:8] * v1[:8]).sum(1).abs()
        assert torch.allclose(cos_u, torch.ones(8, dtype=cos_u.dtype), atol=1e-4)
        assert torch.allclose(cos_v, torch.ones(8, dtype=cos_v.dtype), atol=1e-4)


def test_none_arm_changes_nothing():
    m, ctl = model_with("none")
    w = m.blocks[0].attn.k_proj.weight.detach().clone()
    ctl.after_step(5)
    assert torch.equal(w, m.blocks[0].attn.k_proj.weight)
    assert ctl.targets_now() is None


def closed_form_g(sched: str, f: float, t: float, start: float = 0.0) -> float:
    """The schedule factor g at training fraction t, written out per schedule."""
    if sched == "constant":
        return f
    u = min(max((t - start) / (1 - start), 0.0), 1.0)
    return {"linear": 1 + (f - 1) * u,
            "cosine": 1 + (f - 1) * (1 - np.cos(np.pi * u)) / 2,
            "exp": f**u}[sched]


@pytest.mark.parametrize("sched", ["linear", "cosine", "exp", "constant"])
@pytest.mark.parametrize("start", [0.0, 0.5])
def test_schedule_values_in_closed_form(sched, start):
    cfg = TrialConfig(arm="shrink", shrink_to=0.25, shrink_schedule=sched, max_steps=200,
                      shrink_start=start)
    for step in (0, 25, 50, 99, 100, 101, 125, 150, 175, 200, 250):
        want = closed_form_g(sched, 0.25, step / 200, start)
        assert schedule_factor(cfg, step) == pytest.approx(want, rel=1e-12), step
    if sched != "constant" and start == 0.5:
        # nothing moves before shrink_start; halfway through the rest it is at u = 1/2
        assert schedule_factor(cfg, 100) == 1.0
        assert schedule_factor(cfg, 150) == pytest.approx(
            {"linear": 0.625, "cosine": 0.625, "exp": 0.5}[sched], rel=1e-12)


def test_shrink_start_in_every_target_mode():
    m, ctl = model_with("shrink", shrink_to=0.5, shrink_start=0.4)  # init_fraction, linear
    assert ctl.target(40, [20.0]) == pytest.approx([20.0])
    assert ctl.target(70, [20.0]) == pytest.approx([15.0])  # u = 0.5
    assert ctl.target(100, [20.0]) == pytest.approx([10.0])
    m, ctl = model_with("shrink", target_mode="absolute", shrink_to=4.0, shrink_start=0.4)
    assert ctl.target(30, [20.0]) == pytest.approx([20.0])
    assert ctl.target(70, [20.0]) == pytest.approx([12.0])
    base = [[0, [30.0, 20.0]], [100, [10.0, 4.0]]]
    m, ctl = model_with("shrink", target_mode="baseline_fraction", shrink_to=0.5,
                        shrink_start=0.4, baseline_pr=base)
    # before shrink_start the target follows the baseline itself (g = 1)
    assert ctl.target(20, [99.0, 99.0]) == pytest.approx([26.0, 16.8])
    # u = 0.5 -> g = 0.75 of the baseline interpolated at step 70 (16, 8.8)
    assert ctl.target(70, [99.0, 99.0]) == pytest.approx([12.0, 6.6])
    m, ctl = model_with("hold", shrink_to=0.5, shrink_start=0.4)
    assert ctl.target(90, [20.0, 7.0]) == [20.0, 7.0]  # hold ignores the schedule


def test_schedules_start_at_one_and_end_at_fraction():
    for sched in ("linear", "cosine", "exp"):
        cfg = TrialConfig(arm="shrink", shrink_to=0.25, shrink_schedule=sched, max_steps=200)
        assert schedule_factor(cfg, 0) == pytest.approx(1.0)
        assert schedule_factor(cfg, 200) == pytest.approx(0.25)
        mid = schedule_factor(cfg, 100)
        assert 0.25 < mid < 1.0
    assert schedule_factor(TrialConfig(shrink_schedule="exp", shrink_to=0.25, max_steps=200),
                           100) == pytest.approx(0.5)


def test_absolute_and_baseline_targets():
    m, ctl = model_with("shrink", target_mode="absolute", shrink_to=3.0)
    assert ctl.target(100, [20.0]) == pytest.approx([3.0])
    assert ctl.target(50, [20.0]) == pytest.approx([11.5])
    base = [[0, [30.0, 20.0]], [100, [10.0, 4.0]]]
    m, ctl = model_with("shrink", target_mode="baseline_fraction", shrink_to=0.5,
                        shrink_schedule="constant", baseline_pr=base)
    assert ctl.target(50, [99.0, 99.0]) == pytest.approx([10.0, 6.0])


def test_activation_site_shapes_key_covariance_towards_target():
    cfg = TrialConfig(n_layer=1, n_embd=32, n_head=4, block_size=16, arm="shrink",
                      site="activation", shrink_to=0.3, shrink_schedule="constant",
                      max_steps=10, act_momentum=0.5)
    torch.manual_seed(0)
    m = GPT(cfg, vocab_size=30)
    ctl = KeySpectrumControl(cfg, m)
    x = torch.randint(0, 30, (8, 16))
    m.train()
    m(x)
    ctl.after_step(1)  # sets pr0 from the key covariance and builds the map
    tgt = ctl.targets_now()[0]
    assert tgt == pytest.approx(0.3 * ctl.shapers[0].pr0)
    got = {}
    m.blocks[0].attn.hook_k.register_forward_hook(lambda mod, i, o: got.__setitem__("k", o))
    m.eval()
    m(x)
    k = got["k"].transpose(1, 2).reshape(-1, 32).double()
    # the shaped keys' covariance, measured under the same running statistics, is on target
    from qkgeom.engine.metrics import participation_ratio

    sh = ctl.shapers[0]
    c_shaped = sh.a.T @ sh.cov @ sh.a
    assert participation_ratio(torch.linalg.eigvalsh(c_shaped)) == pytest.approx(tgt, rel=1e-3)
    assert torch.isfinite(k).all()


def test_shrink_act_follows_each_layers_baseline_key_pr():
    """shrink_act = shrink at the activation site; with a baseline_fraction target each
    layer follows its own baseline PR_K, and the shaped covariance A^T C A is the power map
    c * lam**p of C's spectrum with the target PR and the same trace (numpy reference)."""
    base = [[0, [20.0, 12.0]], [100, [6.0, 3.0]]]
    cfg = TrialConfig(n_layer=2, n_embd=32, n_head=4, block_size=16, arm="shrink_act",
                      target_mode="baseline_fraction", baseline_pr=base, shrink_to=0.5,
                      shrink_schedule="linear", max_steps=100, act_momentum=0.5)
    assert cfg.site == "activation"  # the arm name fixes the site
    torch.manual_seed(0)
    m = GPT(cfg, vocab_size=30)
    ctl = KeySpectrumControl(cfg, m)
    assert ctl.pr0 is None and len(ctl.shapers) == 2  # W_K is never touched
    wk = [a.k_proj.weight.detach().clone() for a in m.attn_layers()]
    m.train()
    m(torch.randint(0, 30, (8, 16)))
    ctl.after_step(50)
    # g(50) = 1 + (0.5 - 1) * 0.5 = 0.75; baseline at step 50 = (13, 7.5)
    assert ctl.targets_now() == pytest.approx([0.75 * 13.0, 0.75 * 7.5])
    for sh, a, w0 in zip(ctl.shapers, m.attn_layers(), wk):
        assert torch.equal(a.k_proj.weight, w0)
        c = sh.cov.numpy()
        lam = np.clip(np.linalg.eigvalsh(c), 0, None)
        amat = sh.a.numpy()
        lam_new = np.sort(np.linalg.eigvalsh(amat.T @ c @ amat))
        assert lam_new.sum() ** 2 / (lam_new**2).sum() == pytest.approx(sh.target, rel=1e-4)
        assert lam_new.sum() == pytest.approx(lam.sum(), rel=1e-8)
        # a power map (monotone, so both ascending spectra pair up): log lam' is a straight
        # line in log lam, with slope p > 1 (a contraction)
        keep = lam > lam.max() * 1e-6
        x, y = np.log(lam[keep]), np.log(lam_new[keep])
        slope, icpt = np.polyfit(x, y, 1)
        assert slope > 1 and np.abs(y - (slope * x + icpt)).max() < 1e-6


def test_shrink_act_state_round_trips():
    cfg = TrialConfig(n_layer=1, n_embd=16, n_head=2, block_size=8, arm="shrink_act",
                      shrink_to=0.5, max_steps=10)
    torch.manual_seed(0)
    m = GPT(cfg, vocab_size=20)
    ctl = KeySpectrumControl(cfg, m)
    m(torch.randint(0, 20, (4, 8)))
    ctl.after_step(5)
    m2 = GPT(cfg, vocab_size=20)
    ctl2 = KeySpectrumControl(cfg, m2)
    ctl2.load_state_dict(ctl.state_dict())
    assert ctl2.targets_now() == ctl.targets_now()
    assert torch.equal(ctl2.shapers[0].a, ctl.shapers[0].a)
