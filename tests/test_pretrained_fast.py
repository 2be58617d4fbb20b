"""The cheaper numeric paths of the pretrained probe, against numpy float64 references.

* entropy from the model's own float32 probabilities (float64 sums) vs a float64 numpy
  softmax of the same logits;
* ``token_erank`` from the accumulator (grouped keys, padding, sequences split over chunks)
  vs numpy's SVD of each real sequence's explicit row-centred score matrix;
* the accumulator fed probabilities vs the same accumulator recomputing the softmax.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qkgeom import pretrained as P
from qkgeom.engine import metrics as M
from qkgeom.pretrained.accumulate import _entropy_sums, _pr_of_cov


def _np_entropy(logits: np.ndarray, vis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per head: sums over rows with >= 2 visible keys of H (nats) and of H / log k."""
    with np.errstate(divide="ignore", invalid="ignore"):  # fully masked (padded) rows
        x = np.where(vis, logits, -np.inf)
        x = x - x.max(-1, keepdims=True)
        e = np.where(vis, np.exp(x), 0.0)
        p = e / e.sum(-1, keepdims=True)
        h = -np.where(p > 0, p * np.log(p), 0.0).sum(-1)  # (B, H, T)
    k = vis.sum(-1)
    use = k >= 2
    return (np.where(use, h, 0).sum((0, 2)),
            np.where(use, h / np.log(np.maximum(k, 2)), 0).sum((0, 2)))


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, h, t, dh = 3, 4, 40, 16
    q, k = torch.randn(b, h, t, dh, generator=g) * 2, torch.randn(b, h, t, dh, generator=g)
    real = torch.ones(b, t, dtype=torch.bool)
    real[2, 29:] = False  # a right-padded sequence
    vis = M.causal_visible(t)[None, None] & real[:, None, None, :] & real[:, None, :, None]
    logits = (q.double() @ k.double().transpose(-2, -1)) * dh ** -0.5
    return q, k, real, vis, logits


def test_entropy_from_float32_probabilities_matches_float64_numpy():
    _, _, _, vis, logits = _case()
    v = vis.expand(logits.shape)
    probs = torch.softmax(logits.float().masked_fill(~v, float("-inf")), -1)  # eager: fp32
    raw, norm = _entropy_sums(probs, vis)
    ref_raw, ref_norm = _np_entropy(logits.numpy(), v.numpy())
    rows = (v.sum(-1) >= 2).sum((0, 2)).numpy()
    np.testing.assert_allclose(raw.numpy() / rows, ref_raw / rows, atol=1e-6, rtol=0)
    np.testing.assert_allclose(norm.numpy() / rows, ref_norm / rows, atol=1e-6, rtol=0)


def _np_token_erank(q: np.ndarray, k: np.ndarray) -> float:
    """numpy's SVD of the explicit ``S - S.mean(axis=1)``, ``S = q k^T``: exp of the entropy."""
    sm = q @ k.T
    s = np.linalg.svd(sm - sm.mean(axis=1, keepdims=True), compute_uv=False)
    p = s / s.sum()
    return float(np.exp(-np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum()))


@pytest.mark.parametrize("n_kv", [4, 2])
def test_accumulator_token_erank_matches_numpy_over_chunks_and_padding(n_kv):
    """The first ``erank_seqs`` sequences, across two chunks, the padded one counting only
    its real tokens; query head h meets key head h // (H / H_kv)."""
    q, k, real, vis, _ = _case(1)  # sequence 2 is padded after 29 tokens
    k = k[:, :n_kv]
    acc = P.GeometryAccumulator(erank_seqs=3)
    for sl in (slice(0, 2), slice(2, 4)):  # chunks of 2 and 1 sequences
        acc.update(0, q[sl], k[sl], vis[sl], 0.25, real=real[sl])
    rows = {(la, h): v for la, h, n, v in acc.rows() if n == "token_erank"}
    nh, rep = q.shape[1], q.shape[1] // n_kv
    ref = np.zeros(nh)
    for h in range(nh):
        for bi in range(3):
            n = int(real[bi].sum())
            ref[h] += _np_token_erank(q[bi, h, :n].double().numpy(),
                                      k[bi, h // rep, :n].double().numpy()) / 3
        assert rows[(0, h)] == pytest.approx(ref[h], rel=1e-10)
    assert rows[(0, None)] == pytest.approx(ref.mean(), rel=1e-10)
    none = P.GeometryAccumulator(erank_seqs=0)
    none.update(0, q, k, vis, 0.25, real=real)
    assert all(np.isnan(v) for *_, n, v in none.rows() if n == "token_erank")


def test_busy_host_runs_the_accumulator_on_one_thread_with_the_same_rows(monkeypatch):
    from qkgeom.pretrained import accumulate as A

    q, k, real, vis, _ = _case(3)
    k = k[:, :2]
    quiet = P.GeometryAccumulator(erank_seqs=2)
    monkeypatch.setattr(A.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert not A.host_busy()
    quiet.update(0, q, k, vis, 0.25, real=real)
    seen = []
    sums = A._attention_sums

    def spy(*args):
        seen.append(torch.get_num_threads())
        return sums(*args)

    monkeypatch.setattr(A, "_attention_sums", spy)
    monkeypatch.setattr(A.os, "getloadavg", lambda: (40.0, 40.0, 40.0))
    assert A.host_busy()
    n = torch.get_num_threads()
    busy = P.GeometryAccumulator(erank_seqs=2)
    busy.update(0, q, k, vis, 0.25, real=real)
    assert seen == [1] and torch.get_num_threads() == n  # restored afterwards
    for (*key, va), (*_, vb) in zip(quiet.rows(), busy.rows()):
        assert va == pytest.approx(vb, rel=1e-12, nan_ok=True), key
    monkeypatch.setattr(A.os, "getloadavg", lambda: (_ for _ in ()).throw(OSError()))
    assert not A.host_busy()  # unknown load: every thread


@pytest.mark.parametrize("n_kv", [4, 2])
def test_accumulator_with_probabilities_equals_recomputed_softmax(n_kv):
    q, k, real, vis, _ = _case(2)
    k = k[:, :n_kv]
    k_exp = k.repeat_interleave(4 // n_kv, dim=1)
    logits = (q @ k_exp.transpose(-2, -1)) * 0.25
    probs = torch.softmax(logits.masked_fill(~vis.expand(logits.shape), float("-inf")), -1)
    a, b = P.GeometryAccumulator(erank_seqs=2), P.GeometryAccumulator(erank_seqs=2)
    a.update(0, q, k, vis, 0.25, real=real)
    b.update(0, q, k, vis, 0.25, real=real, probs=probs)
    ra, rb = a.rows(), b.rows()
    assert [r[:3] for r in ra] == [r[:3] for r in rb]
    for (*key, va), (*_, vb) in zip(ra, rb):
        tol = 2e-6 if key[2].startswith("entropy") else 1e-12
        assert va == pytest.approx(vb, abs=tol, nan_ok=True), key


def test_pr_from_trace_and_frobenius_matches_numpy_eigenvalues():
    g = np.random.default_rng(3)
    x = g.standard_normal((500, 12)) @ g.standard_normal((12, 12)) + 3.0
    c = np.cov(x, rowvar=False)
    ev = np.clip(np.linalg.eigvalsh(c), 0, None)
    assert _pr_of_cov(torch.from_numpy(c)) == pytest.approx(
        ev.sum() ** 2 / (ev ** 2).sum(), rel=1e-12)
    assert np.isnan(_pr_of_cov(torch.zeros(3, 3, dtype=torch.float64)))


def test_accumulator_covariances_equal_numpy_with_and_without_padding():
    """The float64 token rows (one widening copy; padded rows dropped only when a chunk has
    padding) give numpy's covariance of the real tokens, heads concatenated."""
    q, k, real, vis, _ = _case(4)
    k = k[:, :2]  # grouped keys: 2 key heads
    for r in (real, torch.ones_like(real)):
        acc = P.GeometryAccumulator(erank_seqs=0)
        acc.update(0, q, k, vis & r[:, None, None, :], 0.25, real=r)
        st = acc.layers[0]
        for x, cov in ((q, st.cov_q), (k, st.cov_k)):
            rows = x.double().permute(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)
            ref = np.cov(rows[r].numpy(), rowvar=False)
            assert cov.n == int(r.sum())
            np.testing.assert_allclose(cov.cov().numpy(), ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("t", [64, 61])
@pytest.mark.parametrize("pattern", ["causal", "bidirectional", "prefix"])
def test_row_entropy_by_blocks_equals_numpy(pattern, t):
    """Row entropies summed block by block (keys after a causal block skipped) equal numpy's
    float64 entropy of every row, for masks where the skip applies and where it must not
    (all keys visible; a prefix of 20 keys visible to every row)."""
    from qkgeom.pretrained.accumulate import _row_entropy

    g = torch.Generator().manual_seed(5)
    b, h = 2, 3  # t = 61: blocks of 15, 15, 16, 15 rows
    z = torch.randn(b, h, t, t, generator=g) * 3
    vis = torch.ones(t, t, dtype=torch.bool)
    if pattern != "bidirectional":
        vis = vis.tril()
    if pattern == "prefix":
        vis[:, :20] = True
    probs = torch.softmax(z.masked_fill(~vis, torch.finfo(torch.float32).min), -1)
    got = _row_entropy(probs, vis[None, None]).double().numpy()
    p = probs.double().numpy()
    ref = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(-1)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6)
    whole = -torch.special.xlogy(probs, probs).sum(-1)  # the unblocked float32 sum
    np.testing.assert_allclose(got, whole.double().numpy(), rtol=0, atol=1e-6)
