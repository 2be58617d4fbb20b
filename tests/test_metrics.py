"""Metrics against independent numpy/scipy computations and known cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch

from qkgeom.engine import metrics as M

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


def np_erank(s: np.ndarray) -> float:
    return float(np.exp(scipy.stats.entropy(s / s.sum())))


def np_token_erank(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The reference: numpy's SVD of each explicit row-centred ``S = Q K^T``, mean over B."""
    b, h = q.shape[:2]
    out = np.zeros((b, h))
    for bi in range(b):
        for hi in range(h):
            s_mat = q[bi, hi] @ k[bi, hi].T
            out[bi, hi] = np_erank(np.linalg.svd(s_mat - s_mat.mean(axis=1, keepdims=True),
                                                 compute_uv=False))
    return out.mean(0)


def _qk(b=2, h=3, t=24, dh=8, seed=0):
    g = np.random.default_rng(seed)
    return g.standard_normal((b, h, t, dh)), g.standard_normal((b, h, t, dh)) + 0.7


def test_token_erank_is_the_erank_of_the_row_centred_score_matrix():
    q, k = _qk()
    got = M.token_effective_rank(torch.tensor(q), torch.tensor(k)).numpy()
    np.testing.assert_allclose(got, np_token_erank(q, k), rtol=1e-10)
    # scale-free: the 1/sqrt(d_head) of the logits changes nothing
    got_scaled = M.token_effective_rank(torch.tensor(q) / 8 ** 0.5, torch.tensor(k)).numpy()
    np.testing.assert_allclose(got_scaled, got, rtol=1e-12)
    # float32 input is computed in float64
    got32 = M.token_effective_rank(torch.tensor(q).float(), torch.tensor(k).float())
    assert got32.dtype == torch.float64


@pytest.mark.parametrize("t,dh", [(5, 8), (8, 8), (40, 4)])
def test_token_erank_shapes_around_d_head(t, dh):
    """Fewer tokens than d_head (R is [T, dh]), square, and many tokens."""
    q, k = _qk(t=t, dh=dh, seed=t)
    got = M.token_effective_rank(torch.tensor(q), torch.tensor(k)).numpy()
    np.testing.assert_allclose(got, np_token_erank(q, k), rtol=1e-10)


def test_token_erank_ignores_per_row_constants():
    """S + c 1^T in factor form is [Q, c] [K, 1]^T: same value (softmax ignores it too),
    also for constants 1e4 times the scores; the explicit matrix agrees."""
    q, k = _qk(seed=1)
    base = M.token_effective_rank(torch.tensor(q), torch.tensor(k)).numpy()
    ones = np.ones(q.shape[:-1] + (1,))
    for scale in (1.0, 1e4):
        c = RNG.standard_normal(q.shape[:-1] + (1,)) * scale
        qa, ka = np.concatenate([q, c], -1), np.concatenate([k, ones], -1)
        got = M.token_effective_rank(torch.tensor(qa), torch.tensor(ka)).numpy()
        np.testing.assert_allclose(got, base, rtol=1e-9)
        np.testing.assert_allclose(np_token_erank(qa, ka), base, rtol=1e-6)  # explicit S


def test_token_erank_at_most_the_rank():
    t, dh = 32, 8
    for r in (1, 2, 3, 5):
        q = RNG.standard_normal((1, 2, t, r)) @ RNG.standard_normal((r, dh))  # rank r
        k = RNG.standard_normal((1, 2, t, dh))
        got = M.token_effective_rank(torch.tensor(q), torch.tensor(k)).numpy()
        assert (got <= r + 1e-9).all() and (got > 1 - 1e-9).all()
        np.testing.assert_allclose(got, np_token_erank(q, k), rtol=1e-8)
    # the old masked metric gave ~19.6 for a rank-1 64 x 64 logit matrix: this gives 1
    q1 = RNG.standard_normal((1, 1, 64, 1)) @ RNG.standard_normal((1, 8))
    got = float(M.token_effective_rank(torch.tensor(q1), torch.tensor(RNG.standard_normal(
        (1, 1, 64, 8))))[0])
    assert got == pytest.approx(1.0, abs=1e-9)


def test_token_erank_is_one_for_row_constant_scores():
    """Constant logits, per-row constants, zero queries or zero keys: exactly 1 (the floor)."""
    b, h, t, dh = 2, 2, 16, 4
    q = torch.tensor(RNG.standard_normal((b, h, t, dh)))
    same_key = torch.tensor(RNG.standard_normal((b, h, 1, dh)) * 0.1).expand(b, h, t, dh)
    cases = [
        (torch.full((b, h, t, 1), 0.3, dtype=torch.float64),  # S = 0.3 * 0.7 everywhere
         torch.full((b, h, t, 1), 0.7, dtype=torch.float64)),
        (q, same_key),  # S = (Q k) 1^T: one constant per row
        (torch.zeros_like(q), torch.tensor(RNG.standard_normal((b, h, t, dh)))),  # S = 0
        (q, torch.zeros_like(q)),
    ]
    for qq, kk in cases:
        assert torch.equal(M.token_effective_rank(qq, kk), torch.ones(h, dtype=torch.float64))
    # just above the floor's tolerance the value is an effective rank again
    k = same_key + 1e-6 * torch.tensor(RNG.standard_normal((b, h, t, dh)))
    assert (M.token_effective_rank(q, k) > 1.5).all()


def test_token_erank_grouped_keys_match_repeated_keys():
    b, h, nkv, t, dh = 2, 6, 2, 20, 8
    q = torch.tensor(RNG.standard_normal((b, h, t, dh)))
    k = torch.tensor(RNG.standard_normal((b, nkv, t, dh)))
    kv_of = torch.arange(h) // (h // nkv)
    got = M.token_effective_rank(q, k, kv_of).numpy()
    k_rep = k.repeat_interleave(h // nkv, dim=1)
    np.testing.assert_allclose(got, np_token_erank(q.numpy(), k_rep.numpy()), rtol=1e-10)
    with pytest.raises(ValueError, match="kv_of"):
        M.token_effective_rank(q, k)


def test_token_erank_drops_padding():
    """A right-padded sequence counts only its real tokens, as queries and as keys."""
    q, k = _qk(b=2, h=2, t=20, seed=3)
    real = np.ones((2, 20), dtype=bool)
    real[1, 13:] = False
    q_pad, k_pad = q.copy(), k.copy()
    q_pad[1, :, 13:], k_pad[1, :, 13:] = 50.0, -30.0  # junk at padding
    got = M.token_effective_rank(torch.tensor(q_pad), torch.tensor(k_pad),
                                 real=torch.tensor(real)).numpy()
    ref = (np_token_erank(q[:1], k[:1]) + np_token_erank(q[1:, :, :13], k[1:, :, :13])) / 2
    np.testing.assert_allclose(got, ref, rtol=1e-10)
    # a sequence without a real token is undefined
    real[1] = False
    got = M.token_effective_rank(torch.tensor(q), torch.tensor(k), real=torch.tensor(real))
    assert torch.isnan(got).all()


def test_token_erank_svds_are_d_head_sized(monkeypatch):
    """The factor form: every SVD is of a core at most d_head x d_head, never T x T."""
    seen = []
    svdvals = torch.linalg.svdvals

    def spy(a, *args, **kw):
        seen.append(tuple(a.shape[-2:]))
        return svdvals(a, *args, **kw)

    monkeypatch.setattr(torch.linalg, "svdvals", spy)
    q, k = _qk(t=64, dh=8)
    M.token_effective_rank(torch.tensor(q), torch.tensor(k))
    assert seen == [(8, 8)]


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
