"""Token-level query/key geometry of pretrained transformers and of qkgeom's own checkpoints.

The same metrics as a qkgeom probe (:data:`qkgeom.records.METRICS`), measured on a fixed
text sample (default: the WikiText test text) and streamed over chunks of it, so the token
budget is bounded by time, not memory:

* ``pr_q`` / ``pr_k``: PR of the mean-centred query/key vectors, from a float64
  :class:`~qkgeom.metrics.StreamingCovariance` per layer (heads concatenated; a head's value
  is the PR of its ``d_head x d_head`` diagonal block). Memory is ``O(n_layers d^2)``, flat
  in the number of tokens. For rotary models these are the vectors *after* the rotary
  embedding (the ones that meet in ``q k^T``); ``pr_q_prerot`` / ``pr_k_prerot`` hold the
  projections before it.
* ``entropy`` / ``entropy_norm``: softmax of ``q k^T * scale`` with the model's own mask
  (causal for decoders; bidirectional with the padding mask for encoders), recomputed from
  the captured ``q`` and ``k`` and averaged over every counted query row of every chunk.
* ``logit_erank``: effective rank of the masked logit matrix, mean over the first
  ``erank_seqs`` sequences (an SVD per head and sequence is the costliest metric).
* ``pr_wq``, ``pr_wk``, ``qk_pr``, ``qk_erank``: weight spectra; the interaction spectrum of
  ``W_Q^h (W_K^h)^T`` in factored form (for rotary models: the position-0 interaction).

Grouped-query attention: each query head ``h`` pairs with key head ``h // (H / H_kv)``,
exactly as the model's ``repeat_kv`` does; per-head key metrics repeat the shared key head's
value. The layer-level ``pr_k`` of the expanded keys equals that of the ``H_kv`` distinct
heads (duplicating blocks scales every eigenvalue by ``H / H_kv``; PR is scale-free), so the
smaller covariance is accumulated.

Capture works through transformers' public ``AttentionInterface``: the model runs with a
registered implementation ``"qkgeom"`` that records (``query``, ``key``, mask, ``scaling``)
exactly as the model hands them to attention, then delegates to the model's own eager
attention. Pre-rotary projections come from forward hooks on the projection modules.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from qkgeom import metrics as M
from qkgeom.errors import QkgeomError

Row = tuple[int, "int | None", str, float]
Progress = Callable[[int, int, dict], None]  # (tokens done, tokens total, info)

ATTN_IMPL = "qkgeom"  # the name registered in transformers' AttentionInterface
DEFAULT_MAX_TOKENS = 131_072
DEFAULT_SEQ_LEN = 256  # the paper's context; entropy grows with the keys visible
DEFAULT_CHUNK_TOKENS = 4096
DEFAULT_ERANK_SEQS = 8  # an SVD per head and sequence: the costliest metric
# Elements of one float64 (B', H', T, S) logit block (16 MiB): bounds the entropy step's memory.
_LOGIT_BLOCK = 1 << 21


class PretrainedError(QkgeomError):
    """A pretrained model, checkpoint or text could not be loaded or measured."""


# ====================================================================== accumulation
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
    erank_sum: Tensor | None = None  # (H,) sum over sequences
    erank_n: int = 0


@contextlib.contextmanager
def _lapack_threads(x: Tensor | None = None) -> Iterator[None]:
    """One intra-op thread for many small CPU LAPACK calls (svdvals, eigvalsh, qr).

    On a busy 2-core host, OpenMP-parallel ``svdvals`` of 256 x 256 logit matrices and
    ``eigvalsh`` of 64 x 64 blocks ran 5-30x slower than on one thread (docs/benchmarks.md);
    the BLAS-heavy steps (forward pass, covariance updates) keep all threads.
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


def _entropy_sums(probs: Tensor, vis: Tensor) -> tuple[Tensor, Tensor]:
    """Per head, the sums over counted rows (>= 2 visible keys) of the row entropy (nats)
    and of the entropy over ``log k``, from ``(B, H, T, S)`` probabilities.

    ``p log p`` is formed and summed over a row in the probabilities' dtype (float32: within
    ~1e-6 nats of float64 for a 256-key row), rows are summed in float64. A counted row's
    masked keys hold exactly 0 (``exp`` of the mask's dtype minimum underflows), so no mask
    is applied to ``probs``; rows not counted (padding, < 2 keys) are dropped by ``vis``.
    """
    h_row = -torch.special.xlogy(probs, probs).sum(-1).double()  # (B, H, T)
    k = vis.sum(-1)  # (B, 1|H, T) visible keys per row
    use = k >= 2
    logk = torch.log(k.clamp_min(2).double())
    raw = torch.where(use, h_row, 0.0).sum(dim=(0, 2))
    norm = torch.where(use, h_row / logk, 0.0).sum(dim=(0, 2))
    return raw, norm


_POOL: list[Any] = []


def _eigvalsh_parallel(g: Tensor) -> Tensor:
    """``eigvalsh`` of a batch of small symmetric matrices, the batch split over one-thread
    workers (as many as torch's intra-op threads): LAPACK's ``syevd`` on a 256 x 256 matrix
    barely uses a second thread, so parallel matrices beat a parallel matrix (~1.5x on
    2 cores)."""
    n = torch.get_num_threads()
    flat = g.reshape(-1, *g.shape[-2:])
    if g.device.type != "cpu" or n == 1 or flat.shape[0] < 2:
        return torch.linalg.eigvalsh(g)
    if not _POOL:
        from concurrent.futures import ThreadPoolExecutor

        _POOL.append(ThreadPoolExecutor(max_workers=n, thread_name_prefix="qkgeom-eig"))
    parts = flat.chunk(min(n, flat.shape[0]))
    with _lapack_threads():
        lam = torch.cat(list(_POOL[0].map(torch.linalg.eigvalsh, parts)))
    return lam.reshape(*g.shape[:-1])


def logit_erank_gram(logits: Tensor, visible: Tensor) -> Tensor:
    """:func:`qkgeom.metrics.logit_effective_rank` through the Gram matrix: the singular
    values of the masked ``A`` are the square roots of the eigenvalues of ``A^T A``
    (``eigvalsh`` of a symmetric matrix: cheaper than ``svdvals``, and it threads).

    float64 throughout; eigenvalues below round-off are clipped to 0. Returns ``[H]``, the
    mean over the batch of ``exp(H(s / sum s))`` (NaN for an all-zero matrix).
    """
    a = logits.detach().double()
    a = torch.where(visible.to(torch.bool).expand_as(a), a, torch.zeros((), dtype=a.dtype,
                                                                         device=a.device))
    lam = _eigvalsh_parallel(a.transpose(-2, -1) @ a)  # (B, H, S) ascending
    s = lam.clamp_min(0).sqrt()
    total = s.sum(-1, keepdim=True)
    p = s / total.clamp_min(1e-300)
    er = torch.exp(-torch.special.xlogy(p, p).sum(-1))  # (B, H)
    er = torch.where(total.squeeze(-1) > 0, er, torch.full_like(er, math.nan))
    return er.mean(0)


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
        them (float64 sums) and logits are formed only for the ``logit_erank`` sequences;
        otherwise the softmax is recomputed in float64 from ``q`` and ``k``.
        """
        if probs is not None and probs.dtype not in (torch.float32, torch.float64):
            probs = None  # half-precision weights: recompute in float64 instead
        b, nh, t, dh = q.shape
        nkv, s = k.shape[1], k.shape[2]
        if nh % nkv:
            raise ValueError(f"{nh} query heads do not group over {nkv} key heads")
        st = self.layers.get(layer)
        if st is None:
            dev = self.device if self.device is not None else q.device
            st = _LayerState(M.StreamingCovariance(nh * dh, dev), M.StreamingCovariance(
                nkv * dh, dev), nh, nkv, dh)
            if q_pre is not None:
                st.cov_q_pre = M.StreamingCovariance(q_pre.shape[-1], dev)
                st.cov_k_pre = M.StreamingCovariance(k_pre.shape[-1], dev)
            self.layers[layer] = st
        if real is None:
            real = torch.ones(b, t, dtype=torch.bool, device=q.device)
        real = real.to(q.device, torch.bool)
        keep = real.reshape(-1)
        # (B, T, H*dh) token rows, padding dropped
        st.cov_q.update(q.transpose(1, 2).reshape(b * t, nh * dh)[keep])
        if s == t:
            st.cov_k.update(k.transpose(1, 2).reshape(b * s, nkv * dh)[keep])
        else:  # keys longer than queries (not produced by our chunking): keep them all
            st.cov_k.update(k.transpose(1, 2).reshape(b * s, nkv * dh))
        if st.cov_q_pre is not None and q_pre is not None and k_pre is not None:
            st.cov_q_pre.update(q_pre.reshape(b * t, -1)[keep])
            st.cov_k_pre.update(k_pre.reshape(b * s, -1)[keep] if s == t
                                else k_pre.reshape(b * s, -1))

        # Attention from the captured vectors: the model's mask, minus padded query rows.
        vis = visible.to(q.device, torch.bool) & real[:, None, :, None]  # (B, 1|H, T, S)
        vis = vis.expand(b, vis.shape[1], t, s)
        k_exp = k.repeat_interleave(nh // nkv, dim=1) if nkv != nh else k  # (B, H, S, dh)
        rows = (vis.sum(-1) >= 2).sum(dim=(0, 2)).double()  # (1|H,) counted rows per head
        ent = torch.zeros(nh, dtype=torch.float64, device=q.device)
        ent_n = torch.zeros(nh, dtype=torch.float64, device=q.device)
        n_er = max(0, min(b, self.erank_seqs - st.erank_n))
        er = torch.zeros(nh, dtype=torch.float64, device=q.device)
        if probs is not None:  # the model's own probabilities: no second softmax
            ent, ent_n = _entropy_sums(probs, vis)
        # (batch, head) blocks of at most _LOGIT_BLOCK logits: memory flat in B, H and T
        b_log = b if probs is None else n_er  # with probs, logits only for logit_erank
        bstep = max(1, min(b, _LOGIT_BLOCK // (t * s)))
        hstep = max(1, min(nh, _LOGIT_BLOCK // (bstep * t * s)))
        for b0 in range(0, b_log, bstep):
            bsl = slice(b0, min(b_log, b0 + bstep))
            n_er_blk = max(0, min(bsl.stop, n_er) - b0)  # erank sequences in this block
            for h0 in range(0, nh, hstep):
                hsl = slice(h0, min(nh, h0 + hstep))
                v = vis[bsl] if vis.shape[1] == 1 else vis[bsl, hsl]  # (b', 1|h', T, S)
                qb = q[bsl, hsl].double()  # (b', h', T, dh)
                logits = (qb @ k_exp[bsl, hsl].double().transpose(-2, -1)) * scaling
                if probs is None:
                    pattern = torch.softmax(logits.masked_fill(~v, float("-inf")), dim=-1)
                    raw, norm = M.attention_entropy(pattern, v)  # (h',) row means
                    r = (v.sum(-1) >= 2).sum(dim=(0, 2)).double()  # (1|h',) rows counted
                    ent[hsl] += raw * r
                    ent_n[hsl] += norm * r
                    del pattern
                if n_er_blk:
                    er[hsl] += logit_erank_gram(logits[:n_er_blk], v[:n_er_blk]) * n_er_blk
                del logits
        if st.ent_sum is None:
            st.ent_sum, st.ent_norm_sum = ent, ent_n
            st.erank_sum, st.ent_rows = er, rows
        else:
            st.ent_sum += ent
            st.ent_norm_sum += ent_n
            st.erank_sum += er
            st.ent_rows = st.ent_rows + rows
        st.erank_n += n_er

    def rows(self) -> list[Row]:
        """Activation and attention metric rows (layer-level with head None, plus per head)."""
        with _lapack_threads():
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
            for name, vals in (("entropy", ent), ("entropy_norm", ent_n), ("logit_erank", er)):
                out += [(li, h, name, float(vals[h])) for h in range(st.n_head)]
                out.append((li, None, name, float(vals.mean())))
        return out


def _pr_of_cov(c: Tensor) -> float:
    """PR of a covariance without its spectrum: ``sum lam = tr C`` and ``sum lam^2 = ||C||_F^2``
    (NaN for a zero matrix)."""
    fro2 = float((c * c).sum())
    return math.nan if fro2 <= 0 else float(torch.diagonal(c).sum()) ** 2 / fro2


def weight_rows_from(qk: Sequence[tuple[Tensor, Tensor]], n_head: int, n_kv: int) -> list[Row]:
    """Weight-spectrum rows from per-layer ``(W_q, W_k)`` torch weights.

    ``W_q``: ``[H*dh, d_model]``; ``W_k``: ``[H_kv*dh, d_model]``. Query head ``h`` pairs with
    key head ``h // (H / H_kv)``. Layer rows: PR of the whole matrices; mean over heads of the
    interaction PR and effective rank.
    """
    with _lapack_threads():
        return _weight_rows(qk, n_head, n_kv)


def _weight_rows(qk: Sequence[tuple[Tensor, Tensor]], n_head: int, n_kv: int) -> list[Row]:
    rows: list[Row] = []
    rep = n_head // n_kv
    for li, (wq, wk) in enumerate(qk):
        wq, wk = wq.detach().double().cpu(), wk.detach().double().cpu()
        dh = wq.shape[0] // n_head
        rows += [(li, None, "pr_wq", M.weight_pr(wq)), (li, None, "pr_wk", M.weight_pr(wk))]
        qk_pr, qk_er = [], []
        for h in range(n_head):
            wq_h = wq[h * dh:(h + 1) * dh]
            g = h // rep
            wk_h = wk[g * dh:(g + 1) * dh]
            s = M.interaction_singular_values(wq_h, wk_h)
            qk_pr.append(M.spectrum_pr(s))
            qk_er.append(M.effective_rank(s))
            rows += [(li, h, "pr_wq", M.weight_pr(wq_h)), (li, h, "pr_wk", M.weight_pr(wk_h)),
                     (li, h, "qk_pr", qk_pr[-1]), (li, h, "qk_erank", qk_er[-1])]
        rows += [(li, None, "qk_pr", sum(qk_pr) / len(qk_pr)),
                 (li, None, "qk_erank", sum(qk_er) / len(qk_er))]
    return rows


# ====================================================================== text
def default_text() -> Path:
    """The WikiText test text: ``$QKGEOM_DATA/wiki.test.raw``, the cache, or a download."""
    from qkgeom import data

    cands = []
    env = os.environ.get("QKGEOM_DATA")
    if env:
        cands.append(Path(env) / "wiki.test.raw" if Path(env).is_dir() else Path(env))
    cands += [data.cache_dir() / n / "wiki.test.raw" for n in ("wikitext-103", "wikitext-2")]
    for c in cands:
        if c.is_file():
            return c
    try:
        return data._download("wikitext-103") / "wiki.test.raw"
    except QkgeomError as e:
        raise PretrainedError(f"no default text: pass --text PATH (e.g. wiki.test.raw) or set "
                              f"QKGEOM_DATA to a WikiText directory. ({e})") from None


def read_text(path: str | Path | None) -> tuple[str, Path]:
    p = default_text() if path is None else Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise PretrainedError(f"cannot read --text {p}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise PretrainedError(f"--text {p} is not UTF-8 text") from None
    if not text.strip():
        raise PretrainedError(f"--text {p} is empty")
    return text, p


def tokenize_text(tokenizer: Any, text: str, max_tokens: int | None,
                  block_chars: int = 1 << 16) -> list[int]:
    """Token ids of ``text`` (no special tokens), tokenized in newline-aligned blocks."""
    ids: list[int] = []
    pos = 0
    while pos < len(text) and (max_tokens is None or len(ids) < max_tokens):
        end = min(len(text), pos + block_chars)
        if end < len(text):
            nl = text.rfind("\n", pos, end)
            end = nl + 1 if nl > pos else end
        ids += tokenizer(text[pos:end], add_special_tokens=False, verbose=False)["input_ids"]
        pos = end
    return ids if max_tokens is None else ids[:max_tokens]


def special_affixes(tokenizer: Any) -> tuple[list[int], list[int]]:
    """The ids the tokenizer adds around a text (e.g. ``[BOS]``, or ``[CLS]`` ... ``[SEP]``)."""
    bare = tokenizer("hello", add_special_tokens=False)["input_ids"]
    full = tokenizer("hello", add_special_tokens=True)["input_ids"]
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return list(full[:i]), list(full[i + len(bare):])
    return [], []


def windows(ids: Sequence[int], seq_len: int, prefix: Sequence[int] = (),
            suffix: Sequence[int] = ()) -> list[list[int]]:
    """Split ``ids`` into sequences of at most ``seq_len`` tokens including the affixes."""
    body = seq_len - len(prefix) - len(suffix)
    if body < 1:
        raise PretrainedError(f"--seq-len {seq_len} leaves no room for text tokens")
    return [list(prefix) + list(ids[i:i + body]) + list(suffix)
            for i in range(0, len(ids), body)]


def batches(seqs: list[list[int]], batch_size: int, pad_id: int) -> Iterator[tuple[Tensor, Tensor]]:
    """``(input_ids, attention_mask)`` batches, right-padded to the longest sequence."""
    for i in range(0, len(seqs), batch_size):
        part = seqs[i:i + batch_size]
        t = max(len(s) for s in part)
        ids = torch.full((len(part), t), pad_id, dtype=torch.long)
        am = torch.zeros(len(part), t, dtype=torch.long)
        for j, s in enumerate(part):
            ids[j, :len(s)] = torch.tensor(s, dtype=torch.long)
            am[j, :len(s)] = 1
        yield ids, am


# ====================================================================== transformers capture
class _Capture:
    """State of one measuring pass: which module is which layer, the pre-rotary stash."""

    def __init__(self, acc: GeometryAccumulator, layer_of: dict[int, int],
                 real: Tensor | None = None) -> None:
        self.acc = acc
        self.layer_of = layer_of
        self.real = real  # (B, T) of the current batch
        self.pre: dict[int, dict[str, Tensor]] = {}
        self.seen: set[int] = set()


_ACTIVE: list[_Capture] = []


def visible_from_mask(mask: Tensor | None, module: Any, t: int, s: int,
                      device: torch.device) -> Tensor:
    """Bool ``(B|1, 1|H, T, S)`` visibility from the mask transformers passes to attention.

    Float masks are additive (0 where visible, the dtype's minimum where not); bool masks
    are True where visible; ``None`` means causal for a causal module, else all visible.
    """
    if mask is None:
        if getattr(module, "is_causal", False) and t > 1:
            return torch.ones(t, s, dtype=torch.bool, device=device).tril(s - t)[None, None]
        return torch.ones(1, 1, t, s, dtype=torch.bool, device=device)
    mask = mask[..., :s]
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2


def _capture_attention(module: Any, query: Tensor, key: Tensor, value: Tensor,
                       attention_mask: Tensor | None, scaling: float | None = None,
                       dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, Tensor | None]:
    """The registered ``"qkgeom"`` attention: run the model's eager attention, then record
    q, k, the mask and the probabilities that attention computed (no second softmax)."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    mod = sys.modules.get(type(module).__module__)
    fn = getattr(mod, "eager_attention_forward", None)
    if fn is None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        fn = ALL_ATTENTION_FUNCTIONS["sdpa"]
    out = fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
             **kwargs)
    cap = _ACTIVE[-1] if _ACTIVE else None
    if cap is not None and id(module) in cap.layer_of:
        li = cap.layer_of[id(module)]
        t, s = query.shape[2], key.shape[2]
        vis = visible_from_mask(attention_mask, module, t, s, query.device)
        pre = cap.pre.pop(li, {})
        real = cap.real.to(query.device) if cap.real is not None else None
        w = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        probs = None
        if isinstance(w, Tensor) and w.shape == (query.shape[0], query.shape[1], t, s) \
                and not (module.training and dropout > 0):
            probs = w  # eager softmax(q k^T * scaling + mask), before any dropout in eval
        cap.acc.update(li, query, key, vis, float(scaling), real=real,
                       q_pre=pre.get("q"), k_pre=pre.get("k"), probs=probs)
        cap.seen.add(li)
    return out


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_IMPL, _capture_attention)
    AttentionMaskInterface.register(ATTN_IMPL, eager_mask)  # explicit float masks, no skips


@dataclass
class AttnSite:
    """One attention layer of a transformers model: its module and how to read q/k."""

    module: Any
    wq: Tensor  # [H*dh, d_model] torch layout
    wk: Tensor  # [H_kv*dh, d_model]
    pre_hooks: list[tuple[Any, Callable[[Tensor], dict[str, Tensor]]]] = field(
        default_factory=list)


def _attention_sites(model: Any, rotary: bool) -> list[AttnSite]:
    """The self-attention modules of ``model`` in depth order, by family.

    Families: q_proj/k_proj (Llama, Mistral, Qwen, Gemma, OLMo, ...; q_norm/k_norm
    honoured), GPT-NeoX ``query_key_value`` (per-head interleaved q|k|v), GPT-2 ``c_attn``
    (Conv1D ``[d, 3d]``) and BERT-style ``query``/``key``.
    """
    sites: list[AttnSite] = []
    for _, m in model.named_modules():
        if getattr(m, "is_cross_attention", False):
            continue
        if hasattr(m, "q_proj") and hasattr(m, "k_proj") and hasattr(m, "o_proj"):
            site = AttnSite(m, m.q_proj.weight, m.k_proj.weight)
            if rotary:
                qm = getattr(m, "q_norm", None) or m.q_proj
                km = getattr(m, "k_norm", None) or m.k_proj
                site.pre_hooks = [(qm, lambda o: {"q": o.reshape(*o.shape[:2], -1)}),
                                  (km, lambda o: {"k": o.reshape(*o.shape[:2], -1)})]
        elif hasattr(m, "query_key_value") and hasattr(m, "head_size"):
            hs = m.head_size
            w = m.query_key_value.weight  # [3*H*hs, d] with rows (H, 3, hs)
            nh = w.shape[0] // (3 * hs)
            w3 = w.view(nh, 3, hs, -1)
            site = AttnSite(m, w3[:, 0].reshape(nh * hs, -1), w3[:, 1].reshape(nh * hs, -1))

            def split(o: Tensor, nh: int = nh, hs: int = hs) -> dict[str, Tensor]:
                o = o.view(*o.shape[:2], nh, 3 * hs)
                return {"q": o[..., :hs].reshape(*o.shape[:2], -1),
                        "k": o[..., hs:2 * hs].reshape(*o.shape[:2], -1)}

            if rotary:
                site.pre_hooks = [(m.query_key_value, split)]
        elif hasattr(m, "c_attn") and hasattr(m, "split_size"):
            w = m.c_attn.weight.T  # Conv1D stores [d_in, d_out]
            d = m.split_size
            site = AttnSite(m, w[:d], w[d:2 * d])
        elif (hasattr(m, "query") and hasattr(m, "key") and hasattr(m, "value")
              and isinstance(getattr(m, "query", None), torch.nn.Linear)):
            site = AttnSite(m, m.query.weight, m.key.weight)
        else:
            continue
        sites.append(site)
    return sites


def is_rotary(model: Any) -> bool:
    return any("rotary" in type(m).__name__.lower() for m in model.modules())


@contextlib.contextmanager
def capturing(model: Any, acc: GeometryAccumulator, prerot: bool = False
              ) -> Iterator[_Capture]:
    """Within the block, ``model``'s forward passes feed ``acc`` (one update per layer).

    ``prerot``: also the pre-rotary projections of a rotary model (two more covariances
    per layer, ``pr_q_prerot`` / ``pr_k_prerot``).
    """
    _register_attention()
    sites = _attention_sites(model, prerot and is_rotary(model))
    if not sites:
        raise PretrainedError(f"found no supported self-attention modules in "
                              f"{type(model).__name__}; supported: Llama-style q_proj/k_proj, "
                              "GPT-NeoX, GPT-2, BERT-style encoders")
    cap = _Capture(acc, {id(s.module): i for i, s in enumerate(sites)})
    handles = []
    for li, site in enumerate(sites):
        for mod, fn in site.pre_hooks:
            def hook(_m, _i, out, li=li, fn=fn):
                cap.pre.setdefault(li, {}).update(
                    {k: v.detach() for k, v in fn(out).items()})
            handles.append(mod.register_forward_hook(hook))
    old = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPL)
    _ACTIVE.append(cap)
    try:
        yield cap
    finally:
        _ACTIVE.remove(cap)
        for hd in handles:
            hd.remove()
        model.set_attn_implementation(old)


# ====================================================================== loading
@dataclass
class Loaded:
    """A model ready to measure."""

    model: Any
    tokenizer: Any
    meta: dict[str, Any]


def _is_local(model_id: str) -> bool:
    return Path(model_id).expanduser().exists()


def load_hf(model_id: str, *, revision: str | None = None, gguf_file: str | None = None,
            dtype: str = "float32", device: str = "cpu") -> Loaded:
    """Load a transformers model (base model, no head) and its tokenizer.

    ``model_id``: a local directory or a Hub id (downloaded once into the Hugging Face cache
    at ``revision``, e.g. ``step3000`` for Pythia). ``gguf_file``: a GGUF file inside the
    directory (dequantized to ``dtype`` by transformers). Offline without a local copy, a
    :class:`PretrainedError` names ``--model PATH``.
    """
    try:
        import transformers
        from transformers import AutoModel, AutoTokenizer
    except ImportError:
        raise PretrainedError("probe-pretrained needs transformers: pip install "
                              "'qkgeom[hf]' (transformers, gguf, tokenizers, sentencepiece)") from None
    path = Path(model_id).expanduser()
    if gguf_file and Path(gguf_file).is_absolute():
        path, gguf_file = Path(gguf_file).parent, Path(gguf_file).name
    local = path.exists()
    if local and gguf_file and not (path / gguf_file).is_file():
        raise PretrainedError(f"--gguf-file {gguf_file} not found in {path}")
    src = str(path) if local else model_id
    kw: dict[str, Any] = {}
    if gguf_file:
        kw["gguf_file"] = gguf_file
    if revision and not local:
        kw["revision"] = revision
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise PretrainedError(f"--dtype {dtype!r} is not a torch dtype (float32, bfloat16, ...)")
    try:
        tok = AutoTokenizer.from_pretrained(src, **kw)
        model = AutoModel.from_pretrained(src, dtype=torch_dtype, attn_implementation="eager",
                                          **kw)
    except (OSError, ValueError) as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if local:
            raise PretrainedError(f"cannot load model from {path}: {first}") from None
        why = ("HF_HUB_OFFLINE is set and it is not in the local Hugging Face cache"
               if offline else "not in the local cache and the Hub did not provide it")
        raise PretrainedError(
            f"cannot load {model_id!r}{f' at revision {revision}' if revision else ''}: {why} "
            f"({first}). Pass --model PATH to a local copy (a directory with config.json and "
            "weights, or a directory plus --gguf-file FILE), or run online to download it"
        ) from None
    model.to(device).eval()
    cfg = model.config
    meta = {
        "source": "transformers", "model_type": cfg.model_type,
        "transformers": transformers.__version__, "dtype": dtype, "gguf_file": gguf_file,
        "path": str(path) if local else None, "revision": revision,
        "max_positions": _max_positions(cfg, tok),
    }
    return Loaded(model, tok, meta)


def _max_positions(cfg: Any, tok: Any) -> int | None:
    for k in ("max_position_embeddings", "n_positions", "n_ctx"):
        v = getattr(cfg, k, None)
        if isinstance(v, int) and v > 0:
            return v
    v = getattr(tok, "model_max_length", None)
    return v if isinstance(v, int) and v < 10**7 else None


# ====================================================================== measuring
@dataclass
class Measurement:
    rows: list[Row]
    meta: dict[str, Any]


def measure_hf(loaded: Loaded, text: str, *, max_tokens: int | None = DEFAULT_MAX_TOKENS,
               seq_len: int | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
               erank_seqs: int = DEFAULT_ERANK_SEQS, progress: Progress | None = None,
               ids: Sequence[int] | None = None,
               accumulator: GeometryAccumulator | None = None,
               prerot: bool = False) -> Measurement:
    """All metric rows of a transformers model on ``text`` (or pre-tokenized ``ids``).

    The text is tokenized without special tokens, cut into sequences of ``seq_len`` tokens
    (the tokenizer's own BOS / CLS+SEP added to each), and run ``chunk_tokens // seq_len``
    sequences per forward pass; the last sequence is right-padded and padding is masked out.
    ``accumulator``: a (fresh) accumulator to fill, e.g. one that also records the vectors.
    ``prerot``: also measure the pre-rotary projections of a rotary model.
    """
    model, tok = loaded.model, loaded.tokenizer
    maxpos = loaded.meta.get("max_positions")
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, maxpos or DEFAULT_SEQ_LEN)
    if maxpos and seq_len > maxpos:
        raise PretrainedError(f"--seq-len {seq_len} exceeds the model's {maxpos} positions")
    if ids is None:
        ids = tokenize_text(tok, text, max_tokens)
    elif max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise PretrainedError("the text gives fewer than 2 tokens; pass a longer --text")
    prefix, suffix = special_affixes(tok)
    seqs = windows(ids, seq_len, prefix, suffix)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    bs = max(1, chunk_tokens // seq_len)
    device = next(model.parameters()).device
    acc = accumulator or GeometryAccumulator(erank_seqs=erank_seqs)
    t0 = time.perf_counter()
    done = 0
    with capturing(model, acc, prerot) as cap, torch.no_grad():
        for x, am in batches(seqs, bs, pad):
            cap.real = am.bool()
            cap.seen.clear()
            model(input_ids=x.to(device), attention_mask=am.to(device), use_cache=False)
            if len(cap.seen) != len(cap.layer_of):
                raise PretrainedError(
                    f"captured {len(cap.seen)} of {len(cap.layer_of)} attention layers; this "
                    f"model family ({loaded.meta['model_type']}) routes attention elsewhere")
            done += int(am.sum())
            if progress is not None:
                el = time.perf_counter() - t0
                progress(done, sum(map(len, seqs)), {"tokens_per_s": done / max(el, 1e-9)})
    wall = time.perf_counter() - t0
    st0 = acc.layers[0]
    sites = _attention_sites(model, rotary=False)
    rows = weight_rows_from([(s.wq, s.wk) for s in sites], st0.n_head, st0.n_kv) + acc.rows()
    meta = dict(loaded.meta)
    meta.update(
        n_layers=len(acc.layers), n_heads=st0.n_head, n_kv_heads=st0.n_kv, d_head=st0.d_head,
        d_model=int(sites[0].wq.shape[1]), text_tokens=len(ids), tokens=done,
        sequences=len(seqs), seq_len=seq_len, chunk_tokens=bs * seq_len,
        special_prefix=prefix, special_suffix=suffix, erank_seqs=min(acc.erank_seqs, len(seqs)),
        rotary=is_rotary(model), prerot=st0.cov_q_pre is not None, wall_s=wall,
        tokens_per_s=done / max(wall, 1e-9),
        vectors="pr_q/pr_k: post-rotary q/k as used in q k^T; pr_*_prerot: projections",
    )
    return Measurement(rows, meta)


# ====================================================================== own checkpoints
def revision_step(revision: str) -> int | None:
    """The training step a revision name encodes (``step3000``, ``step_0003000``), or None."""
    m = re.fullmatch(r"(?:.*[^0-9])?step[_-]?(\d+)", revision)
    return int(m.group(1)) if m else None


def _is_uri(loc: str | Path) -> bool:
    return isinstance(loc, str) and "://" in loc


def _fs(uri: str) -> tuple[Any, str]:
    import pyarrow.fs as pafs

    try:
        return pafs.FileSystem.from_uri(uri)
    except Exception as e:  # unknown scheme, missing credentials, bad bucket name
        raise PretrainedError(f"cannot open {uri}: {str(e).strip().splitlines()[0]}") from None


def _state_exists(loc: str | Path) -> bool:
    """Whether a checkpoint/snapshot directory (path or URI) holds a ``state.pt``."""
    from qkgeom.train import STATE_FILE

    if not _is_uri(loc):
        return (Path(loc) / STATE_FILE).is_file()
    import pyarrow.fs as pafs

    fs, path = _fs(str(loc))
    try:
        return fs.get_file_info(f"{path.rstrip('/')}/{STATE_FILE}").type == pafs.FileType.File
    except OSError:
        return False


def checkpoint_dirs(root: str | Path) -> list[tuple[int, Path | str]]:
    """``(step, dir)`` of qkgeom checkpoints under ``root`` (or ``root`` itself), by step.

    ``root`` may be a URI (``s3://...``, ``gs://...``, ``file://...``): the directories are
    then listed through its ``pyarrow.fs`` filesystem and returned as URIs.
    """
    from qkgeom.train import STATE_FILE

    if _is_uri(root):
        import pyarrow.fs as pafs

        uri = str(root).rstrip("/")
        if _state_exists(uri):
            step = revision_step(uri.rsplit("/", 1)[-1])
            return [(step if step is not None else -1, uri)]
        fs, path = _fs(uri)
        try:
            infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        except OSError as e:
            raise PretrainedError(f"cannot list {uri}: {e}") from None
        found: list[tuple[int, Path | str]] = []
        for info in infos:
            st = revision_step(info.base_name)
            if info.type == pafs.FileType.Directory and st is not None \
                    and _state_exists(f"{uri}/{info.base_name}"):
                found.append((st, f"{uri}/{info.base_name}"))
        return sorted(found, key=lambda x: x[0])
    root = Path(root).expanduser()
    if (root / STATE_FILE).is_file():
        step = revision_step(root.name)
        return [(step if step is not None else -1, root)]
    out: list[tuple[int, Path | str]] = []
    if root.is_dir():
        for d in root.iterdir():
            st = revision_step(d.name)
            if d.is_dir() and st is not None and (d / STATE_FILE).is_file():
                out.append((st, d))
    return sorted(out, key=lambda x: x[0])


def resolve_checkpoints(spec: str, store: Any | None,
                        note: Callable[[str], None] | None = None
                        ) -> tuple[str, list[tuple[int, Path | str]]]:
    """``(model id, [(step, location)])`` for ``--checkpoints``: a directory (path or URI)
    or ``SWEEP/TRIAL_KEY``.

    A directory gives model id ``qkgeom:<dir>``; a sweep/trial (looked up in the database's
    ``checkpoints`` table) gives ``qkgeom:SWEEP/TRIAL_KEY``: per step its weight snapshot,
    else a resume checkpoint of that step while one still exists. Locations that are URIs
    are read through their ``pyarrow.fs`` filesystem (S3, GCS, ``file://``). A recorded
    snapshot that cannot be found is an error; resume rows a pre-0003 sweep left behind
    after pruning are skipped (told through ``note``).
    """
    if _is_uri(spec):
        found = checkpoint_dirs(spec)
        if not found:
            raise PretrainedError(f"no qkgeom checkpoints (step_N/state.pt) under {spec}")
        return f"qkgeom:{spec.rstrip('/')}", found
    p = Path(spec).expanduser()
    if p.is_dir():
        found = checkpoint_dirs(p)
        if not found:
            raise PretrainedError(f"no qkgeom checkpoints (step_N/state.pt) under {p}")
        return f"qkgeom:{p.resolve()}", found
    if "/" not in spec:
        raise PretrainedError(f"--checkpoints {spec!r} is neither a directory nor SWEEP/TRIAL_KEY")
    if store is None:
        raise PretrainedError("--checkpoints SWEEP/TRIAL_KEY needs the results database (--db)")
    sweep, key = spec.split("/", 1)
    df = store.sql(
        "SELECT c.step AS step, c.kind AS kind, c.location AS location FROM checkpoints c "
        "JOIN trials t ON t.id = c.trial_id JOIN sweeps s ON s.id = t.sweep_id "
        "WHERE s.name = :sweep AND t.trial_key = :key ORDER BY c.step",
        {"sweep": sweep, "key": key})
    if df.height == 0:
        raise PretrainedError(f"no checkpoints recorded for trial {key!r} of sweep {sweep!r}; "
                              "list trials with `qkgeom status --name SWEEP` or pass a checkpoint directory")
    by_step: dict[int, list[tuple[str, str]]] = {}
    for st, kind, loc in df.iter_rows():
        by_step.setdefault(int(st), []).append((kind, loc))
    found: list[tuple[int, Path | str]] = []
    missing: list[str] = []
    pruned: list[int] = []
    for st in sorted(by_step):
        rows = sorted(by_step[st], key=lambda r: r[0] != "snapshot")  # snapshot first
        hit = next((loc for _, loc in rows if _state_exists(loc)), None)
        if hit is not None:
            found.append((st, hit if _is_uri(hit) else Path(hit)))
        elif any(kind == "snapshot" for kind, _ in rows):
            missing += [loc for kind, loc in rows if kind == "snapshot"]
        else:
            pruned.append(st)
    if missing or not found:
        shown = missing or [loc for rows in by_step.values() for _, loc in rows]
        raise PretrainedError(f"checkpoint directories not found on this machine: "
                              f"{', '.join(shown[:3])}"
                              f"{f' (and {len(shown) - 3} more)' if len(shown) > 3 else ''}; "
                              "copy them here (same paths) or pass a directory")
    if pruned and note is not None:
        note(f"{spec}: steps {', '.join(map(str, pruned))} have only resume checkpoints that "
             "were pruned (a sweep from before snapshots were kept); measuring the "
             f"{len(found)} other step(s)")
    return f"qkgeom:{spec}", found


def _read_state(directory: str | Path, device: str) -> dict:
    import io

    from qkgeom.train import STATE_FILE

    if _is_uri(directory):
        fs, path = _fs(str(directory))
        where = f"{str(directory).rstrip('/')}/{STATE_FILE}"
        try:
            with fs.open_input_file(f"{path.rstrip('/')}/{STATE_FILE}") as f:
                data = f.read()
            return torch.load(io.BytesIO(data), map_location=device, weights_only=False)
        except (OSError, RuntimeError) as e:
            raise PretrainedError(f"cannot read checkpoint {where}: {e}") from None
    path = Path(directory) / STATE_FILE
    try:
        return torch.load(path, map_location=device, weights_only=False)
    except (OSError, RuntimeError) as e:
        raise PretrainedError(f"cannot read checkpoint {path}: {e}") from None


def load_checkpoint(directory: str | Path, device: str = "cpu") -> tuple[Any, list[str], dict]:
    """``(GPT in eval mode, chars, config dict)`` from a qkgeom checkpoint or weight snapshot
    directory (a path, or a URI read through ``pyarrow.fs``)."""
    from qkgeom.config import TrialConfig
    from qkgeom.model import GPT

    state = _read_state(directory, device)
    cfg = TrialConfig.from_dict(state["config"])
    model = GPT(cfg, len(state["chars"]) + 1)
    model.load_state_dict(state["model"])
    return model.to(device).eval(), list(state["chars"]), state["config"]


def measure_gpt(model: Any, chars: Sequence[str], text: str, *,
                max_tokens: int | None = DEFAULT_MAX_TOKENS,
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS, erank_seqs: int = DEFAULT_ERANK_SEQS,
                progress: Progress | None = None) -> Measurement:
    """The same metrics for qkgeom's own character-level GPT (context ``block_size``)."""
    from qkgeom.data import UNK
    from qkgeom.probe import weight_rows

    lut = {c: i + 1 for i, c in enumerate(chars)}
    n = len(text) if max_tokens is None else min(len(text), max_tokens)
    ids = [lut.get(c, UNK) for c in text[:n]]
    seq_len = model.cfg.block_size
    seqs = windows(ids, seq_len)
    bs = max(1, chunk_tokens // seq_len)
    device = next(model.parameters()).device
    acc = GeometryAccumulator(erank_seqs=erank_seqs)
    layers = model.attn_layers()
    cur: dict[int, dict[str, Tensor]] = {}
    handles = []
    for li, a in enumerate(layers):
        for name in ("q", "k"):
            def grab(_m, _i, out, li=li, name=name):
                cur.setdefault(li, {})[name] = out.detach()
            handles.append(getattr(a, f"hook_{name}").register_forward_hook(grab))
    t0 = time.perf_counter()
    done = 0
    try:
        with torch.no_grad():
            for x, am in batches(seqs, bs, UNK):
                cur.clear()
                model(x.to(device))
                t = x.shape[1]
                real = am.bool().to(device)
                vis = M.causal_visible(t, device=device)[None, None]  # (1, 1, T, T)
                for li in range(len(layers)):
                    q, k = cur[li]["q"], cur[li]["k"]  # (B, nh, T, hs)
                    acc.update(li, q, k, vis, q.shape[-1] ** -0.5, real=real)
                done += int(am.sum())
                if progress is not None:
                    el = time.perf_counter() - t0
                    progress(done, n, {"tokens_per_s": done / max(el, 1e-9)})
    finally:
        for hd in handles:
            hd.remove()
    wall = time.perf_counter() - t0
    cfg = model.cfg
    meta = dict(source="qkgeom", n_layers=cfg.n_layer, n_heads=cfg.n_head,
                n_kv_heads=cfg.n_head, d_head=cfg.d_head, d_model=cfg.n_embd, text_tokens=n,
                tokens=done, sequences=len(seqs), seq_len=seq_len, chunk_tokens=bs * seq_len,
                erank_seqs=min(erank_seqs, len(seqs)), rotary=False, wall_s=wall,
                tokens_per_s=done / max(wall, 1e-9))
    return Measurement(weight_rows(model) + acc.rows(), meta)


# ====================================================================== drivers
@dataclass
class Stored:
    model: str
    revision: str
    step: int | None
    run_id: int | None
    n_rows: int
    meta: dict[str, Any]


@dataclass
class RevisionJob:
    """One revision of a family to measure: a Hub/local transformers model at a revision,
    or one qkgeom checkpoint directory (``location``: a path or URI)."""

    label: str
    step: int | None
    source: str  # "transformers" | "qkgeom"
    model_id: str | None = None
    revision: str | None = None
    gguf_file: str | None = None
    dtype: str = "float32"
    seq_len: int | None = None
    location: str | None = None


def measure_job(job: RevisionJob, text: str, text_path: str | Path, *,
                max_tokens: int | None = DEFAULT_MAX_TOKENS,
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                erank_seqs: int = DEFAULT_ERANK_SEQS, device: str = "cpu",
                prerot: bool = False, progress: Progress | None = None) -> Measurement:
    """Load and measure one revision (in this process, or inside a Ray task)."""
    if job.source == "qkgeom":
        model, chars, cfg = load_checkpoint(job.location, device)
        m = measure_gpt(model, chars, text, max_tokens=max_tokens, chunk_tokens=chunk_tokens,
                        erank_seqs=erank_seqs, progress=progress)
        m.meta.update(text=str(text_path), checkpoint=str(job.location), config=cfg)
        return m
    loaded = load_hf(job.model_id, revision=job.revision, gguf_file=job.gguf_file,
                     dtype=job.dtype, device=device)
    m = measure_hf(loaded, text, max_tokens=max_tokens, seq_len=job.seq_len,
                   chunk_tokens=chunk_tokens, erank_seqs=erank_seqs, progress=progress,
                   prerot=prerot)
    m.meta["text"] = str(text_path)
    return m


def stored_revisions(store: Any | None, name: str) -> set[str]:
    """Revisions of model ``name`` already in the database."""
    if store is None:
        return set()
    df = store.sql("SELECT revision FROM pretrained_runs WHERE model = :m", {"m": name})
    return set(df["revision"].to_list())


def run_jobs(name: str, jobs: list[RevisionJob], text_path: str | Path | None, *,
             store: Any | None, force: bool = False, ray: Any | None = None,
             note: Callable[[str], None] | None = None,
             progress: Callable[[str], Progress] | None = None, **kw: Any) -> list[Stored]:
    """Measure ``jobs`` and store each as revision ``job.label`` of model ``name``.

    Revisions already stored are skipped unless ``force``. ``ray``: a
    :class:`qkgeom.pretrained_ray.RayOptions` to fan several revisions out as Ray tasks
    (each written here as it finishes); otherwise one after another in this process.
    """
    text, tpath = read_text(text_path)
    if not force:
        have = stored_revisions(store, name)
        skip = [j.label for j in jobs if j.label in have]
        if skip and note is not None:
            note(f"{name}: {len(skip)} revision(s) already stored, skipped "
                 f"({', '.join(skip[:5])}{', ...' if len(skip) > 5 else ''}); --force redoes them")
        jobs = [j for j in jobs if j.label not in have]
    if ray is not None and len(jobs) > 1:
        from qkgeom.pretrained_ray import run_on_ray

        return run_on_ray(name, jobs, text, tpath, store=store, opts=ray, note=note, **kw)
    out = []
    for job in jobs:
        m = measure_job(job, text, tpath, progress=progress(job.label) if progress else None,
                        **kw)
        rid = store.write_pretrained(name, job.label, job.step, m.meta, m.rows) \
            if store else None
        out.append(Stored(name, job.label, job.step, rid, len(m.rows), m.meta))
    return out


def probe_pretrained(model_id: str, *, revisions: Sequence[str] | None = None,
                     gguf_file: str | None = None, text_path: str | Path | None = None,
                     max_tokens: int | None = DEFAULT_MAX_TOKENS, seq_len: int | None = None,
                     chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                     erank_seqs: int = DEFAULT_ERANK_SEQS, name: str | None = None,
                     dtype: str = "float32", device: str = "cpu", store: Any | None = None,
                     progress: Callable[[str], Progress] | None = None,
                     prerot: bool = False, force: bool = False, ray: Any | None = None,
                     note: Callable[[str], None] | None = None) -> list[Stored]:
    """Measure ``model_id`` at each revision and store it under ``name`` (default: the id).

    ``revisions`` default: ``[None]`` (the Hub's default branch, or the local files), stored
    as revision ``main`` (``local`` for a path; for a path, one revision names what it
    holds). A revision's step comes from its name (``stepN``), else None.
    ``progress(label)`` returns a per-revision progress callback (in-process runs).
    Revisions already stored under ``name`` are skipped unless ``force``; ``ray`` fans
    several revisions out over Ray (:func:`run_jobs`).
    """
    if revisions and len(revisions) > 1 and _is_local(model_id):
        raise PretrainedError(f"{model_id} is a local directory, so --revisions can only name "
                              "the one revision it holds (e.g. --revisions step1000); measure "
                              "each revision's directory in turn with the same --name")
    name = name or (model_id + (f"#{gguf_file}" if gguf_file else ""))
    jobs = []
    for rev in (list(revisions) if revisions else [None]):
        label = rev or ("local" if _is_local(model_id) else "main")
        jobs.append(RevisionJob(label, revision_step(label), "transformers", model_id=model_id,
                                revision=rev, gguf_file=gguf_file, dtype=dtype,
                                seq_len=seq_len))
    return run_jobs(name, jobs, text_path, store=store, force=force, ray=ray, note=note,
                    progress=progress, max_tokens=max_tokens, chunk_tokens=chunk_tokens,
                    erank_seqs=erank_seqs, device=device, prerot=prerot)


def probe_checkpoints(spec: str, *, store: Any | None, text_path: str | Path | None = None,
                      max_tokens: int | None = DEFAULT_MAX_TOKENS,
                      chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                      erank_seqs: int = DEFAULT_ERANK_SEQS, name: str | None = None,
                      device: str = "cpu", progress: Callable[[str], Progress] | None = None,
                      note: Callable[[str], None] | None = None,
                      revisions: Sequence[str] | None = None, force: bool = False,
                      ray: Any | None = None) -> list[Stored]:
    """Measure every checkpoint of a qkgeom trial; each is stored as revision ``step_N``.

    ``revisions``: only these (``step_N``, ``stepN`` or ``N``). Revisions already stored are
    skipped unless ``force``; ``ray`` fans them out over Ray (:func:`run_jobs`).
    """
    model_id, found = resolve_checkpoints(spec, store, note)
    name = name or model_id
    jobs = [RevisionJob(f"step_{st}", None if st < 0 else st, "qkgeom", location=str(d))
            for st, d in found]
    if revisions:
        want: dict[int, str] = {}
        for r in revisions:
            st = revision_step(r) if not r.strip().isdigit() else int(r)
            if st is None:
                raise PretrainedError(f"revision {r!r} of {model_id} is not step_N")
            want[st] = r
        have = {j.step for j in jobs}
        missing = [r for st, r in want.items() if st not in have]
        if missing:
            raise PretrainedError(f"{model_id} has no checkpoint for {', '.join(missing)}; "
                                  f"it has steps {', '.join(str(j.step) for j in jobs)}")
        jobs = [j for j in jobs if j.step in want]
    return run_jobs(name, jobs, text_path, store=store, force=force, ray=ray, note=note,
                    progress=progress, max_tokens=max_tokens, chunk_tokens=chunk_tokens,
                    erank_seqs=erank_seqs, device=device)
