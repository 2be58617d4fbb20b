"""Packing: K members of one shape trained in one process, against K separate processes.

Usage:  python benchmarks/packed.py [--steps N] [--widths 48,128] [--ks 1,2,4,8] [--json]
        [--data DIR]

**Members.** A width ``w`` is the ladder cell ``w/w`` (``n_embd = block_size = w``) of the
``cpu`` preset: 4 layers, 4 heads, batch 32, the paper's optimiser, one torch thread.
Member ``i`` has seed ``i`` and Q/K init ``INITS[i % 3]`` (gaussian, tied, orthogonal), so
the members differ in init, data order and Q/K geometry; all have arm ``none``.

**Packed.** :class:`PackedGPT` holds the members' parameters stacked along a leading member
dimension. Each member is first built exactly as a trial builds it
(``torch.manual_seed(cfg.rng_seed); GPT(cfg, vocab)``, qkgeom's own init path), then its
parameters are stacked. The forward is qkgeom's GPT written with batched kernels: the
token and position embeddings as one lookup in the stacked tables, every ``nn.Linear``
(and the tied output head) as one ``torch.bmm`` over members, attention as one
``scaled_dot_product_attention`` over ``members x batch``, GELU and the residual adds on the
stacked activations. Layer norm and the cross-entropy run per member (``unbind``, ``K``
small calls): one ``layer_norm`` over all members with the per-member scale applied
afterwards sums the scale's gradient in another order than the layer-norm kernel does (in
a prototype of this file the members' losses then differed from their trials by up to
1e-6 within 20 steps at 48/48). :class:`PackedTrainer` steps it: each member draws its
batch from its own :class:`~qkgeom.engine.data.Sampler` (seeded with its ``rng_seed``, as
in a trial); the loss is the sum of the members' mean losses (so each member gets exactly its own
gradient); gradients are clipped per member (each member's global norm from its own
per-tensor norms, the coefficient of ``clip_grad_norm_``); one ``torch.optim.AdamW`` runs
over the stacked tensors, which is per-member exact because AdamW is elementwise (its step
count and learning rate are shared, as they are equal for all members anyway), with weight
decay on the stacked matrices only, as ``make_optimizer`` decays the matrices.

Hand-batched rather than ``torch.func.stack_module_state`` + ``functional_call`` +
``vmap`` (not timed here): vmap would reach the same kernels through its batching layer on
every op, adding per-op cost where packing is meant to remove it, and it needs
``randomness=`` and per-member clipping on top; the hand-batched forward calls each kernel
once for all members, and its backward is plain autograd.

**Separate.** The baseline is qkgeom's trial step itself: one process per member with
one torch thread, :class:`~qkgeom.engine.train.TrainingRun` (its ``GPT``, ``make_optimizer``,
``Sampler``, clipping and learning-rate schedule) and ``train_step`` in a loop.

**Timing, fair on 2 cores.** For each width and ``K`` one phase runs two things at once,
one per core: the packed process (1 thread, the ``K`` members) and a slot that runs the
``K`` separate one-thread processes one after another (members 0 .. K-1). Whichever
finishes first is replaced by a filler process (a one-thread trial of the same width, its
output thrown away, killed when the phase ends), so that every timed step ran with the
other core busy, as on a machine running two one-thread workers. Each process times its own
training loop after ``WARMUP_STEPS`` untimed steps (corpus, model building and the warm-up
steps excluded). The wall-clock rates include them, timed from the end of the worker's
imports to its results saved: once per member for the separate runs, once per pack (the
interpreter's start and the import of torch are in neither figure). Reported per core (one
thread each): ``packed = K x timed tokens / packed loop seconds`` and ``separate = the same
tokens / the sum of the K separate loops' seconds``; ``ratio = packed / separate``. Two
one-thread workers of either kind on this 2-core machine make a machine total of twice the
per-core rate, so the ratio of machine totals is this ratio.

**Decision threshold (written before the recorded run).** Packing *wins* on CPU when, at
48/48 and K = 4, the packed per-core tokens/s is at least **1.25x** the separate per-core
tokens/s (training loops only, measured in the same run); below that, the `--pack K` sweep
option is not worth its complexity on CPU.

**Equality.** For every phase, each packed member's per-step training losses and its final
parameters are compared with its separate trial's (same seed, same init, same batches). The
stated tolerance is ``TOLERANCE = 1e-5`` (absolute, on the losses in nats and on every
parameter), and the maximum absolute difference is printed; a phase outside it fails the
benchmark (exit status 1). On the development machine (x86-64, MKL, one thread) they are
bit-identical (difference 0): with one thread, ``bmm`` gives each member the same bits as
the unpacked ``mm`` on the same shapes (MKL's gemm per member, by the evidence of the
results), attention is computed per ``(sequence, head)`` slice, layer norm and the
cross-entropy run per member, and AdamW and the clip coefficient are elementwise. Where
they would not be bit-identical: a batched matmul that picks another kernel, blocking or
split of the reduction than the single gemm (other BLAS, several threads, cuBLAS's batched
kernels on a GPU), a reduction whose order depends on the layout (the per-member gradient
norms taken as a ``(K, n)`` row reduction against ``_foreach_norm`` of one ``n``-vector;
the one-``layer_norm``-plus-scale variant above), and vectorised elementwise kernels whose
scalar tail (fused multiply-add or not) falls on different elements when a member's tensor
does not start at a multiple of the vector width. Such differences start at float32
rounding and can grow as training goes on (the tolerance is for this benchmark's few
steps); dropout is not supported (``dropout`` must be 0, the presets' value).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from qkgeom.config import INITS, TrialConfig, preset
from qkgeom.engine.data import Corpus, Sampler, default_source, load_corpus
from qkgeom.engine.model import GPT
from qkgeom.engine.train import TrainingRun, lr_at

WARMUP_STEPS = 2  # untimed steps at the start of every training loop
TOLERANCE = 1e-5  # max |packed - separate| on per-step losses and final parameters
THRESHOLD = 1.25  # packing wins when packed / separate >= this at DECISION_CELL
DECISION_CELL = (48, 4)  # (width, K)
POLL_S = 0.02


def default_steps(width: int) -> int:
    """About the same seconds per member at every width: 100 steps at 48/48, at least 30."""
    return max(30, round(100 * (48 / width) ** 2))


def member_config(width: int, member: int, steps: int, data: str) -> TrialConfig:
    """Member ``member`` of the ``width/width`` cell of the ``cpu`` preset."""
    return preset("cpu").with_overrides({
        "n_embd": width, "block_size": width, "max_steps": steps, "dataset": data,
        "threads": 1, "seed": member, "init": INITS[member % len(INITS)],
    })


# ---------------------------------------------------------------------- the packed model
class PackedGPT:
    """``K`` qkgeom GPTs of one shape as stacked parameters (leading member dimension).

    ``params[name]`` is ``(K, *shape)`` for each name of ``GPT.named_parameters()`` (the
    tied output head is ``wte.weight``), in the same order.
    """

    def __init__(self, models: list[GPT]) -> None:
        cfg = models[0].cfg
        if cfg.dropout != 0:
            raise ValueError("PackedGPT has no per-member dropout streams: dropout must be 0")
        if cfg.bias:
            raise ValueError("PackedGPT implements bias=False (the presets' value)")
        self.k, self.cfg = len(models), cfg
        self.names = [n for n, _ in models[0].named_parameters()]
        per_model = [dict(m.named_parameters()) for m in models]
        self.params: dict[str, Tensor] = {
            n: torch.stack([d[n].detach() for d in per_model]).requires_grad_()
            for n in self.names
        }

    def parameters(self) -> list[Tensor]:
        return [self.params[n] for n in self.names]

    def member_state(self, k: int) -> dict[str, Tensor]:
        """Member ``k``'s parameters under the GPT's names (detached copies)."""
        return {n: t[k].detach().clone() for n, t in self.params.items()}

    @staticmethod
    def _layer_norm(x: Tensor, w: Tensor) -> Tensor:
        # per member: the same kernel (and the same reduction for w's gradient) as a trial
        return torch.stack([F.layer_norm(a, a.shape[-1:], b)
                            for a, b in zip(x.unbind(0), w.unbind(0))])

    @staticmethod
    def _linear(x: Tensor, w: Tensor) -> Tensor:
        """``x (K, N, C_in)``, ``w (K, C_out, C_in)`` -> ``(K, N, C_out)``: ``F.linear`` per
        member."""
        return torch.bmm(x, w.transpose(1, 2))

    def forward(self, idx: Tensor) -> Tensor:
        """``idx (K, B, T)`` token ids -> logits ``(K, B*T, vocab)``."""
        p, cfg = self.params, self.cfg
        k, b, t = idx.shape
        v, c = p["wte.weight"].shape[1:]
        nh, hs = cfg.n_head, cfg.d_head
        offsets = (torch.arange(k, device=idx.device) * v).view(k, 1, 1)
        x = F.embedding(idx + offsets, p["wte.weight"].reshape(k * v, c))  # (K, B, T, C)
        x = (x + p["wpe.weight"][:, None, :t]).reshape(k, b * t, c)

        def heads(z: Tensor) -> Tensor:  # (K, B*T, C) -> (K*B, nh, T, hs)
            return z.view(k * b, t, nh, hs).transpose(1, 2)

        for i in range(cfg.n_layer):
            blk = f"blocks.{i}."
            h = self._layer_norm(x, p[blk + "ln_1.weight"])
            q = heads(self._linear(h, p[blk + "attn.q_proj.weight"]))
            kk = heads(self._linear(h, p[blk + "attn.k_proj.weight"]))
            vv = heads(self._linear(h, p[blk + "attn.v_proj.weight"]))
            y = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
            y = y.transpose(1, 2).reshape(k, b * t, c)
            x = x + self._linear(y, p[blk + "attn.o_proj.weight"])
            h = self._layer_norm(x, p[blk + "ln_2.weight"])
            h = F.gelu(self._linear(h, p[blk + "mlp.fc.weight"]))
            x = x + self._linear(h, p[blk + "mlp.proj.weight"])
        return self._linear(self._layer_norm(x, p["ln_f.weight"]), p["wte.weight"])


def clip_per_member(params: list[Tensor], max_norm: float) -> Tensor:
    """``clip_grad_norm_`` for each member separately; returns the ``(K,)`` norms.

    Member ``k``'s norm is the 2-norm of its per-tensor gradient norms (in parameter
    order), and its gradients are scaled by ``min(max_norm / (norm + 1e-6), 1)``.
    """
    k = params[0].shape[0]
    per_tensor = torch.stack(
        [torch.linalg.vector_norm(p.grad.reshape(k, -1), dim=1) for p in params], dim=1)
    total = torch.linalg.vector_norm(per_tensor, dim=1)  # (K,)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coef.view(k, *([1] * (p.dim() - 1))))
    return total


class PackedTrainer:
    """The training state of a pack: the stacked model, one AdamW over the stacked tensors
    (per-member exact: AdamW is elementwise) and one :class:`Sampler` per member."""

    def __init__(self, cfgs: list[TrialConfig], corpus: Corpus) -> None:
        self.cfg = cfgs[0]
        shape = ("n_layer", "n_embd", "n_head", "block_size", "batch_size", "max_steps")
        for c in cfgs:
            if any(getattr(c, f) != getattr(self.cfg, f) for f in shape):
                raise ValueError("the members of a pack must share their shape and steps")
        models = []
        for c in cfgs:
            torch.manual_seed(c.rng_seed)  # as TrainingRun: init (and dropout) stream
            models.append(GPT(c, corpus.vocab_size))
        self.model = PackedGPT(models)
        params = self.model.parameters()
        cfg = self.cfg
        groups = [  # make_optimizer: decay on matrices (member dimension 3 when stacked)
            {"params": [p for p in params if p.dim() >= 3], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 3], "weight_decay": 0.0},
        ]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
        self.samplers = [Sampler(corpus.train, c.block_size, c.batch_size, c.rng_seed)
                         for c in cfgs]
        self.step = 0

    def train_step(self) -> Tensor:
        """One optimizer step of every member; returns the ``(K,)`` losses (detached)."""
        lr = lr_at(self.cfg, self.step)
        for g in self.opt.param_groups:
            g["lr"] = lr
        batches = [s.next() for s in self.samplers]
        x = torch.stack([xb for xb, _ in batches])
        y = torch.stack([yb for _, yb in batches])
        logits = self.model.forward(x)
        losses = torch.stack([F.cross_entropy(lg.float(), yk.reshape(-1))
                              for lg, yk in zip(logits.unbind(0), y.unbind(0))])
        self.opt.zero_grad(set_to_none=True)
        losses.sum().backward()
        if self.cfg.grad_clip > 0:
            clip_per_member(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        return losses.detach()


# ---------------------------------------------------------------------- workers
def _timed_loop(step_fn: Any, steps: int) -> tuple[list[Tensor], float]:
    """Run ``steps`` steps; returns each step's losses and the seconds of the steps after
    the first ``WARMUP_STEPS``."""
    losses: list[Tensor] = []
    t0 = 0.0
    for s in range(steps):
        if s == WARMUP_STEPS:
            t0 = time.perf_counter()
        losses.append(step_fn().detach().reshape(-1))
    return losses, time.perf_counter() - t0


def worker(kind: str, width: int, members: list[int], steps: int, data: str,
           out: str | None) -> None:
    """Body of a worker process: ``packed`` (one pack of ``members``), ``separate`` (one
    trial, ``members == [i]``) or ``filler`` (a trial that trains until it is killed)."""
    t_start = time.perf_counter()
    torch.set_num_threads(1)
    corpus = load_corpus(data)
    if kind == "filler":
        tr = TrainingRun(member_config(width, 0, 10**9, data), corpus)
        while True:
            tr.train_step()
    cfgs = [member_config(width, i, steps, data) for i in members]
    if kind == "packed":
        pk = PackedTrainer(cfgs, corpus)
        losses, loop_s = _timed_loop(pk.train_step, steps)
        params = {n: t.detach().clone() for n, t in pk.model.params.items()}
    else:
        tr = TrainingRun(cfgs[0], corpus)
        losses, loop_s = _timed_loop(tr.train_step, steps)
        params = {n: t.detach().clone()[None] for n, t in tr.model.named_parameters()}
    assert out is not None
    torch.save({"losses": torch.stack(losses, dim=1),  # (members, steps)
                "params": params, "loop_s": loop_s,
                "wall_s": time.perf_counter() - t_start, "threads": torch.get_num_threads()},
               out)


def _spawn(kind: str, width: int, members: list[int], steps: int, data: str,
           out: str | None) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind,
           "--widths", str(width), "--members", ",".join(map(str, members)),
           "--steps", str(steps), "--data", data]
    if out is not None:
        cmd += ["--out", out]
    return subprocess.Popen(cmd)


# ---------------------------------------------------------------------- one phase
@dataclass
class Row:
    width: int
    k: int
    steps: int
    timed_steps: int
    packed_tokens_per_s: float  # per core (one thread), training loop only
    separate_tokens_per_s: float  # per core (one thread), training loops only
    ratio: float  # packed / separate
    packed_wall_tokens_per_s: float  # all steps over the pack process's wall time
    separate_wall_tokens_per_s: float  # all steps over the K processes' wall time
    ratio_wall: float
    max_loss_diff: float
    max_param_diff: float
    bit_identical: bool
    within_tolerance: bool


def _check(proc: subprocess.Popen, what: str) -> None:
    if proc.returncode != 0:
        raise RuntimeError(f"{what} worker exited with status {proc.returncode}")


def phase(width: int, k: int, steps: int, data: str, tmp: Path) -> Row:
    """The packed process and the slot of ``k`` separate processes side by side, a filler
    on whichever core frees first (see the module docstring)."""
    members = list(range(k))
    packed_out = str(tmp / f"packed-{width}-{k}.pt")
    sep_out = [str(tmp / f"separate-{width}-{k}-{i}.pt") for i in members]
    packed = _spawn("packed", width, members, steps, data, packed_out)
    todo = list(members)
    current: subprocess.Popen | None = None
    filler: subprocess.Popen | None = None
    packed_done = False
    try:
        while True:
            if current is not None and current.poll() is not None:
                _check(current, "separate")
                current = None
            if current is None and todo:
                i = todo.pop(0)
                current = _spawn("separate", width, [i], steps, data, sep_out[i])
            slot_done = current is None and not todo
            if not packed_done and packed.poll() is not None:
                _check(packed, "packed")
                packed_done = True
            if packed_done and slot_done:
                break
            if (packed_done or slot_done) and filler is None:
                filler = _spawn("filler", width, [0], steps, data, None)
            time.sleep(POLL_S)
    finally:
        for p in (filler, current, packed):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    pk = torch.load(packed_out, weights_only=False)
    seps = [torch.load(f, weights_only=False) for f in sep_out]
    cfg = member_config(width, 0, steps, data)
    step_tokens = cfg.batch_size * cfg.block_size
    timed = steps - WARMUP_STEPS
    tokens = k * timed * step_tokens
    packed_rate = tokens / pk["loop_s"]
    sep_rate = tokens / sum(s["loop_s"] for s in seps)
    dloss = max(float((pk["losses"][i] - s["losses"][0]).abs().max())
                for i, s in enumerate(seps))
    dparam = max(float((pk["params"][n][i] - s["params"][n][0]).abs().max())
                 for i, s in enumerate(seps) for n in pk["params"])
    all_tokens = k * steps * step_tokens
    packed_wall = all_tokens / pk["wall_s"]
    sep_wall_rate = all_tokens / sum(s["wall_s"] for s in seps)
    return Row(width, k, steps, timed, packed_rate, sep_rate, packed_rate / sep_rate,
               packed_wall, sep_wall_rate, packed_wall / sep_wall_rate, dloss, dparam,
               dloss == 0 and dparam == 0, max(dloss, dparam) <= TOLERANCE)


def decide(rows: list[Row]) -> str:
    w, k = DECISION_CELL
    cell = [r for r in rows if (r.width, r.k) == (w, k)]
    if not cell:
        return f"not decided: the run has no {w}/{w} K={k} cell"
    r = cell[0]
    verb = "wins" if r.ratio >= THRESHOLD else "does not win"
    return (f"packing {verb} on CPU: {r.ratio:.3f} at {w}/{w} K={k} "
            f"(threshold >= {THRESHOLD})")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps per member (default: 100 x (48/width)^2, >= 30)")
    ap.add_argument("--widths", default="48,128", help="ladder cells w/w (n_embd = context)")
    ap.add_argument("--ks", default="1,2,4,8", help="members per pack")
    ap.add_argument("--json", action="store_true", help="print one JSON object only")
    ap.add_argument("--data", default=default_source())
    ap.add_argument("--worker", choices=("packed", "separate", "filler"), help=argparse.SUPPRESS)
    ap.add_argument("--members", default="0", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    widths, ks = _ints(args.widths), _ints(args.ks)
    if args.worker:
        worker(args.worker, widths[0], _ints(args.members), args.steps, args.data, args.out)
        return
    load_corpus(args.data)  # encode and cache once, before the workers open it
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="qkgeom-packed-") as tmp:
        for w in widths:
            steps = args.steps or default_steps(w)
            if steps <= WARMUP_STEPS:
                ap.error(f"--steps must exceed the {WARMUP_STEPS} untimed warm-up steps")
            for k in ks:
                rows.append(phase(w, k, steps, args.data, Path(tmp)))
                if not args.json:
                    r = rows[-1]
                    print(f"  {w}/{w} K={k}: ratio {r.ratio:.3f}, max diff "
                          f"{max(r.max_loss_diff, r.max_param_diff):.3g}", flush=True)
    out: dict[str, Any] = {
        "threads_per_process": 1,
        "warmup_steps": WARMUP_STEPS,
        "tolerance": TOLERANCE,
        "threshold": THRESHOLD,
        "decision_cell": list(DECISION_CELL),
        "decision": decide(rows),
        "all_within_tolerance": all(r.within_tolerance for r in rows),
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
        "wall_s": time.perf_counter() - t0,
        "rows": [asdict(r) for r in rows],
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"one thread per process, two processes at a time on 2 cores; tokens/s per "
              f"core over the training loops (first {WARMUP_STEPS} steps untimed); wall: "
              "all steps over the processes' whole run")
        print("| width | K | steps | packed tok/s/core | separate tok/s/core | ratio | "
              "wall ratio | max abs diff (loss, params) |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r.width}/{r.width} | {r.k} | {r.steps} | {r.packed_tokens_per_s:,.0f} | "
                  f"{r.separate_tokens_per_s:,.0f} | **{r.ratio:.3f}** | {r.ratio_wall:.3f} | "
                  f"{r.max_loss_diff:.3g}, {r.max_param_diff:.3g} |")
        print(f"tolerance {TOLERANCE:g}: "
              f"{'all within' if out['all_within_tolerance'] else 'EXCEEDED'}; "
              f"load {load_before[0]:.2f} -> {out['load_after'][0]:.2f}; "
              f"{out['wall_s']:.0f} s")
        print(out["decision"])
    if not out["all_within_tolerance"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
