"""Streaming per-layer query/key statistics: :class:`GeometryAccumulator`.

Fed one chunk of captured ``q`` / ``k`` per layer at a time (by :mod:`.capture` for
transformers models, by :mod:`.checkpoints` for qkgeom's own GPT), it keeps float64
covariances and running attention sums, so memory is ``O(n_layers d^2)`` however many
tokens stream through; :meth:`GeometryAccumulator.rows` turns them into metric rows.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from qkgeom.engine import metrics as M
from qkgeom.pretrained.base import DEFAULT_ERANK_SEQS
from qkgeom.records import Row

# Elements of one (B', H', T, S) logit block (16 MiB in float64): bounds the memory of the
# recomputed-softmax entropy.
_LOGIT_BLOCK = 1 << 21


@dataclass
class _LayerState:
    cov_q: M.StreamingCovariance
    cov_k: M.StreamingCovariance
    n_head: int
    n_kv: int
    d_head: int
    cov_q_pre: M.StreamingCovariance | None = None
    cov_k_pre: M.StreamingCovariance | None = None
    ent_sum: Tensor | None = None  # (H,) sum over counted rows of the row-mean entropy
    ent_norm_sum: Tensor | None = None
    ent_rows: Tensor | None = None  # (1|H,) query rows counted per head
    erank_sum: Tensor | None = None  # (H,) token_erank summed over sequences
    erank_n: int = 0


@contextlib.contextmanager
def lapack_threads(x: Tensor | None = None) -> Iterator[None]:
    """One intra-op thread for many small CPU LAPACK calls (svdvals, eigvalsh, qr).

    On a busy 2-core host, OpenMP-parallel ``svdvals`` of 256 x 256 matrices and
    ``eigvalsh`` of 64 x 64 blocks ran 5-30x slower than on one thread (docs/benchmarks.md);
    the BLAS-heavy steps (forward pass, covariance updates) keep all threads unless the host
    is oversubscribed (:func:`busy_host_threads`).
    """
    if (x is not None and x.device.type != "cpu") or torch.get_num_threads() == 1:
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def host_busy() -> bool:
    """More runnable work than cores: the 1-minute load average above ``cpu_count + 0.5``
    (this process's own threads count towards it, so a quiet host running the probe on
    every core reads about ``cpu_count``). False where the load average is unknown."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return False
    return load > (os.cpu_count() or 1) + 0.5


@contextlib.contextmanager
def busy_host_threads(x: Tensor | None = None) -> Iterator[None]:
    """One intra-op thread for the probe's own CPU work while the host is oversubscribed.

    Beside a running sweep on the 2-core machine (load average 4-5), two-thread OpenMP
    regions wait for descheduled threads: one layer's accumulator update of 4,096 SmolLM2
    tokens took 0.33 s on two threads and 0.08 s on one (best of 7), SmolLM2's weight spectra
    8-14 s against 0.6-0.8 s, and a whole 2,048-token probe 26-27 s against 20-22 s; the
    accumulator's rows came out identical, the weight spectra within 1.8e-15 relative
    (docs/benchmarks.md). On a quiet host every thread is kept (the weight
    spectra: 0.35 s against 0.52 s on one thread).
    """
    if (x is not None and x.device.type != "cpu") or not host_busy():
        yield
        return
    with lapack_threads():
        yield


def _entropy_sums(probs: Tensor, vis: Tensor) -> tuple[Tensor, Tensor]:
    """Per head, the sums over counted rows (>= 2 visible keys) of the row entropy (nats)
    and of the entropy over ``log k``, from ``(B, H, T, S)`` probabilities.

    ``p log p`` is formed and summed over a row in the probabilities' dtype (float32: within
    ~1e-6 nats of float64 for a 256-key row), rows are summed in float64. A counted row's
    masked keys hold exactly 0 (``exp`` of the mask's dtype minimum underflows), so no mask
    is applied to ``probs``; rows not counted (padding, < 2 keys) are dropped by ``vis``.
    """
    h_row = _row_entropy(probs, vis).double()  # (B, H, T)
    k = vis.sum(-1)  # (B, 1|H, T) visible keys per row
    use = k >= 2
    logk = torch.log(k.clamp_min(2).double())
    raw = torch.where(use, h_row, 0.0).sum(dim=(0, 2))
    norm = torch.where(use, h_row / logk, 0.0).sum(dim=(0, 2))
    return raw, norm


def _row_entropy(probs: Tensor, vis: Tensor, n_blocks: int = 4) -> Tensor:
    """``-sum p log p`` over each row of ``(B, H, T, S)`` probabilities, in their dtype.

    Under a causal mask the keys after a block of query rows are invisible to all of them
    (their probabilities are exactly 0, contributing nothing), so each of ``n_blocks`` row
    blocks is summed only up to its last visible key: about 3/8 less work at 4 blocks. A
    block with any visible key further right is summed over every key. On a GPU (where
    each block's check would wait for the device) every row is summed whole.
    """
    b, h, t, s = probs.shape
    if t != s or t < 2 * n_blocks or probs.device.type != "cpu":
        return -torch.special.xlogy(probs, probs).sum(-1)
    out = torch.empty(b, h, t, dtype=probs.dtype, device=probs.device)
    cuts = [round(i * t / n_blocks) for i in range(n_blocks + 1)]
    for a, z in zip(cuts[:-1], cuts[1:]):
        stop = z if z == s or not bool(vis[..., a:z, z:].any()) else s
        p = probs[..., a:z, :stop]
        out[..., a:z] = -torch.special.xlogy(p, p).sum(-1)
    return out


def _token_rows(x: Tensor, keep: Tensor | None) -> Tensor:
    """``(B, H, T, dh)`` -> float64 ``(N, H*dh)`` token rows (heads concatenated), rows where
    ``keep`` is False dropped; one copy when nothing is dropped."""
    b, nh, t, dh = x.shape
    out = torch.empty(b, t, nh, dh, dtype=torch.float64, device=x.device)
    out.copy_(x.transpose(1, 2))  # transpose and widen in one pass
    out = out.view(b * t, nh * dh)
    return out if keep is None else out[keep]


def _add_vectors(st: _LayerState, q: Tensor, k: Tensor, real: Tensor,
                 q_pre: Tensor | None, k_pre: Tensor | None) -> None:
    """Feed one chunk's q / k token vectors (padding dropped) into the layer's covariances."""
    b, t = q.shape[0], q.shape[2]
    s = k.shape[2]
    keep = real.reshape(-1)
    if keep.device.type == "cpu" and bool(keep.all()):
        keep = None  # no padding in this chunk: no row selection (a copy) needed
    st.cov_q.update(_token_rows(q, keep), consume=True)
    # keys longer than queries (not produced by our chunking): keep them all
    st.cov_k.update(_token_rows(k, keep if s == t else None), consume=True)
    if st.cov_q_pre is not None and q_pre is not None and k_pre is not None:
        qp, kp = q_pre.reshape(b * t, -1), k_pre.reshape(b * s, -1)
        st.cov_q_pre.update(qp if keep is None else qp[keep])
        st.cov_k_pre.update(kp[keep] if s == t and keep is not None else kp)


def _blocks(b: int, nh: int, t: int, s: int) -> Iterator[tuple[slice, slice]]:
    """(sequence, head) slices covering ``b`` x ``nh`` in blocks of at most
    ``_LOGIT_BLOCK`` logits each: the logits' memory stays flat in B, H and T."""
    bstep = max(1, min(b, _LOGIT_BLOCK // (t * s)))
    hstep = max(1, min(nh, _LOGIT_BLOCK // (bstep * t * s)))
    for b0 in range(0, b, bstep):
        for h0 in range(0, nh, hstep):
            yield slice(b0, min(b, b0 + bstep)), slice(h0, min(nh, h0 + hstep))


def _attention_sums(q: Tensor, k: Tensor, vis: Tensor, scaling: float, probs: Tensor | None,
                    n_er: int, real: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per head ``(H,)`` float64: the sums over counted query rows of the entropy and the
    normalised entropy, and the sum over the first ``n_er`` sequences of ``token_erank``.

    ``vis``: ``(B, 1|H, T, S)`` bool, padded query rows already removed. With the model's
    own ``probs`` the entropy comes from them; otherwise the softmax is recomputed in
    float64 from ``q`` and ``k``. ``token_erank``
    (:func:`qkgeom.engine.metrics.token_effective_rank`) comes from the ``d_head``-sized factors
    of ``q`` and ``k`` (grouped keys through ``kv_of``, padding dropped by ``real``), so no
    logits are formed for it.
    """
    b, nh, t, _ = q.shape
    nkv, s = k.shape[1], k.shape[2]
    ent = torch.zeros(nh, dtype=torch.float64, device=q.device)
    ent_n = torch.zeros(nh, dtype=torch.float64, device=q.device)
    er = torch.zeros(nh, dtype=torch.float64, device=q.device)

    if probs is not None:  # the model's own probabilities: no second softmax
        ent, ent_n = _entropy_sums(probs, vis)
    else:
        k_exp = k.repeat_interleave(nh // nkv, dim=1) if nkv != nh else k  # (B, H, S, dh)
        for bsl, hsl in _blocks(b, nh, t, s):
            v = vis[bsl] if vis.shape[1] == 1 else vis[bsl, hsl]  # (b', 1|h', T, S)
            logits = (q[bsl, hsl].double() @ k_exp[bsl, hsl].double().transpose(-2, -1))
            pattern = torch.softmax((logits * scaling).masked_fill(~v, float("-inf")), dim=-1)
            raw, norm = M.attention_entropy(pattern, v)  # (h',) row means
            r = (v.sum(-1) >= 2).sum(dim=(0, 2)).double()  # (1|h',) rows counted
            ent[hsl] += raw * r
            ent_n[hsl] += norm * r
            del pattern, logits
    if n_er:
        kv_of = (torch.arange(nh, device=q.device) // (nh // nkv)) if nkv != nh else None
        keep = real[:n_er] if s == t else None  # longer keys (not from our chunking): all kept
        with lapack_threads(q):  # many small QRs and SVDs: one thread each is faster
            er = M.token_effective_rank(q[:n_er], k[:n_er], kv_of, keep) * n_er
    return ent, ent_n, er


class GeometryAccumulator:
    """Streaming per-layer Q/K statistics over many chunks; :meth:`rows` gives metric rows.

    Call :meth:`update` once per layer and chunk. Memory is ``O(d^2)`` per layer (float64
    covariances on ``device``), independent of the number of tokens seen.
    """

    def __init__(self, *, erank_seqs: int = DEFAULT_ERANK_SEQS,
                 device: torch.device | str | None = None) -> None:
        self.layers: dict[int, _LayerState] = {}
        self.erank_seqs = erank_seqs
        self.device = device

    @torch.no_grad()
    def update(self, layer: int, q: Tensor, k: Tensor, visible: Tensor, scaling: float,
               real: Tensor | None = None, q_pre: Tensor | None = None,
               k_pre: Tensor | None = None, probs: Tensor | None = None) -> None:
        """Add one chunk of one layer.

        ``q``: ``(B, H, T, dh)`` queries; ``k``: ``(B, H_kv, S, dh)`` keys as the model uses
        them (post-rotary). ``visible``: bool, broadcastable to ``(B, H, T, S)``, True where a
        query may attend to a key. ``real``: ``(B, T)`` bool, False at padding (``T == S``);
        padded positions count neither as vectors nor as query rows. ``q_pre`` / ``k_pre``:
        ``(B, T, H*dh)`` / ``(B, S, H_kv*dh)`` pre-rotary projections (rotary models only).
        ``probs``: ``(B, H, T, S)`` float32/float64 attention probabilities the model itself
        computed from these ``q`` and ``k`` (its eager softmax). Given, the entropy comes from
        them (float64 sums) and no logits are formed at all (``token_erank`` of the first
        ``erank_seqs`` sequences comes from ``q`` and ``k`` themselves); otherwise the softmax
        is recomputed in float64 from ``q`` and ``k``. On a CPU the work runs on one
        intra-op thread while the host is oversubscribed (:func:`busy_host_threads`).
        """
        with busy_host_threads(q):
            self._update(layer, q, k, visible, scaling, real, q_pre, k_pre, probs)

    def _update(self, layer: int, q: Tensor, k: Tensor, visible: Tensor, scaling: float,
                real: Tensor | None, q_pre: Tensor | None, k_pre: Tensor | None,
                probs: Tensor | None) -> None:
        if probs is not None and probs.dtype not in (torch.float32, torch.float64):
            probs = None  # half-precision weights: recompute in float64 instead
        b, nh, t, _ = q.shape
        nkv, s = k.shape[1], k.shape[2]
        if nh % nkv:
            raise ValueError(f"{nh} query heads do not group over {nkv} key heads")
        st = self._layer(layer, q, k, q_pre, k_pre)
        if real is None:
            real = torch.ones(b, t, dtype=torch.bool, device=q.device)
        real = real.to(q.device, torch.bool)
        _add_vectors(st, q, k, real, q_pre, k_pre)

        # Attention from the captured vectors: the model's mask, minus padded query rows.
        vis = visible.to(q.device, torch.bool) & real[:, None, :, None]  # (B, 1|H, T, S)
        vis = vis.expand(b, vis.shape[1], t, s)
        rows = (vis.sum(-1) >= 2).sum(dim=(0, 2)).double()  # (1|H,) counted rows per head
        n_er = max(0, min(b, self.erank_seqs - st.erank_n))
        ent, ent_n, er = _attention_sums(q, k, vis, scaling, probs, n_er, real)
        if st.ent_sum is None:
            st.ent_sum, st.ent_norm_sum = ent, ent_n
            st.erank_sum, st.ent_rows = er, rows
        else:
            st.ent_sum += ent
            st.ent_norm_sum += ent_n
            st.erank_sum += er
            st.ent_rows = st.ent_rows + rows
        st.erank_n += n_er

    def _layer(self, layer: int, q: Tensor, k: Tensor, q_pre: Tensor | None,
               k_pre: Tensor | None) -> _LayerState:
        """The state of ``layer``, created (sized from this first chunk) if new."""
        st = self.layers.get(layer)
        if st is None:
            nh, dh, nkv = q.shape[1], q.shape[3], k.shape[1]
            dev = self.device if self.device is not None else q.device
            st = _LayerState(M.StreamingCovariance(nh * dh, dev), M.StreamingCovariance(
                nkv * dh, dev), nh, nkv, dh)
            if q_pre is not None:
                st.cov_q_pre = M.StreamingCovariance(q_pre.shape[-1], dev)
                st.cov_k_pre = M.StreamingCovariance(k_pre.shape[-1], dev)
            self.layers[layer] = st
        return st

    def rows(self) -> list[Row]:
        """Activation and attention metric rows (layer-level with head None, plus per head)."""
        with lapack_threads():
            return self._rows()

    def _rows(self) -> list[Row]:
        out: list[Row] = []
        for li in sorted(self.layers):
            st = self.layers[li]
            rep = st.n_head // st.n_kv
            pairs = [("pr_q", st.cov_q, st.n_head, 1), ("pr_k", st.cov_k, st.n_kv, rep)]
            if st.cov_q_pre is not None:
                pairs += [("pr_q_prerot", st.cov_q_pre, st.n_head, 1),
                          ("pr_k_prerot", st.cov_k_pre, st.n_kv, rep)]
            for name, cov, n_blocks, rep_h in pairs:
                if cov.n < 2:
                    out.append((li, None, name, math.nan))
                    continue
                c = cov.cov()
                out.append((li, None, name, _pr_of_cov(c)))
                dh = st.d_head
                for g in range(n_blocks):
                    v = _pr_of_cov(c[g * dh:(g + 1) * dh, g * dh:(g + 1) * dh])
                    out += [(li, g * rep_h + r, name, v) for r in range(rep_h)]
            n = st.ent_rows.cpu()  # rows with >= 2 visible keys; 0 -> NaN
            ent = torch.where(n > 0, st.ent_sum.cpu() / n.clamp_min(1), math.nan)
            ent_n = torch.where(n > 0, st.ent_norm_sum.cpu() / n.clamp_min(1), math.nan)
            er = (st.erank_sum.cpu() / st.erank_n if st.erank_n
                  else torch.full((st.n_head,), math.nan))
            for name, vals in (("entropy", ent), ("entropy_norm", ent_n), ("token_erank", er)):
                out += [(li, h, name, float(vals[h])) for h in range(st.n_head)]
                out.append((li, None, name, float(vals.mean())))
        return out


def _pr_of_cov(c: Tensor) -> float:
    """PR of a covariance without its spectrum: ``sum lam = tr C`` and ``sum lam^2 = ||C||_F^2``
    (NaN for a zero matrix)."""
    fro2 = float((c * c).sum())
    return math.nan if fro2 <= 0 else float(torch.diagonal(c).sum()) ** 2 / fro2
