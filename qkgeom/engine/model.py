"""The whole model in one file: a nanoGPT-style character-level GPT.

Pre-LayerNorm blocks, learned positions, GELU MLP (4x), tied input/output embeddings, and
*separate* ``q_proj`` / ``k_proj`` / ``v_proj`` so W_K can be initialised and intervened on
alone. Identity :class:`HookPoint` modules (``hook_q``, ``hook_k``, ``hook_scores``,
``hook_pattern``) expose activations TransformerLens-style: register a torch forward hook on
one to read it, or return a tensor from the hook to replace it. Ordinary steps use
``scaled_dot_product_attention``; the explicit softmax path (which is what fires
``hook_scores`` / ``hook_pattern``) runs only when ``probe=True``.

Shapes: B batch, T time, C = n_embd, nh = n_head, hs = d_head.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkgeom.config import TrialConfig
from qkgeom.engine.metrics import split_heads


class HookPoint(nn.Module):
    """Identity module: a named place to attach forward hooks."""

    def forward(self, x: Tensor) -> Tensor:
        return x


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TrialConfig) -> None:
        super().__init__()
        c, self.n_head, self.d_head = cfg.n_embd, cfg.n_head, cfg.d_head
        self.q_proj = nn.Linear(c, c, bias=cfg.bias)
        self.k_proj = nn.Linear(c, c, bias=cfg.bias)
        self.v_proj = nn.Linear(c, c, bias=cfg.bias)
        self.o_proj = nn.Linear(c, c, bias=cfg.bias)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.hook_q = HookPoint()  # (B, nh, T, hs)
        self.hook_k = HookPoint()  # (B, nh, T, hs)
        self.hook_scores = HookPoint()  # (B, nh, T, T) pre-softmax, scaled, -inf masked
        self.hook_pattern = HookPoint()  # (B, nh, T, T) softmax probabilities

    def forward(self, x: Tensor, probe: bool = False) -> Tensor:
        b, t, c = x.shape
        nh, hs = self.n_head, self.d_head
        q = self.hook_q(self.q_proj(x).view(b, t, nh, hs).transpose(1, 2))  # (B, nh, T, hs)
        k = self.hook_k(self.k_proj(x).view(b, t, nh, hs).transpose(1, 2))  # (B, nh, T, hs)
        v = self.v_proj(x).view(b, t, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        if probe:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(hs)  # (B, nh, T, T)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            scores = self.hook_scores(scores.masked_fill(~mask, float("-inf")))
            att = self.hook_pattern(torch.softmax(scores.float(), dim=-1).to(v.dtype))
            y = att @ v  # (B, nh, T, hs)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
            )
        y = y.transpose(1, 2).contiguous().view(b, t, c)  # (B, T, C)
        return self.resid_drop(self.o_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: TrialConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: TrialConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, probe: bool = False) -> Tensor:
        x = x + self.attn(self.ln_1(x), probe=probe)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: TrialConfig, vocab_size: int) -> None:
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.wte = nn.Embedding(vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self.apply(self._init_weights)
        for blk in self.blocks:  # GPT-2's scaled init of the residual projections
            for w in (blk.attn.o_proj.weight, blk.mlp.proj.weight):
                nn.init.normal_(w, 0.0, cfg.init_std / math.sqrt(2 * cfg.n_layer))
        gen = torch.Generator().manual_seed(cfg.rng_seed + 7919)  # Q/K init has its own stream
        QK_INITS[cfg.init](self, gen)

    def _init_weights(self, m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, self.cfg.init_std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: Tensor, probe: bool = False) -> Tensor:
        """``idx (B, T)`` token ids -> logits ``(B, T, vocab)``."""
        b, t = idx.shape
        if t > self.cfg.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for blk in self.blocks:
            x = blk(x, probe=probe)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab)

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def attn_layers(self) -> list[CausalSelfAttention]:
        return [blk.attn for blk in self.blocks]

    def head_weights(self, layer: int) -> tuple[Tensor, Tensor]:
        """``(W_Q, W_K)`` of attention layer ``layer``, each ``[n_head, d_head, n_embd]``.

        ``W_Q[h]`` is head ``h``'s rows of ``q_proj.weight`` (torch layout ``[d_out, d_in]``:
        the head computes ``x @ W_Q[h].T``); TransformerLens's ``W_Q[layer, h]`` is its
        transpose. Views of the parameters: writing into them under ``no_grad`` changes the
        model; read-only users detach.
        """
        a = self.blocks[layer].attn
        return split_heads(a.q_proj.weight, a.n_head), split_heads(a.k_proj.weight, a.n_head)


# ---------------------------------------------------------------------- Q/K inits
# Each entry re-initialises W_Q and/or W_K of every layer, in place, from ``gen``.
QKInit = Callable[[GPT, torch.Generator], None]
QK_INITS: dict[str, QKInit] = {}


def register_init(name: str) -> Callable[[QKInit], QKInit]:
    def deco(fn: QKInit) -> QKInit:
        QK_INITS[name] = fn
        return fn

    return deco


@register_init("gaussian")
@torch.no_grad()
def init_gaussian(model: GPT, gen: torch.Generator) -> None:
    """W_Q and W_K independent N(0, init_std^2) (the nanoGPT default)."""
    std = model.cfg.init_std
    for a in model.attn_layers():
        a.q_proj.weight.copy_(torch.randn(a.q_proj.weight.shape, generator=gen) * std)
        a.k_proj.weight.copy_(torch.randn(a.k_proj.weight.shape, generator=gen) * std)


@register_init("tied")
@torch.no_grad()
def init_tied(model: GPT, gen: torch.Generator) -> None:
    """W_K starts equal to W_Q (both Gaussian), then both train freely."""
    init_gaussian(model, gen)
    for a in model.attn_layers():
        a.k_proj.weight.copy_(a.q_proj.weight)


@register_init("orthogonal")
@torch.no_grad()
def init_orthogonal(model: GPT, gen: torch.Generator) -> None:
    """Per head, W_Q^h (W_K^h)^T = 0, so every logit is 0 and attention is uniform at step 0.

    With ``W_Q^h = W_q_h^T`` (``[d_model, d_head]``) the product vanishes exactly when the
    rows of W_K^h (vectors in R^d_head) are orthogonal to the row space of W_Q^h. We draw a
    random orthonormal basis of R^d_head per head, give W_Q^h its first ``d_head//2``
    directions and W_K^h the rest, with Gaussian coefficients scaled so each matrix keeps
    the Frobenius norm a Gaussian init would have in expectation.
    """
    cfg = model.cfg
    hs, std = cfg.d_head, cfg.init_std
    r = hs // 2
    for li in range(cfg.n_layer):
        wq, wk = model.head_weights(li)  # (nh, hs, C) views of the weights
        for h in range(cfg.n_head):
            basis, _ = torch.linalg.qr(torch.randn(hs, hs, generator=gen, dtype=torch.float64))
            u, w = basis[:, :r], basis[:, r:]  # (hs, r), (hs, hs - r) orthogonal complements
            gq = torch.randn(r, cfg.n_embd, generator=gen, dtype=torch.float64)
            gk = torch.randn(hs - r, cfg.n_embd, generator=gen, dtype=torch.float64)
            # W_q_h = u @ gq has columns in span(u); W_k_h columns in span(w): W_q_h^T W_k_h = 0
            wq[h] = (u @ gq * std * math.sqrt(hs / r)).float()
            wk[h] = (w @ gk * std * math.sqrt(hs / (hs - r))).float()
