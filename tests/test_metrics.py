"""Metrics against independent numpy/scipy computations and known cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch

from qkgeom import metrics as M

RNG = np.random.default_rng(0)


def np_pr_eig(x: np.ndarray) -> float:
    c = np.cov(x, rowvar=False)
    lam = np.linalg.eigvalsh(c)
    return lam.sum() ** 2 / (lam**2).sum()


@pytest.mark.parametrize("n,d", [(500, 16), (10, 40), (64, 64)])
def test_activation_pr_matches_numpy_eigenvalues(n, d):
    x = RNG.standard_normal((n, d)) @ RNG.standard_normal((d, d))
    assert M.activation_pr(torch.tensor(x)) == pytest.approx(np_pr_eig(x), rel=1e-10)


def test_pr_known_cases():
    # isotropic spectrum -> d; one direction -> 1
    assert M.participation_ratio(torch.ones(37)) == pytest.approx(37)
    assert M.participation_ratio(torch.tensor([5.0, 0, 0, 0])) == pytest.approx(1.0)
    # isotropic activations -> PR close to d (finite-sample)
    x = torch.tensor(RNG.standard_normal((200_000, 8)))
    assert M.activation_pr(x) == pytest.approx(8, rel=1e-2)
    # rank-one activations -> exactly 1
    u = torch.tensor(RNG.standard_normal((1000, 1))) * torch.tensor(RNG.standard_normal((1, 12)))
    assert M.activation_pr(u) == pytest.approx(1.0, rel=1e-9)
    # an all-constant input has no spread: NaN, not a crash
    assert math.isnan(M.activation_pr(torch.ones(10, 3)))


def test_weight_pr_matches_svd():
    w = RNG.standard_normal((24, 40))
    s = np.linalg.svd(w, compute_uv=False)
    ref = (s**2).sum() ** 2 / (s**4).sum()
    assert M.weight_pr(torch.tensor(w)) == pytest.approx(ref, rel=1e-10)
    assert M.weight_pr(torch.tensor(w.T)) == pytest.approx(ref, rel=1e-10)
    assert M.spectrum_pr(torch.tensor(s)) == pytest.approx(ref, rel=1e-10)


def test_effective_rank_matches_scipy_entropy():
    s = np.abs(RNG.standard_normal(20))
    ref = np.exp(scipy.stats.entropy(s / s.sum()))
    assert M.effective_rank(torch.tensor(s)) == pytest.approx(ref, rel=1e-12)
    assert M.effective_rank(torch.tensor([3.0, 0.0, 0.0])) == pytest.approx(1.0)
    assert M.effective_rank(torch.ones(9)) == pytest.approx(9.0)


def test_interaction_spectrum_factored_equals_dense_svd():
    d_model, d_head = 48, 8
    wq = RNG.standard_normal((d_head, d_model))
    wk = RNG.standard_normal((d_head, d_model))
    dense = np.linalg.svd(wq.T @ wk, compute_uv=False)[:d_head]  # d_model x d_model
    got = M.interaction_singular_values(torch.tensor(wq), torch.tensor(wk)).numpy()
    np.testing.assert_allclose(got, dense, rtol=1e-10)
    # the factored matrix rebuilds the logits: x W_q^T W_k y == (W_q x) . (W_k y)
    x, y = RNG.standard_normal(d_model), RNG.standard_normal(d_model)
    assert x @ (wq.T @ wk) @ y == pytest.approx((wq @ x) @ (wk @ y))


def _np_entropy_rows(p: np.ndarray, vis: np.ndarray):
    """Reference: loop over rows, keep rows with >= 2 visible keys."""
    b, h, t, s = p.shape
    raw = np.zeros(h)
    norm = np.zeros(h)
    for hi in range(h):
        vals, nvals = [], []
        for bi in range(b):
            for ti in range(t):
                k = vis[ti].sum()
                if k < 2:
                    continue
                row = p[bi, hi, ti][vis[ti]]
                e = scipy.stats.entropy(row)
                vals.append(e)
                nvals.append(e / np.log(k))
        raw[hi], norm[hi] = np.mean(vals), np.mean(nvals)
    return raw, norm


def test_attention_entropy_matches_reference_and_uniform_is_log_k():
    b, h, t = 3, 2, 7
    vis = np.tril(np.ones((t, t), dtype=bool))
    logits = RNG.standard_normal((b, h, t, t)) * 2
    logits = np.where(vis, logits, -np.inf)
    p = scipy.special.softmax(logits, axis=-1)
    raw, norm = M.attention_entropy(torch.tensor(p), torch.tensor(vis))
    ref_raw, ref_norm = _np_entropy_rows(p, vis)
    np.testing.assert_allclose(raw.numpy(), ref_raw, rtol=1e-12)
    np.testing.assert_allclose(norm.numpy(), ref_norm, rtol=1e-12)
    # uniform attention over k visible keys has entropy log k in every row
    uni = np.where(vis, 1.0 / vis.sum(-1, keepdims=True), 0.0)[None, None]
    raw_u, norm_u = M.attention_entropy(torch.tensor(uni), torch.tensor(vis))
    k = np.arange(2, t + 1)
    assert float(raw_u[0]) == pytest.approx(np.log(k).mean(), rel=1e-12)
    assert float(norm_u[0]) == pytest.approx(1.0, rel=1e-12)


def test_attention_entropy_ignores_nan_in_masked_entries():
    t = 5
    vis = torch.ones(t, t, dtype=torch.bool).tril()
    p = torch.softmax(torch.randn(1, 1, t, t).masked_fill(~vis, float("-inf")), -1)
    p_bad = p.clone()
    p_bad[~vis.expand_as(p_bad)] = float("nan")
    raw, norm = M.attention_entropy(p_bad, vis)
    raw2, _ = M.attention_entropy(p, vis)
    assert torch.isfinite(raw).all() and torch.isfinite(norm).all()
    assert torch.allclose(raw, raw2)


def test_logit_effective_rank_matches_numpy():
    b, h, t = 2, 3, 6
    vis = np.tril(np.ones((t, t), dtype=bool))
    a = RNG.standard_normal((b, h, t, t))
    got = M.logit_effective_rank(torch.tensor(a), torch.tensor(vis)).numpy()
    ref = np.zeros(h)
    for hi in range(h):
        vals = []
        for bi in range(b):
            s = np.linalg.svd(np.where(vis, a[bi, hi], 0.0), compute_uv=False)
            vals.append(np.exp(scipy.stats.entropy(s / s.sum())))
        ref[hi] = np.mean(vals)
    np.testing.assert_allclose(got, ref, rtol=1e-10)


def test_streaming_covariance_equals_in_memory():
    x = RNG.standard_normal((5000, 20)) @ RNG.standard_normal((20, 20)) + 3.0
    sc = M.StreamingCovariance(20)
    for chunk in np.array_split(x, 17):
        sc.update(torch.tensor(chunk))
    np.testing.assert_allclose(sc.cov().numpy(), np.cov(x, rowvar=False), rtol=1e-9, atol=1e-12)
    assert sc.pr() == pytest.approx(np_pr_eig(x), rel=1e-9)


@pytest.mark.parametrize("d", [192, 290, 576])
def test_streaming_covariance_lower_blocks_equal_numpy(d):
    """Widths with several row blocks (the lower block triangle of ``x^T x`` only; uneven
    blocks at 290: 97, 96, 97), chunks of uneven size, against numpy's in-memory
    covariance."""
    x = RNG.standard_normal((1200, d)) @ RNG.standard_normal((d, d)) * 0.1 + 2.0
    sc = M.StreamingCovariance(d)
    assert len(sc._cuts) > 2  # more than one row block
    for chunk in np.array_split(x, [1, 400, 401, 1000]):
        sc.update(torch.tensor(chunk))
    ref = np.cov(x, rowvar=False)
    got = sc.cov().numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12 * np.abs(ref).max())
    np.testing.assert_array_equal(got, got.T)
    assert sc.pr() == pytest.approx(np_pr_eig(x), rel=1e-9)


def test_batched_spectrum_metrics_match_numpy_per_row():
    """The ``*_t`` forms over a batch (last axes) equal numpy on each member."""
    w = RNG.standard_normal((5, 8, 30))
    got = M.weight_pr_t(torch.tensor(w)).numpy()
    assert got.shape == (5,)
    for i in range(5):
        s = np.linalg.svd(w[i], compute_uv=False)
        assert got[i] == pytest.approx((s**2).sum() ** 2 / (s**4).sum(), rel=1e-10)
    s = np.abs(RNG.standard_normal((4, 12)))
    s[1, 3:] = 0.0
    er = M.effective_rank_t(torch.tensor(s)).numpy()
    pr = M.spectrum_pr_t(torch.tensor(s)).numpy()
    for i in range(4):
        assert er[i] == pytest.approx(np.exp(scipy.stats.entropy(s[i] / s[i].sum())), rel=1e-12)
        lam = s[i] ** 2
        assert pr[i] == pytest.approx(lam.sum() ** 2 / (lam**2).sum(), rel=1e-12)


def test_interaction_spectrum_grouped_keys_equals_dense_svd():
    """``kv_of``: 6 query heads over 2 key heads (each key head factored once) give the
    singular values of each head's dense ``W_q^T W_k`` product."""
    d_model, d_head, nh, nkv = 40, 6, 6, 2
    wq = RNG.standard_normal((nh, d_head, d_model))
    wk = RNG.standard_normal((nkv, d_head, d_model))
    kv_of = torch.arange(nh) // (nh // nkv)
    got = M.interaction_singular_values(torch.tensor(wq), torch.tensor(wk), kv_of).numpy()
    for h in range(nh):
        dense = np.linalg.svd(wq[h].T @ wk[h // 3], compute_uv=False)[:d_head]
        np.testing.assert_allclose(got[h], dense, rtol=1e-10)
    # a leading batch axis (two layers): kv_of still indexes the head axis
    lead = M.interaction_singular_values(torch.tensor(np.stack([wq, wq[::-1]])),
                                         torch.tensor(np.stack([wk, wk])), kv_of).numpy()
    np.testing.assert_allclose(lead[0], got, rtol=1e-12)
    np.testing.assert_allclose(lead[1, 0], np.linalg.svd(wq[5].T @ wk[0], compute_uv=False)
                               [:d_head], rtol=1e-10)
