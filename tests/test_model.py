"""The model: causality, the two attention paths, hooks and the Q/K initialisations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qkgeom.config import TrialConfig
from qkgeom.engine import metrics as M
from qkgeom.engine.model import GPT, QK_INITS
from qkgeom.engine.probe import probe_model

CFG = dict(n_layer=2, n_embd=32, n_head=4, block_size=16, seed=3)


def make(init: str = "gaussian", **kw) -> GPT:
    torch.manual_seed(0)
    return GPT(TrialConfig(**{**CFG, "init": init, **kw}), vocab_size=50).eval()


def test_future_tokens_never_change_earlier_logits():
    m = make()
    x = torch.randint(0, 50, (2, 16))
    y = x.clone()
    y[:, 9:] = torch.randint(0, 50, (2, 7))
    for probe in (False, True):
        a, b = m(x, probe=probe), m(y, probe=probe)
        assert torch.allclose(a[:, :9], b[:, :9], atol=1e-6)
        assert not torch.allclose(a[:, 9:], b[:, 9:])


def test_probe_path_equals_sdpa_path():
    m = make()
    x = torch.randint(0, 50, (3, 16))
    assert torch.allclose(m(x), m(x, probe=True), atol=1e-5)


def test_hooks_expose_q_k_pattern_with_documented_shapes():
    m = make()
    seen = {}
    a = m.blocks[1].attn
    for name in ("q", "k", "scores", "pattern"):
        getattr(a, f"hook_{name}").register_forward_hook(
            lambda mod, i, o, name=name: seen.__setitem__(name, o)
        )
    m(torch.randint(0, 50, (2, 16)), probe=True)
    assert seen["q"].shape == seen["k"].shape == (2, 4, 16, 8)
    assert seen["pattern"].shape == (2, 4, 16, 16)
    rows = seen["pattern"].sum(-1)
    assert torch.allclose(rows, torch.ones_like(rows), atol=1e-5)
    assert (seen["pattern"].triu(1) == 0).all()
    # the q hook holds exactly x W_q^T for the layer's input
    ln_in = {}
    a.q_proj.register_forward_hook(lambda mod, i, o: ln_in.__setitem__("x", i[0]))
    m(torch.randint(0, 50, (2, 16)), probe=True)
    q_ref = (ln_in["x"] @ a.q_proj.weight.T).view(2, 16, 4, 8).transpose(1, 2)
    assert torch.allclose(seen["q"], q_ref, atol=1e-6)


def test_init_registry_has_the_three_inits():
    assert set(QK_INITS) >= {"gaussian", "tied", "orthogonal"}


def test_tied_init_starts_with_wk_equal_wq():
    m = make("tied")
    for a in m.attn_layers():
        assert torch.equal(a.k_proj.weight, a.q_proj.weight)
    g = make("gaussian")
    assert not torch.equal(g.blocks[0].attn.k_proj.weight, g.blocks[0].attn.q_proj.weight)
    # gaussian weights have the configured spread
    assert float(g.blocks[0].attn.q_proj.weight.detach().std()) == pytest.approx(0.02, rel=0.1)


def test_orthogonal_init_zero_interaction_and_uniform_attention():
    m = make("orthogonal")
    hs = m.cfg.d_head
    for a in m.attn_layers():
        wq = a.q_proj.weight.detach().double()
        wk = a.k_proj.weight.detach().double()
        for h in range(m.cfg.n_head):
            sl = slice(h * hs, (h + 1) * hs)
            dense = wq[sl].T @ wk[sl]  # W_Q^h (W_K^h)^T, d_model x d_model
            assert float(dense.abs().max()) < 1e-6
            s = M.interaction_singular_values(wq[sl], wk[sl])
            assert float(s.max()) < 1e-6
        # each matrix keeps roughly a Gaussian init's Frobenius norm
        ref = 0.02 * math.sqrt(wq.numel())
        assert float(wq.norm()) == pytest.approx(ref, rel=0.15)
    # uniform attention at step 0: normalised entropy 1 in every layer and head
    rows = probe_model(m, torch.randint(0, 50, (2, 16)))
    ent = [v for (_, h, name, v) in rows if name == "entropy_norm" and h is not None]
    np.testing.assert_allclose(ent, 1.0, atol=1e-6)


def test_orthogonal_needs_two_dims_per_head():
    from qkgeom.config import ConfigError

    with pytest.raises(ConfigError, match="d_head"):
        TrialConfig(n_embd=4, n_head=4, init="orthogonal")
