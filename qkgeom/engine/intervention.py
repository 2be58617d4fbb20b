"""Training-time control of the key spectrum: the arms ``none``, ``hold``, ``shrink`` and
``shrink_act`` (``shrink`` at the activation site).

Two sites (``cfg.site``):

* ``weight`` (PAPER.md's intervention): after every optimizer step, under ``no_grad``,
  take the SVD of each layer's W_K, keep the singular vectors, and replace the singular
  values ``s`` by ``c * s**p`` with ``c`` preserving the Frobenius norm and ``p`` found by
  bisection so that the weight-spectrum PR (of ``s**2``) hits the target.
* ``activation``: the same power map applied to the *eigenvalues of the key covariance*,
  in the forward pass: ``k <- mu + (k - mu) A`` with ``A = V diag(c * lam**((p-1)/2)) V^T``
  from a running (EMA) covariance of each layer's keys, refreshed after every step. This
  exists because holding W_K's spectrum does not stop the collapse of activation PR_K.

Targets (``cfg.target_mode``), with ``g(t)`` the schedule going from 1 to ``cfg.shrink_to``:

* ``init_fraction``: ``g(t) * PR_0`` (PR_0 = the layer's PR at step 0),
* ``baseline_fraction``: ``g(t) * PR_baseline(step)`` from ``cfg.baseline_pr`` (the paired
  baseline run of the same seed, interpolated in step): its W_K weight PR (``pr_wk``) at
  the weight site, its key-activation PR (``pr_k``) at the activation site, per layer,
* ``absolute``: moves from ``PR_0`` to the absolute value ``cfg.shrink_to``.

``hold`` always targets ``PR_0``. A target outside what a power map can reach (between 1 and
the matrix's rank) is clipped to the reachable range.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from qkgeom.config import TrialConfig
from qkgeom.engine.metrics import weight_pr
from qkgeom.engine.model import GPT


# ---------------------------------------------------------------------- spectral maths
def _pr_of_power(logw: Tensor, live: Tensor, p: Tensor) -> Tensor:
    """PR of ``w**p`` for every exponent in ``p [L, P]``; ``logw``, ``live``: ``[L, n]``.

    ``logw`` is ``log w`` (finite where ``live``); entries with ``w = 0`` stay zero.
    Returns ``[L, P]``.
    """
    wp = torch.where(live[:, None, :], torch.exp(p[:, :, None] * logw[:, None, :]), 0.0)
    return wp.sum(-1) ** 2 / (wp * wp).sum(-1)


def _newton_power(logw: Tensor, live: Tensor, target: Tensor, p: Tensor,
                  iters: int = 3) -> Tensor:
    """``iters`` Newton steps on PR(w**p) = target from ``p [L]``. With ``e = w**p``,
    ``S1 = sum e``, ``S2 = sum e**2`` and ``D1``, ``D2`` their sums weighted by ``log w``:
    PR = S1**2 / S2 and dPR/dp = 2 S1 (D1 S2 - S1 D2) / S2**2."""
    livef = live.to(logw.dtype)
    for _ in range(iters):
        e = torch.exp(p[:, None] * logw) * livef
        e2 = e * e
        s1, s2 = e.sum(-1), e2.sum(-1)
        d1, d2 = (e * logw).sum(-1), (e2 * logw).sum(-1)
        p = p - s2 * (s1 * s1 - target * s2) / (2 * s1 * (d1 * s2 - s1 * d2))
    return p


def solve_power(weights: Tensor, target: Tensor, rounds: int = 4, points: int = 33,
                start: Tensor | None = None) -> Tensor:
    """Exponent ``p`` in [0, 64] per row such that PR(weights**p) = target.

    ``weights [L, n]`` non-negative (a spectrum: ``s**2`` for a weight matrix, eigenvalues
    for a covariance); ``target [L]``. PR(w**p) decreases from the count of non-zero
    entries at p = 0 towards the multiplicity of the largest entry as p grows. Each round
    evaluates a grid of ``points`` exponents at once and keeps the bracketing cell (4
    rounds: a cell of 64 / 32**4 = 6e-5), then the root is interpolated linearly inside it:
    a handful of batched tensor ops instead of a long scalar bisection, since this runs
    after every optimizer step. Targets beyond the reachable range give its end.

    ``start``: exponents near the root (the arm passes 1: after the previous step's map,
    the spectrum is one optimizer step away from its target). On the CPU, three Newton steps
    from it come first and are kept when every row lands within 1e-10
    relative of its target inside [0, 64]; otherwise, and always on other devices (where
    checking would wait for the device every step), the grid search runs.
    """
    w = weights / weights.amax(-1, keepdim=True).clamp_min(1e-300)
    live = w > 0
    logw = torch.where(live, torch.log(w.clamp_min(1e-300)), 0.0)
    if start is not None and w.device.type == "cpu":
        p = _newton_power(logw, live, target, start.to(w.dtype))
        pr = _pr_of_power(logw, live, p[:, None])[:, 0]
        if bool(((pr - target).abs() <= 1e-10 * target).all() & (p >= 0).all()
                & (p <= 64).all()):
            return p
    lo = torch.zeros_like(target)
    hi = torch.full_like(target, 64.0)
    frac = torch.linspace(0, 1, points, dtype=w.dtype, device=w.device)
    for _ in range(rounds):
        grid = lo[:, None] + (hi - lo)[:, None] * frac  # (L, P)
        above = _pr_of_power(logw, live, grid) > target[:, None]  # True, ..., True, False...
        idx = above.sum(-1, keepdim=True).clamp(1, points - 1)
        lo, hi = grid.gather(1, idx - 1)[:, 0], grid.gather(1, idx)[:, 0]
    pr = _pr_of_power(logw, live, torch.stack([lo, hi], 1))  # (L, 2)
    t = ((pr[:, 0] - target) / (pr[:, 0] - pr[:, 1])).nan_to_num(0.0).clamp(0, 1)
    return lo + t * (hi - lo)


def reshape_singular_values(s: Tensor, target_pr: Tensor,
                            start: Tensor | None = None) -> Tensor:
    """New singular values ``c * s**p`` with PR(s_new**2) = target and ||s_new|| = ||s||;
    ``start``: see :func:`solve_power`.

    ``s [L, n]``, ``target_pr [L]``. Batched over layers.
    """
    s = s.double()
    p = solve_power(s * s, target_pr.double(), start=start)  # PR is defined on s**2
    sn = s / s.amax(-1, keepdim=True).clamp_min(1e-300)
    sp = torch.where(sn > 0, sn.clamp_min(1e-300) ** p[:, None], torch.zeros_like(sn))
    scale = s.norm(dim=-1, keepdim=True) / sp.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    return sp * scale


# ---------------------------------------------------------------------- schedule
def schedule_progress(cfg: TrialConfig, step: int) -> float:
    """u(t) in [0, 1]: how far the schedule has moved (``constant`` is at 1 from the start)."""
    if cfg.shrink_schedule == "constant":
        return 1.0
    u = (step / cfg.max_steps - cfg.shrink_start) / (1 - cfg.shrink_start)
    u = min(max(u, 0.0), 1.0)
    if cfg.shrink_schedule == "cosine":
        return (1 - math.cos(math.pi * u)) / 2
    if cfg.shrink_schedule == "exp":  # geometric in the factor: g = f**u
        f = cfg.shrink_to
        return u if f == 1 else (1 - f**u) / (1 - f)
    return u  # linear


def schedule_factor(cfg: TrialConfig, step: int) -> float:
    """g(t): 1 at the start of the schedule, ``cfg.shrink_to`` at its end."""
    return 1 + (cfg.shrink_to - 1) * schedule_progress(cfg, step)


def baseline_at(baseline_pr: list, step: int, n_layer: int) -> list[float]:
    """Interpolate ``[[step, [pr per layer]], ...]`` at ``step`` (clamped at the ends)."""
    steps = np.array([float(s) for s, _ in baseline_pr])
    vals = np.array([list(v) for _, v in baseline_pr], dtype=float)  # (n_points, n_layer)
    if vals.shape[1] != n_layer:
        raise ValueError(f"baseline_pr has {vals.shape[1]} layers, the model {n_layer}")
    order = np.argsort(steps)
    return [float(np.interp(step, steps[order], vals[order, j])) for j in range(n_layer)]


# ---------------------------------------------------------------------- the arms
class KeySpectrumControl:
    """Applies an arm to a model. ``after_step`` runs after each optimizer step."""

    def __init__(self, cfg: TrialConfig, model: GPT) -> None:
        self.cfg, self.model = cfg, model
        self.active = cfg.arm != "none"
        self.pr0: list[float] | None = None  # the layers' PR at step 0
        self.last_target: list[float] | None = None
        self.shapers: list[_KeyShaper] = []
        if self.active and cfg.site == "weight":
            self.pr0 = [weight_pr(a.k_proj.weight) for a in model.attn_layers()]
        if self.active and cfg.site == "activation":
            self.shapers = [_KeyShaper(a.hook_k, cfg) for a in model.attn_layers()]

    def target(self, step: int, pr0: list[float]) -> list[float]:
        cfg = self.cfg
        if cfg.arm == "hold":
            return list(pr0)
        if cfg.target_mode == "init_fraction":
            g = schedule_factor(cfg, step)
            return [g * p for p in pr0]
        if cfg.target_mode == "baseline_fraction":
            g = schedule_factor(cfg, step)
            return [g * p for p in baseline_at(cfg.baseline_pr, step, cfg.n_layer)]
        u = schedule_progress(cfg, step)  # absolute: from PR_0 to shrink_to
        return [p + (cfg.shrink_to - p) * u for p in pr0]

    @torch.no_grad()
    def after_step(self, step: int) -> None:
        if not self.active:
            return
        if self.cfg.site == "activation":
            for sh in self.shapers:
                sh.observe_pr0()
            if any(sh.pr0 is None for sh in self.shapers):
                return  # no training batch seen yet
            tgt = self.target(step, [sh.pr0 for sh in self.shapers])  # one per layer
            for sh, t in zip(self.shapers, tgt):
                sh.refresh(t)
            return
        assert self.pr0 is not None
        tgt = self.target(step, self.pr0)
        self.last_target = tgt
        ws = [a.k_proj.weight for a in self.model.attn_layers()]
        w = torch.stack([x.detach() for x in ws]).to(
            torch.float64 if ws[0].device.type == "cpu" else torch.float32)  # (L, C, C)
        # W = U S V^T: the eigenvectors of the Gram W^T W are V, its eigenvalues S^2. One
        # batched symmetric eigensolve is about 2.5x cheaper than the SVD on CPU, and the
        # new matrix W V diag(s_new / s) V^T = U diag(s_new) V^T never needs U.
        lam, v = torch.linalg.eigh(w.mT @ w)
        s = lam.clamp_min(0).sqrt()  # (L, C), ascending; order does not matter below
        target = torch.tensor(tgt).to(w.device, non_blocking=True)  # no extra sync on CUDA
        # W_K already had its target PR after the last step; one optimizer step later the
        # map that restores it is close to the identity, p = 1: Newton's start (CPU)
        s_new = reshape_singular_values(s, target, torch.ones_like(s[:, 0])).to(w.dtype)
        gain = torch.where(s > 0, s_new / s.clamp_min(1e-300), torch.zeros_like(s))
        w_new = (w @ v) * gain[:, None, :] @ v.mT  # same singular vectors, new values
        for x, xn in zip(ws, w_new):
            x.copy_(xn.to(x.dtype))

    def targets_now(self) -> list[float] | None:
        """The most recent per-layer target (None before the first step or for ``none``)."""
        if self.cfg.site == "activation":
            t = [sh.target for sh in self.shapers]
            return None if any(v is None for v in t) else t
        return self.last_target

    def state_dict(self) -> dict:
        return {
            "pr0": self.pr0,
            "last_target": self.last_target,
            "shapers": [sh.state_dict() for sh in self.shapers],
        }

    def load_state_dict(self, state: dict) -> None:
        self.pr0, self.last_target = state["pr0"], state["last_target"]
        for sh, st in zip(self.shapers, state["shapers"]):
            sh.load_state_dict(st)


def power_map(lam: Tensor, v: Tensor, target: Tensor) -> Tensor:
    """``A = V diag(sqrt(lam'/lam)) V^T`` with ``lam' = c * lam**p``, PR(lam') = target and
    ``sum lam' = sum lam``: the linear map on centred keys whose output covariance
    ``A^T C A`` (C = V diag(lam) V^T) has the reshaped spectrum. ``lam [C]``, ``v [C, C]``."""
    p = solve_power(lam[None], target)[0]
    ln = lam / lam.max().clamp_min(1e-300)
    lp = torch.where(ln > 0, ln.clamp_min(1e-300) ** p, torch.zeros_like(ln))
    lp = lp * lam.sum() / lp.sum().clamp_min(1e-300)  # keep total variance
    gain = torch.sqrt(lp / lam.clamp_min(1e-30)) * (lam > 0)
    return (v * gain) @ v.T


class _KeyShaper:
    """Forward hook on ``hook_k`` that maps the key covariance spectrum lam -> c * lam**p."""

    def __init__(self, hook_point: torch.nn.Module, cfg: TrialConfig) -> None:
        self.cfg = cfg
        self.mean: Tensor | None = None  # (C,) running mean of k (heads concatenated)
        self.cov: Tensor | None = None  # (C, C) running covariance, float64
        self.a: Tensor | None = None  # (C, C) current linear map on centred keys
        self.pr0: float | None = None
        self.target: float | None = None
        # Not qkgeom.engine.hooks: this hook lives as long as the model trains (every forward pass
        # of every step), not for one ``with`` block, so it keeps no handle to remove.
        hook_point.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, inputs: tuple, k: Tensor) -> Tensor:
        b, nh, t, hs = k.shape
        flat = k.transpose(1, 2).reshape(b * t, nh * hs)  # (B*T, C)
        if module.training:  # statistics from training batches only
            with torch.no_grad():
                x = flat.detach().double()
                mu = x.mean(0)
                c = torch.cov(x.T)
                m = self.cfg.act_momentum
                if self.cov is None:
                    self.mean, self.cov = mu, c
                else:
                    self.mean = m * self.mean + (1 - m) * mu
                    self.cov = m * self.cov + (1 - m) * c
        if self.a is None:
            return k
        mu = self.mean.to(flat.dtype)
        out = (flat - mu) @ self.a.to(flat.dtype) + mu  # (B*T, C)
        return out.view(b, t, nh, hs).transpose(1, 2)

    @torch.no_grad()
    def observe_pr0(self) -> None:
        """Record the PR of the first running covariance (the layer's step-0 key PR)."""
        if self.pr0 is None and self.cov is not None:
            lam = torch.linalg.eigvalsh(self.cov).clamp_min(0)
            self.pr0 = float(lam.sum() ** 2 / (lam * lam).sum())

    @torch.no_grad()
    def refresh(self, target: float) -> None:
        """Rebuild the map so that the shaped running covariance has PR ``target``."""
        if self.cov is None:
            return
        lam, v = torch.linalg.eigh(self.cov)
        lam = lam.clamp_min(0)
        self.target = float(target)
        self.a = power_map(lam, v, torch.tensor([self.target], dtype=lam.dtype))

    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("mean", "cov", "a", "pr0", "target")}

    def load_state_dict(self, st: dict) -> None:
        for k, val in st.items():
            setattr(self, k, val)
