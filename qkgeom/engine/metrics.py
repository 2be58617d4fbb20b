"""Geometry metrics: pure functions over tensors (no model, database or Ray here).

Conventions (TransformerLens-style): ``x`` rows are tokens; a linear projection's torch
weight ``W`` has shape ``[d_out, d_in]`` and computes ``x @ W.T``. For head ``h`` the query
weight rows ``W_q[h*d_head:(h+1)*d_head]`` give ``W_Q^h = W_q_h.T`` of shape
``[d_model, d_head]``; the pre-softmax logits are ``x W_Q^h (W_K^h)^T x^T / sqrt(d_head)``,
so the head's *interaction matrix* is ``W_Q^h (W_K^h)^T`` (``[d_model, d_model]``, rank at
most ``d_head``). It is never materialised: its singular values come from a
``d_head x d_head`` core (see :func:`interaction_singular_values`).

Everything is computed in float64 so that a bf16/fp32 model still gives stable ratios.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


# ---------------------------------------------------------------------- heads
def split_heads(w: Tensor, n_head: int) -> Tensor:
    """A projection's torch weight ``[n_head * d_head, d_in]`` as ``[n_head, d_head, d_in]``.

    Row block ``h`` (``w[h*d_head:(h+1)*d_head]``) becomes ``out[h]``: the head axis is real
    (TransformerLens-style) instead of a slice at every use. A view of ``w`` whenever its
    layout allows (always for a contiguous weight), so writing into it under ``no_grad``
    writes the weight; otherwise a copy.
    """
    if w.shape[0] % n_head:
        raise ValueError(f"{w.shape[0]} rows do not split into {n_head} heads")
    return w.reshape(n_head, w.shape[0] // n_head, w.shape[-1])


# ---------------------------------------------------------------------- spectra
# Each metric has a ``*_t`` form returning a float64 tensor on the input's device (0-d for
# one spectrum or matrix; one value per batch member for leading axes), with no host-device
# sync (a probe reads all of them at once), and a float form for a single input. An
# undefined value (all-zero input) is 0/0 = NaN in both.
def participation_ratio_t(lam: Tensor) -> Tensor:
    """Over the last axis: ``[..., n] -> [...]`` (a batch of spectra in one call)."""
    lam = lam.detach().double().clamp_min(0)
    return lam.sum(-1) ** 2 / (lam * lam).sum(-1)


def participation_ratio(lam: Tensor) -> float:
    """PR of a non-negative spectrum: ``(sum lam)^2 / sum lam^2``; 1 (one direction) .. len.

    Tiny negative eigenvalues from round-off are clipped to 0. An all-zero spectrum
    has no defined PR and gives NaN.
    """
    return float(participation_ratio_t(lam))


def effective_rank_t(s: Tensor) -> Tensor:
    """Over the last axis: ``[..., n] -> [...]``."""
    s = s.detach().double().clamp_min(0)
    p = s / s.sum(-1, keepdim=True)
    return torch.exp(-torch.special.xlogy(p, p).sum(-1))


def effective_rank(s: Tensor) -> float:
    """Effective rank ``exp(H(s / sum s))`` of singular values ``s`` (Roy & Vetterli 2007).

    Zero entries contribute nothing (0 log 0 = 0). All-zero input gives NaN.
    """
    return float(effective_rank_t(s))


def activation_pr_t(x: Tensor) -> Tensor:
    x = x.detach().reshape(-1, x.shape[-1]).double()
    xc = x - x.mean(dim=0, keepdim=True)
    gram = xc @ xc.T if xc.shape[0] < xc.shape[1] else xc.T @ xc  # same non-zero spectrum
    return torch.diagonal(gram).sum() ** 2 / (gram * gram).sum()


def activation_pr(x: Tensor) -> float:
    """PR of the covariance of activations ``x [N, d]`` (rows mean-centred here).

    Uses ``PR = tr(C)^2 / ||C||_F^2``, which equals the eigenvalue formula without an
    eigendecomposition; when ``N < d`` the Gram matrix ``Xc Xc^T`` (same non-zero
    spectrum) keeps the cost at ``O(N^2 d)``.
    """
    return float(activation_pr_t(x))


def weight_pr_t(w: Tensor) -> Tensor:
    """Over the last two axes: ``[..., r, c] -> [...]`` (e.g. every head of a layer)."""
    w = w.detach().double()
    g = w @ w.mT if w.shape[-2] <= w.shape[-1] else w.mT @ w
    return torch.diagonal(g, dim1=-2, dim2=-1).sum(-1) ** 2 / (g * g).sum((-2, -1))


def weight_pr(w: Tensor) -> float:
    """PR of the squared singular values of ``w``: ``||W||_F^4 / ||W W^T||_F^2``."""
    return float(weight_pr_t(w))


def spectrum_pr_t(s: Tensor) -> Tensor:
    return participation_ratio_t(s.double() ** 2)


def spectrum_pr(s: Tensor) -> float:
    """PR of squared singular values ``s`` (the weight-spectrum PR given ``s``)."""
    return float(spectrum_pr_t(s))


def interaction_singular_values(w_q_h: Tensor, w_k_h: Tensor,
                                kv_of: Tensor | None = None) -> Tensor:
    """Singular values of the head interaction matrix ``W_q_h^T W_k_h``, in factored form.

    ``w_q_h``, ``w_k_h``: ``[..., d_head, d_model]`` (the head's rows of the torch weights;
    leading dimensions, e.g. heads, are a batch: one QR and one SVD call for all).
    With ``W_q_h^T = Q1 R1`` and ``W_k_h^T = Q2 R2`` (thin QR, ``R`` of size
    ``d_head x d_head``), ``W_q_h^T W_k_h = Q1 (R1 R2^T) Q2^T`` and the orthonormal
    factors leave singular values unchanged: only a ``d_head x d_head`` SVD is needed.
    Only ``R`` is formed (``mode="r"``: no orthonormal factor is built). ``kv_of``: with
    grouped keys, ``w_k_h`` holds the ``H_kv`` key heads and query head ``h`` pairs with key
    head ``kv_of[h]`` (an index into the head axis, the third from the end), so each key
    head is factored once.
    Returns ``[..., d_head]`` singular values in descending order.
    """
    # (..., d_model, d_head) -> r1 (..., dh, dh)
    r1 = torch.linalg.qr(w_q_h.detach().double().mT, mode="r").R
    r2 = torch.linalg.qr(w_k_h.detach().double().mT, mode="r").R
    if kv_of is not None:
        r2 = r2.index_select(-3, kv_of)  # the head axis, whatever leads it
    return torch.linalg.svdvals(r1 @ r2.mT)


# ---------------------------------------------------------------------- attention
def causal_visible(t: int, device: torch.device | None = None) -> Tensor:
    """``[T, T]`` bool mask: query ``i`` sees keys ``0..i``."""
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()


def attention_entropy(pattern: Tensor, visible: Tensor) -> tuple[Tensor, Tensor]:
    """Mean attention entropy per head, raw (nats) and normalised by ``log k``.

    ``pattern``: ``[B, H, T, S]`` probabilities (rows sum to 1 over visible keys).
    ``visible``: bool mask broadcastable to ``[B, H, T, S]`` (e.g. causal ``[T, S]`` or a
    padding mask ``[B, 1, 1, S]``); ``k`` = visible keys of a row. Only rows with ``k >= 2``
    count (a single visible key has zero entropy by construction). Masked entries are
    ignored even when they hold NaN or are exactly 0, so no NaN reaches the result.
    Returns two ``[H]`` float64 tensors.
    """
    p = pattern.detach().double()
    vis = visible.to(torch.bool).expand_as(p)
    p = torch.where(vis, p, torch.zeros((), dtype=p.dtype, device=p.device))
    h_row = -torch.special.xlogy(p, p).sum(-1)  # (B, H, T)
    k = vis.sum(-1)  # (B, H, T) visible keys per row
    use = k >= 2
    logk = torch.log(k.clamp_min(2).double())
    n = use.sum(dim=(0, 2)).clamp_min(1).double()  # rows counted per head
    raw = torch.where(use, h_row, 0.0).sum(dim=(0, 2)) / n
    norm = torch.where(use, h_row / logk, 0.0).sum(dim=(0, 2)) / n
    return raw, norm


# A head whose centred scores are at most this fraction of its scores (Frobenius norms) has
# rows that are constant up to round-off: its softmax is uniform and token_effective_rank
# gives the effective rank's floor, 1 (see there).
TOKEN_ERANK_FLAT_RTOL = 1e-10


def token_effective_rank(q: Tensor, k: Tensor, kv_of: Tensor | None = None,
                         real: Tensor | None = None) -> Tensor:
    """Effective rank of each head's token-level interaction, mean over the batch: ``[H]``.

    Per sequence and head the score matrix is ``S = Q K^T`` (``[T, S]``, unmasked, unscaled:
    the effective rank ``exp(H(s / sum s))`` of the singular values ``s`` is scale-free, so
    ``1/sqrt(d_head)`` does not matter). Softmax ignores a constant added to a row of logits,
    so the part of ``S`` that can move attention is the row-centred ``S J``
    (``J = I - 11^T / S`` centres over keys), and ``S J = Q K_c^T`` with the keys centred
    over the sequence, ``K_c = K - mean_t K``. The value is the effective rank of ``S J``:

    * invariant to per-row additive constants of the logits (``S + c 1^T`` centres to the
      same ``S J``), hence to the causal mask's offsets and to anything else softmax ignores
      row by row;
    * at most ``rank(S J) <= rank(S) <= d_head`` (for a rank-``r`` score matrix, at most
      ``r`` up to round-off);
    * exactly 1 when every row of ``S`` is constant (constant logits: uniform attention).
      There ``S J`` is 0, its normalised spectrum is 0/0; the value is defined as 1, the
      effective rank's floor (one direction, the most concentrated interaction), because
      the limit of a vanishing perturbation could be anything and a row-constant head is the
      least rich interaction there is. "Constant" means ``||S J||_F <=``
      :data:`TOKEN_ERANK_FLAT_RTOL` ``* ||S||_F``, which covers the round-off of centring
      identical keys (and ``S = 0``).

    The causal mask is not applied: the metric describes what the head's queries and keys
    can express over the whole sequence, not which of those entries a query may use.

    Computed from ``d_head``-sized factors, never a ``T x T`` matrix: with thin QR
    ``Q = U_q R_q`` and ``K_c = U_k R_k`` (``mode="r"``: only ``R``, ``[min(T, dh), dh]``),
    ``S J = U_q (R_q R_k^T) U_k^T`` has the singular values of the small core
    ``R_q R_k^T``. ``||S||_F^2 = ||S J||_F^2 + n ||R_q m||^2`` (``m`` the key mean, ``n`` the
    keys) gives the constant-rows test without the uncentred keys' factor. float64.

    ``q``: ``[B, H, T, dh]``; ``k``: ``[B, H_kv, S, dh]``, the vectors that meet in the
    attention product (post-rotary for rotary models). ``kv_of``: with grouped keys
    (``H_kv < H``), query head ``h`` pairs with key head ``kv_of[h]`` (each key head is
    factored once); ``None`` pairs head ``h`` with ``h``. ``real``: ``[B, T]`` bool, False
    at padding (needs ``S == T``): padded positions drop out as queries and as keys (the key
    mean is over real keys). A sequence without a real token has no score matrix: NaN,
    which then makes its heads' batch mean NaN.
    """
    q = q.detach().double()
    k = k.detach().double()
    b, nh, t, _ = q.shape
    nkv, s_len = k.shape[1], k.shape[2]
    if kv_of is None and nkv != nh:
        raise ValueError(f"{nh} query heads and {nkv} key heads need kv_of")
    if real is None:
        n = torch.full((b, 1), float(s_len), dtype=torch.float64, device=q.device)
        mean = k.mean(-2, keepdim=True)  # (B, H_kv, 1, dh)
        kc = k - mean
    else:
        if s_len != t:
            raise ValueError(f"real masks {t} positions but there are {s_len} keys")
        w = real.to(q.device, torch.float64)  # (B, T)
        n = w.sum(-1, keepdim=True)  # (B, 1) real tokens per sequence
        w4 = w[:, None, :, None]
        mean = (k * w4).sum(-2, keepdim=True) / n.clamp_min(1)[:, :, None, None]
        kc = (k - mean) * w4  # padded keys are 0: they add nothing to Q K_c^T
        q = q * w4  # and so are padded queries
    r_q = torch.linalg.qr(q, mode="r").R  # (B, H, min(T, dh), dh)
    r_k = torch.linalg.qr(kc, mode="r").R  # (B, H_kv, min(S, dh), dh)
    if kv_of is not None:
        r_k = r_k.index_select(-3, kv_of)
        mean = mean.index_select(-3, kv_of)
    sv = torch.linalg.svdvals(r_q @ r_k.mT)  # (B, H, min(T, S, dh))
    centred2 = (sv * sv).sum(-1)  # ||S J||_F^2
    whole2 = centred2 + n * (r_q @ mean.mT).square().sum((-2, -1))  # ||S||_F^2
    er = effective_rank_t(sv)
    flat = centred2 <= TOKEN_ERANK_FLAT_RTOL ** 2 * whole2  # rows constant (or S = 0)
    er = torch.where(flat, torch.ones_like(er), er)
    if real is not None:
        er = torch.where(n > 0, er, torch.full_like(er, math.nan))
    return er.mean(0)


# ---------------------------------------------------------------------- streaming
class StreamingCovariance:
    """Covariance of a stream of ``[N, d]`` chunks, accumulated in float64.

    Keeps ``n``, ``sum x`` and ``sum x x^T`` (shifted by the first chunk's mean for
    numerical stability), so memory is ``O(d^2)`` whatever the number of tokens. Only the
    lower block triangle of ``s2`` is accumulated, in ``nb`` row blocks (the product is
    symmetric): ``(nb - 1) / (2 nb)`` of the full ``x^T x`` work saved, 25% at d = 192,
    42% at d = 576, 44% from d = 768. :meth:`cov` mirrors it. The block products may
    differ from the full one at float64 round-off.
    """

    def __init__(self, d: int, device: torch.device | str | None = None) -> None:
        self.d = d
        self.n = 0
        self.shift: Tensor | None = None
        self.s1 = torch.zeros(d, dtype=torch.float64, device=device)
        self.s2 = torch.zeros(d, d, dtype=torch.float64, device=device)  # lower block triangle
        nb = min(8, max(1, d // 96))  # row blocks: ~d/6 wide at d = 576, one below d = 192
        self._cuts = [round(i * d / nb) for i in range(nb + 1)]

    def update(self, x: Tensor, *, consume: bool = False) -> None:
        """Add the rows of ``x``. ``consume``: the caller gives ``x`` away (a float64 tensor
        it will not read again), so the shift is subtracted in place, without a copy."""
        x = x.detach().reshape(-1, self.d)
        own = consume and x.dtype == torch.float64 and x.device == self.s1.device
        x = x.to(self.s1.device, torch.float64)
        if x.shape[0] == 0:
            return
        if self.shift is None:
            self.shift = x.mean(0)
        xs = x.sub_(self.shift) if own else x - self.shift
        self.n += x.shape[0]
        self.s1 += xs.sum(0)
        c = self._cuts
        for a, b in zip(c[:-1], c[1:]):  # rows a:b, columns 0:b of xs^T xs
            self.s2[a:b, :b].addmm_(xs[:, a:b].T, xs[:, :b])

    def cov(self) -> Tensor:
        """Unbiased covariance ``[d, d]`` (divides by ``n - 1``)."""
        if self.n < 2:
            raise ValueError("need at least two rows for a covariance")
        mean = self.s1 / self.n
        s2 = self.s2.tril() + self.s2.tril(-1).T
        return (s2 - self.n * torch.outer(mean, mean)) / (self.n - 1)

    def pr(self) -> float:
        c = self.cov()
        fro2 = (c * c).sum()
        return math.nan if fro2 <= 0 else float(torch.diagonal(c).sum() ** 2 / fro2)
