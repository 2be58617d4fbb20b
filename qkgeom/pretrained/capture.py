"""Capturing q, k and attention from a transformers model as it runs, and measuring it.

Capture works through transformers' public ``AttentionInterface``: the model runs with a
registered implementation ``"qkgeom"`` that records (``query``, ``key``, mask, ``scaling``)
exactly as the model hands them to attention, then delegates to the model's own eager
attention. Pre-rotary projections come from forward hooks on the projection modules.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from qkgeom.engine import metrics as M
from qkgeom.engine.hooks import hooked
from qkgeom.engine.probe import head_weight_rows
from qkgeom.pretrained.accumulate import GeometryAccumulator, busy_host_threads
from qkgeom.pretrained.base import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_ERANK_SEQS,
    DEFAULT_MAX_TOKENS,
    DEFAULT_SEQ_LEN,
    Measurement,
    PretrainedError,
    TokenProgress,
)
from qkgeom.pretrained.load import Loaded
from qkgeom.pretrained.text import batches, special_affixes, text_windows, tokenize_text
from qkgeom.records import Row

ATTN_IMPL = "qkgeom"  # the name registered in transformers' AttentionInterface


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
    hooks = []
    for li, site in enumerate(sites):
        for mod, fn in site.pre_hooks:
            def hook(_m, _i, out, li=li, fn=fn):
                cap.pre.setdefault(li, {}).update(
                    {k: v.detach() for k, v in fn(out).items()})
            hooks.append((mod, hook))
    old = model.config._attn_implementation
    with hooked(hooks):
        model.set_attn_implementation(ATTN_IMPL)
        _ACTIVE.append(cap)
        try:
            yield cap
        finally:
            _ACTIVE.remove(cap)
            model.set_attn_implementation(old)


def measure_hf(loaded: Loaded, text: str, *, max_tokens: int | None = DEFAULT_MAX_TOKENS,
               seq_len: int | None = None, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
               erank_seqs: int = DEFAULT_ERANK_SEQS, progress: TokenProgress | None = None,
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
    seqs = text_windows(ids, seq_len, prefix, suffix)
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
    rows = site_weight_rows(sites, st0.n_head, st0.n_kv) + acc.rows()
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


def site_weight_rows(sites: Sequence[AttnSite], n_head: int, n_kv: int) -> list[Row]:
    """Weight-spectrum rows (:func:`qkgeom.engine.probe.head_weight_rows`) of the sites' ``W_q`` /
    ``W_k``, split into ``n_head`` / ``n_kv`` heads, in float64 on the CPU.

    All intra-op threads on a quiet host: SmolLM2-135M on 2 cores took 0.35-0.38 s against
    0.52-0.53 s on one thread. On an oversubscribed host one thread
    (:func:`~qkgeom.pretrained.accumulate.busy_host_threads`): beside a running sweep the
    same rows took 8-14 s on two threads and 0.6-0.8 s on one (docs/benchmarks.md)."""
    qk = [(M.split_heads(s.wq.detach().double().cpu(), n_head),
           M.split_heads(s.wk.detach().double().cpu(), n_kv)) for s in sites]
    with busy_host_threads():
        return head_weight_rows(qk)
