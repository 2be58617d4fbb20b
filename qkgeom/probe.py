"""One probe of qkgeom's own GPT: hooks in, metric rows out.

Runs the model's explicit-softmax path on the fixed probe batch, captures q, k, the
scaled scores and the pattern of every layer through the hook points, and turns them into
long rows ``(layer, head | None, name, value)`` (see :data:`qkgeom.records.METRICS`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qkgeom import metrics as M
from qkgeom.model import GPT

Row = tuple[int, "int | None", str, float]


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else math.nan


def weight_rows(model: GPT) -> list[Row]:
    """Weight-spectrum metrics (no forward pass): pr_wq, pr_wk, qk_pr, qk_erank."""
    rows: list[Row] = []
    hs = model.cfg.d_head
    for li, a in enumerate(model.attn_layers()):
        wq, wk = a.q_proj.weight.detach(), a.k_proj.weight.detach()  # (C, C) each
        rows += [(li, None, "pr_wq", M.weight_pr(wq)), (li, None, "pr_wk", M.weight_pr(wk))]
        qk_pr, qk_er = [], []
        for h in range(model.cfg.n_head):
            sl = slice(h * hs, (h + 1) * hs)
            s = M.interaction_singular_values(wq[sl], wk[sl])
            qk_pr.append(M.spectrum_pr(s))
            qk_er.append(M.effective_rank(s))
            rows += [
                (li, h, "pr_wq", M.weight_pr(wq[sl])),
                (li, h, "pr_wk", M.weight_pr(wk[sl])),
                (li, h, "qk_pr", qk_pr[-1]),
                (li, h, "qk_erank", qk_er[-1]),
            ]
        rows += [(li, None, "qk_pr", _mean(qk_pr)), (li, None, "qk_erank", _mean(qk_er))]
    return rows


@torch.no_grad()
def probe_model(model: GPT, x: Tensor) -> list[Row]:
    """All geometry metrics of ``model`` on the probe batch ``x (B, T)``."""
    layers = model.attn_layers()
    captured: list[dict[str, Tensor]] = [{} for _ in layers]
    handles = []
    for li, a in enumerate(layers):
        for name in ("q", "k", "scores", "pattern"):
            hook = getattr(a, f"hook_{name}")

            def grab(mod, inp, out, li=li, name=name):
                captured[li][name] = out.detach()

            handles.append(hook.register_forward_hook(grab))
    was_training = model.training
    model.eval()
    try:
        model(x, probe=True)
    finally:
        for hd in handles:
            hd.remove()
        model.train(was_training)

    rows = weight_rows(model)
    t = x.shape[1]
    vis = M.causal_visible(t, device=x.device)  # (T, T)
    for li, cap in enumerate(captured):
        q, k = cap["q"].float(), cap["k"].float()  # (B, nh, T, hs)
        b, nh, _, hs = q.shape
        rows.append((li, None, "pr_q", M.activation_pr(q.transpose(1, 2).reshape(-1, nh * hs))))
        rows.append((li, None, "pr_k", M.activation_pr(k.transpose(1, 2).reshape(-1, nh * hs))))
        ent, ent_n = M.attention_entropy(cap["pattern"].float(), vis)  # (nh,), (nh,)
        logits = torch.where(vis, cap["scores"].float(), 0.0)  # -inf masked -> 0
        erank = M.logit_effective_rank(logits, vis)  # (nh,)
        for h in range(nh):
            rows += [
                (li, h, "pr_q", M.activation_pr(q[:, h].reshape(-1, hs))),
                (li, h, "pr_k", M.activation_pr(k[:, h].reshape(-1, hs))),
                (li, h, "entropy", float(ent[h])),
                (li, h, "entropy_norm", float(ent_n[h])),
                (li, h, "logit_erank", float(erank[h])),
            ]
        rows += [
            (li, None, "entropy", float(ent.mean())),
            (li, None, "entropy_norm", float(ent_n.mean())),
            (li, None, "logit_erank", float(erank.mean())),
        ]
    return rows
