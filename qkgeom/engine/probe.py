"""One probe of qkgeom's own GPT: hooks in, metric rows out.

Runs the model's explicit-softmax path on the fixed probe batch, captures q, k and the
pattern of every layer through the hook points, and turns them into
long rows ``(layer, head | None, name, value)`` (see :data:`qkgeom.records.METRICS`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from qkgeom.engine import metrics as M
from qkgeom.engine.hooks import capture_outputs
from qkgeom.engine.model import GPT
from qkgeom.records import Row


class _Rows:
    """Metric rows whose values stay device tensors until :meth:`read`: one sync per probe.

    A row's value is a 0-d tensor, or the mean of earlier rows (taken over the read
    Python floats in order, as a plain ``sum / len``).
    """

    def __init__(self) -> None:
        self.keys: list[tuple[int, int | None, str]] = []
        self.refs: list[int | list[int]] = []
        self.vals: list[Tensor] = []

    def add(self, li: int, h: int | None, name: str, value: Tensor) -> int:
        self.vals.append(value.detach().double().reshape(()))
        self.keys.append((li, h, name))
        self.refs.append(len(self.vals) - 1)
        return len(self.vals) - 1

    def add_mean(self, li: int, name: str, refs: list[int]) -> None:
        self.keys.append((li, None, name))
        self.refs.append(refs)

    def read(self) -> list[Row]:
        flat = torch.stack(self.vals).tolist() if self.vals else []
        out: list[Row] = []
        for (li, h, name), ref in zip(self.keys, self.refs):
            v = flat[ref] if isinstance(ref, int) else \
                float(sum(flat[i] for i in ref) / len(ref)) if ref else math.nan
            out.append((li, h, name, v))
        return out


def _weight_terms(qk: Sequence[tuple[Tensor, Tensor]], rows: _Rows) -> None:
    for li, (wq, wk) in enumerate(qk):
        wq, wk = wq.detach(), wk.detach()  # (H, dh, d), (H_kv, dh, d)
        nh, nkv = wq.shape[0], wk.shape[0]
        rows.add(li, None, "pr_wq", M.weight_pr_t(wq.reshape(-1, wq.shape[-1])))
        rows.add(li, None, "pr_wk", M.weight_pr_t(wk.reshape(-1, wk.shape[-1])))
        # query head h meets key head h // (H / H_kv), as repeat_kv pairs them
        kv_of = (torch.arange(nh, device=wk.device) // (nh // nkv)) if nkv != nh else None
        # every head in one call per metric: (H, dh, d) -> (H,) values
        s_all = M.interaction_singular_values(wq, wk, kv_of)  # (H, dh)
        pr_q, pr_k = M.weight_pr_t(wq), M.weight_pr_t(wk)
        if kv_of is not None:
            pr_k = pr_k[kv_of]
        qk_pr_h, qk_er_h = M.spectrum_pr_t(s_all), M.effective_rank_t(s_all)
        qk_pr, qk_er = [], []
        for h in range(nh):
            rows.add(li, h, "pr_wq", pr_q[h])
            rows.add(li, h, "pr_wk", pr_k[h])
            qk_pr.append(rows.add(li, h, "qk_pr", qk_pr_h[h]))
            qk_er.append(rows.add(li, h, "qk_erank", qk_er_h[h]))
        rows.add_mean(li, "qk_pr", qk_pr)
        rows.add_mean(li, "qk_erank", qk_er)


def head_weight_rows(qk: Sequence[tuple[Tensor, Tensor]]) -> list[Row]:
    """Weight-spectrum metrics (pr_wq, pr_wk, qk_pr, qk_erank) of per-head weights.

    ``qk``: per layer ``(W_Q, W_K)``, ``[H, d_head, d_model]`` and ``[H_kv, d_head,
    d_model]`` (torch row layout, see :meth:`qkgeom.engine.model.GPT.head_weights`). With grouped
    keys (``H_kv < H``) query head ``h`` pairs with key head ``h // (H / H_kv)`` and each
    query head's ``pr_wk`` repeats its key head's. Layer rows: PR of the whole matrices;
    mean over heads of the interaction PR and effective rank. Values are computed on the
    weights' device and read back in one transfer.
    """
    rows = _Rows()
    _weight_terms(qk, rows)
    return rows.read()


def weight_rows(model: GPT) -> list[Row]:
    """Weight-spectrum metrics (no forward pass): pr_wq, pr_wk, qk_pr, qk_erank."""
    return head_weight_rows([model.head_weights(li) for li in range(len(model.blocks))])


@torch.no_grad()
def probe_model(model: GPT, x: Tensor) -> list[Row]:
    """All geometry metrics of ``model`` on the probe batch ``x (B, T)``.

    Every value is computed on the model's device and read back in one transfer.
    """
    layers = model.attn_layers()
    points = {(li, name): getattr(a, f"hook_{name}")
              for li, a in enumerate(layers) for name in ("q", "k", "pattern")}
    was_training = model.training
    model.eval()
    try:
        with capture_outputs(points) as captured:
            model(x, probe=True)
    finally:
        model.train(was_training)

    rows = _Rows()
    _weight_terms([model.head_weights(li) for li in range(len(layers))], rows)
    t = x.shape[1]
    vis = M.causal_visible(t, device=x.device)  # (T, T)
    for li in range(len(layers)):
        cap = {name: captured[li, name] for name in ("q", "k", "pattern")}
        q, k = cap["q"].float(), cap["k"].float()  # (B, nh, T, hs)
        b, nh, _, hs = q.shape
        rows.add(li, None, "pr_q", M.activation_pr_t(q.transpose(1, 2).reshape(-1, nh * hs)))
        rows.add(li, None, "pr_k", M.activation_pr_t(k.transpose(1, 2).reshape(-1, nh * hs)))
        ent, ent_n = M.attention_entropy(cap["pattern"].float(), vis)  # (nh,), (nh,)
        erank = M.token_effective_rank(q, k)  # (nh,) from d_head-sized factors
        for h in range(nh):
            rows.add(li, h, "pr_q", M.activation_pr_t(q[:, h].reshape(-1, hs)))
            rows.add(li, h, "pr_k", M.activation_pr_t(k[:, h].reshape(-1, hs)))
            rows.add(li, h, "entropy", ent[h])
            rows.add(li, h, "entropy_norm", ent_n[h])
            rows.add(li, h, "token_erank", erank[h])
        rows.add(li, None, "entropy", ent.mean())
        rows.add(li, None, "entropy_norm", ent_n.mean())
        rows.add(li, None, "token_erank", erank.mean())
    return rows.read()
