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


def logit_effective_rank(logits: Tensor, visible: Tensor) -> Tensor:
    """Effective rank of each head's token-level logit matrix, mean over the batch.

    ``logits``: ``[B, H, T, S]`` pre-softmax scores; masked entries (``~visible``) are set
    to 0 before the SVD, so a causal matrix is lower-triangular. Returns ``[H]``.
    """
    a = logits.detach().double()
    a = torch.where(visible.to(torch.bool).expand_as(a), a, torch.zeros((), dtype=a.dtype))
    s = torch.linalg.svdvals(a)  # (B, H, min(T, S))
    total = s.sum(-1, keepdim=True)
    p = s / total.clamp_min(1e-300)
    er = torch.exp(-torch.special.xlogy(p, p).sum(-1))  # (B, H)
    er = torch.where(total.squeeze(-1) > 0, er, torch.full_like(er, math.nan))
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
