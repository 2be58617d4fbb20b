"""Every supported attention family, on tiny randomly initialised transformers models.

No weights needed: GPT-2 (fused Conv1D ``c_attn``), GPT-NeoX/Pythia (fused per-head
``query_key_value``, partial rotary), Llama (grouped keys), Qwen3 (``q_norm``/``k_norm``
before rotary) and BERT (bidirectional). For each: entropy from the captured q and k equals
the model's own eager ``output_attentions``; the per-head weight rows qkgeom reads reproduce
the captured projections (so the interaction spectrum pairs the right rows); pre-rotary
vectors map onto post-rotary ones through the model's own rotary embedding.
"""

from __future__ import annotations

import os

import pytest
import torch
from ci_env import require

os.environ.setdefault("HF_HUB_OFFLINE", "1")

transformers = require("transformers")  # an error under CI, a skip elsewhere

from qkgeom import pretrained as P  # noqa: E402
from qkgeom.engine import metrics as M  # noqa: E402
from qkgeom.pretrained.capture import _attention_sites  # noqa: E402

V, D, L = 97, 64, 2


class StubTokenizer:
    pad_token_id = 0

    def __init__(self, prefix=(), suffix=()):
        self.prefix, self.suffix = list(prefix), list(suffix)

    def __call__(self, text, add_special_tokens=True, verbose=True):
        ids = [5 + (ord(c) % 80) for c in text]
        return {"input_ids": (self.prefix + ids + self.suffix) if add_special_tokens else ids}


def _build(family: str):
    t = transformers
    common = dict(vocab_size=V, max_position_embeddings=128, attn_implementation="eager")
    if family == "gpt2":
        m = t.GPT2Model(t.GPT2Config(n_embd=D, n_layer=L, n_head=4, n_positions=128,
                                     vocab_size=V, attn_implementation="eager"))
        return m, StubTokenizer(), False
    if family == "neox":
        cfg = t.GPTNeoXConfig(hidden_size=D, num_attention_heads=4, num_hidden_layers=L,
                              intermediate_size=128, rotary_pct=0.25, **common)
        return t.GPTNeoXModel(cfg), StubTokenizer(), True
    if family == "llama":
        cfg = t.LlamaConfig(hidden_size=D, num_attention_heads=4, num_key_value_heads=2,
                            num_hidden_layers=L, intermediate_size=128, **common)
        return t.LlamaModel(cfg), StubTokenizer(prefix=[1]), True
    if family == "qwen3":
        cfg = t.Qwen3Config(hidden_size=D, num_attention_heads=4, num_key_value_heads=1,
                            head_dim=16, num_hidden_layers=L, intermediate_size=128, **common)
        return t.Qwen3Model(cfg), StubTokenizer(), True
    if family == "bert":
        cfg = t.BertConfig(hidden_size=D, num_attention_heads=4, num_hidden_layers=L,
                           intermediate_size=128, **common)
        return t.BertModel(cfg), StubTokenizer(prefix=[2], suffix=[3]), False
    raise AssertionError(family)


class Recording(P.GeometryAccumulator):
    def __init__(self) -> None:
        super().__init__(erank_seqs=2)
        self.seen: dict[int, dict] = {}

    def update(self, layer, q, k, visible, scaling, real=None, q_pre=None, k_pre=None,
               probs=None):
        self.seen.setdefault(layer, dict(q=q.clone(), k=k.clone(), q_pre=q_pre, k_pre=k_pre))
        super().update(layer, q, k, visible, scaling, real, q_pre, k_pre, probs)


def _q_bias(site: P.AttnSite, family: str, nh: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = site.module
    zq, zk = torch.zeros(site.wq.shape[0]), torch.zeros(site.wk.shape[0])
    if family == "gpt2":
        d = m.split_size
        return m.c_attn.bias[:d], m.c_attn.bias[d:2 * d]
    if family == "neox":
        b = m.query_key_value.bias.view(nh, 3, -1)
        return b[:, 0].reshape(-1), b[:, 1].reshape(-1)
    if family == "bert":
        return m.query.bias, m.key.bias
    return zq, zk


@pytest.mark.parametrize("family", ["gpt2", "neox", "llama", "qwen3", "bert"])
def test_family(family: str):
    torch.manual_seed(0)
    model, tok, rotary = _build(family)
    model.eval()
    loaded = P.Loaded(model, tok, {"model_type": model.config.model_type,
                                   "max_positions": 128})
    text = "the quick brown fox jumps over the lazy dog. " * 4  # 180 tokens
    acc = Recording()
    inputs: dict[int, torch.Tensor] = {}
    sites = _attention_sites(model, rotary)
    assert len(sites) == L

    def grab(li):
        def hook(_m, args, kwargs):
            inputs.setdefault(li, (args[0] if args else kwargs["hidden_states"]).clone())
        return hook

    hs = [s.module.register_forward_pre_hook(grab(i), with_kwargs=True)
          for i, s in enumerate(sites)]
    m = P.measure_hf(loaded, text, max_tokens=None, seq_len=64, chunk_tokens=64 * 4,
                     accumulator=acc, prerot=True)
    for h in hs:
        h.remove()
    assert m.meta["rotary"] is rotary
    assert model.config._attn_implementation == "eager"

    # entropy == the model's own eager attention probabilities
    ids = P.tokenize_text(tok, text, None)
    seqs = P.text_windows(ids, 64, tok.prefix, tok.suffix)
    x, am = next(P.batches(seqs, 8, 0))
    assert (am == 0).any()
    with torch.no_grad():
        out = model(input_ids=x, attention_mask=am, output_attentions=True)
    real = am.bool()
    vis = real[:, None, None, :] & real[:, None, :, None]
    if family != "bert":
        vis = vis & M.causal_visible(x.shape[1])[None, None]
    ent = {(li, h): v for li, h, n, v in m.rows if n == "entropy"}
    for li, att in enumerate(out.attentions):
        raw, _ = M.attention_entropy(att, vis)
        for h in range(att.shape[1]):
            assert ent[li, h] == pytest.approx(float(raw[h]), abs=1e-5), (li, h)

    # the weight rows qkgeom reads reproduce the captured projections
    nh, nkv = m.meta["n_heads"], m.meta["n_kv_heads"]
    for li, site in enumerate(sites):
        c, hidden = acc.seen[li], inputs[li]
        bq, bk = _q_bias(site, family, nh)
        q_lin = hidden @ site.wq.T + bq  # (B, T, H*dh)
        k_lin = hidden @ site.wk.T + bk
        if rotary:
            got_q, got_k = c["q_pre"], c["k_pre"]
            if family == "qwen3":  # normed after the projection: compare per-head norms
                mod = site.module
                b_, t_ = q_lin.shape[:2]
                q_lin = mod.q_norm(q_lin.view(b_, t_, nh, -1)).reshape(b_, t_, -1)
                k_lin = mod.k_norm(k_lin.view(b_, t_, nkv, -1)).reshape(b_, t_, -1)
        else:
            got_q = c["q"].transpose(1, 2).reshape(*c["q"].shape[:1], -1, site.wq.shape[0])
            got_k = c["k"].transpose(1, 2).reshape(*c["k"].shape[:1], -1, site.wk.shape[0])
        torch.testing.assert_close(got_q, q_lin, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_k, k_lin, rtol=1e-4, atol=1e-5)

    # pre-rotary -> post-rotary through the model's own rotary embedding
    if rotary:
        mod = __import__(type(sites[0].module).__module__, fromlist=["x"])
        c = acc.seen[1]
        b, t = c["q_pre"].shape[:2]
        pos = torch.arange(t)[None].expand(b, t)
        cos, sin = model.rotary_emb(c["q"], pos)
        dh = c["q"].shape[-1]
        q_pre = c["q_pre"].view(b, t, nh, dh).transpose(1, 2)
        k_pre = c["k_pre"].view(b, t, nkv, dh).transpose(1, 2)
        q_rot, k_rot = mod.apply_rotary_pos_emb(q_pre, k_pre, cos, sin)
        torch.testing.assert_close(q_rot, c["q"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k_rot, c["k"], rtol=1e-5, atol=1e-5)
        assert {n for _, _, n, _ in m.rows} >= {"pr_q_prerot", "pr_k_prerot"}
