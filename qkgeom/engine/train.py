"""One trial: train a char-level GPT and probe its geometry as it trains. No Ray here.

``train(cfg, report)`` calls ``report(record, checkpoint)`` (a :data:`ProbeCallback`) at
step 0, every ``cfg.probe_every`` steps and at the last step, where ``record`` is a
:class:`~qkgeom.records.ProbeRecord` and ``checkpoint`` the directory of a checkpoint
written at that step (or ``None``). A checkpoint holds the model, optimizer, data-sampler,
rng and intervention state, so ``train(cfg, report, resume_from=dir)`` continues with
exactly the numbers an uninterrupted run would produce. A *weight snapshot*
(``snapshot_dir``) is smaller: the model weights, config and vocabulary at a probe step,
all that measuring the model later needs, and nothing a resume needs.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from qkgeom.atomic import atomic_path
from qkgeom.config import TrialConfig
from qkgeom.engine.data import Corpus, Sampler, fixed_starts, load_corpus, unigram_entropy, windows
from qkgeom.engine.intervention import KeySpectrumControl
from qkgeom.engine.model import GPT
from qkgeom.engine.probe import probe_model
from qkgeom.records import ProbeRecord, StepRecord, TrialResult

# called with each probe's record and the checkpoint written at its step (or None)
ProbeCallback = Callable[[ProbeRecord, "str | None"], None]
ProgressFn = Callable[[int, dict[str, Any]], None]

# Seeds of the fixed held-out batches: shared by every trial so probes compare like with like.
PROBE_SEED, VAL_SEED, TEST_SEED = 2024, 12345, 4242
STATE_FILE = "state.pt"


class InjectedFailure(RuntimeError):
    """Raised by ``cfg.fail_at_step`` (test-only) to exercise retries and resumes."""


def pick_device(cfg: TrialConfig) -> torch.device:
    if cfg.device != "auto":
        return torch.device(cfg.device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def lr_at(cfg: TrialConfig, step: int) -> float:
    """Linear warm-up to ``cfg.lr`` over ``cfg.warmup`` steps, then cosine decay to
    ``cfg.min_lr`` at ``max_steps``."""
    warmup = cfg.warmup
    if step < warmup:
        return cfg.lr * (step + 1) / (warmup + 1)
    span = max(cfg.max_steps - warmup, 1)
    u = min((step - warmup) / span, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * u))


def make_optimizer(cfg: TrialConfig, model: GPT) -> torch.optim.AdamW:
    """AdamW with decay on matrices only; the fused kernel when the model is on CUDA."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = bool(params) and params[0].device.type == "cuda"
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                             fused=fused or None)


@torch.no_grad()
def mean_loss(model: GPT, data: np.ndarray, starts: np.ndarray, cfg: TrialConfig,
              device: torch.device, amp: contextlib.AbstractContextManager) -> float:
    """Mean next-character loss (nats/char) over the windows at ``starts``.

    Summed on the device in float64 and read once (one host-device sync per evaluation);
    on CPU the same additions in the same order as a Python float sum.
    """
    was = model.training
    model.eval()
    total, n = torch.zeros((), dtype=torch.float64, device=device), 0
    for i in range(0, len(starts), cfg.batch_size):
        x, y = windows(data, starts[i : i + cfg.batch_size], cfg.block_size, device)
        with amp:
            total += model.loss(x, y).detach().double() * len(x)
        n += len(x)
    model.train(was)
    return float(total) / n


class LossSum:
    """Sum and count of training losses since the last read, the sum kept on the device.

    ``add`` never waits for the device; ``take`` reads the sum (one sync) and restarts.
    float64 on CPU and CUDA: the same additions as a Python float sum, so the same numbers.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self, total: float = 0.0, n: int = 0) -> None:
        self.sum = torch.tensor(total, dtype=torch.float64, device=self.device)
        self.n = n

    def add(self, loss: torch.Tensor) -> None:
        self.sum += loss.detach().double()
        self.n += 1

    def take(self) -> tuple[float, int]:
        out = (float(self.sum), self.n)
        self.reset()
        return out

    def state(self) -> list:
        return [float(self.sum), self.n]  # the checkpoint format of earlier versions


class TrainingRun:
    """The state of one training run (model, optimizer, sampler, intervention, counters):
    what :meth:`save` checkpoints and :meth:`load` restores. Its database row is another
    thing, :class:`qkgeom.store.models.Trial`."""

    def __init__(self, cfg: TrialConfig, corpus: Corpus | None = None) -> None:
        self.cfg = cfg
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        self.device = pick_device(cfg)
        self.corpus = corpus or load_corpus(cfg.dataset)
        torch.manual_seed(cfg.rng_seed)  # init and dropout (cfg.seed_stream: derived)
        self.model = GPT(cfg, self.corpus.vocab_size).to(self.device)
        self.opt = make_optimizer(cfg, self.model)
        self.control = KeySpectrumControl(cfg, self.model)
        self.sampler = Sampler(self.corpus.train, cfg.block_size, cfg.batch_size,
                               cfg.rng_seed)
        val = self.corpus.val
        self.val_starts = fixed_starts(val, cfg.block_size, cfg.eval_batches * cfg.batch_size,
                                       VAL_SEED)
        self.probe_x, _ = windows(val, fixed_starts(val, cfg.block_size, cfg.probe_batch,
                                                    PROBE_SEED), cfg.block_size, self.device)
        self.step = 0
        self.tokens = 0
        self.loss_acc = LossSum(self.device)  # since the last StepRecord
        self.probe_loss_acc = LossSum(self.device)  # since the last probe
        self.history: list[StepRecord] = []
        self.amp = (torch.autocast("cuda", dtype=torch.bfloat16)
                    if self.device.type == "cuda" else contextlib.nullcontext())
        self.fwd = torch.compile(self.model) if cfg.compile else self.model

    # ---------------------------------------------------------------- checkpoints
    def save(self, directory: str | Path) -> str:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        state = {
            "config": self.cfg.to_dict(),
            "corpus_key": self.corpus.key,
            "chars": self.corpus.chars,
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "sampler": self.sampler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "control": self.control.state_dict(),
            "step": self.step,
            "tokens": self.tokens,
            "loss_acc": self.loss_acc.state(),
            "probe_loss_acc": self.probe_loss_acc.state(),
        }
        with atomic_path(d / STATE_FILE) as tmp:  # a crash never leaves half a checkpoint
            torch.save(state, tmp)
        return str(d)

    def save_weights(self, directory: str | Path) -> str:
        """A weight snapshot: model weights, config and vocabulary (no optimizer state).

        The same ``state.pt`` layout as :meth:`save`, so whatever reads a checkpoint's
        model (``qkgeom probe-pretrained --checkpoints``) reads a snapshot too.
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        state = {
            "kind": "snapshot",
            "config": self.cfg.to_dict(),
            "corpus_key": self.corpus.key,
            "chars": self.corpus.chars,
            "model": self.model.state_dict(),
            "step": self.step,
            "tokens": self.tokens,
        }
        with atomic_path(d / STATE_FILE) as tmp:
            torch.save(state, tmp)
        return str(d)

    def load(self, directory: str | Path) -> None:
        path = Path(directory) / STATE_FILE
        state = torch.load(path, map_location=self.device, weights_only=False)
        if state["corpus_key"] != self.corpus.key:
            raise ValueError(f"checkpoint {path} was trained on a different corpus")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optimizer"])
        self.sampler.load_state_dict(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.control.load_state_dict(state["control"])
        self.step, self.tokens = state["step"], state["tokens"]
        self.loss_acc.reset(*state["loss_acc"])
        self.probe_loss_acc.reset(*state["probe_loss_acc"])

    # ---------------------------------------------------------------- steps
    def train_step(self) -> torch.Tensor:
        """One optimizer step; returns the step's loss as a detached 0-d device tensor.

        Nothing here waits for the device (reading the loss would): the loss is summed on
        the device and read at ``log_every`` and probe steps.
        """
        cfg = self.cfg
        lr = lr_at(cfg, self.step)
        for g in self.opt.param_groups:
            g["lr"] = lr
        x, y = self.sampler.next(self.device)
        with self.amp:
            logits = self.fwd(x)
            loss = torch.nn.functional.cross_entropy(
                logits.view(-1, logits.size(-1)).float(), y.reshape(-1)
            )
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        self.opt.step()
        self.step += 1
        self.control.after_step(self.step)
        self.tokens += x.numel()
        self.loss_acc.add(loss)
        self.probe_loss_acc.add(loss)
        return loss.detach()

    def val_loss(self) -> float:
        return mean_loss(self.model, self.corpus.val, self.val_starts, self.cfg, self.device,
                         self.amp)

    def probe(self, val_loss: float, tokens_per_s: float) -> ProbeRecord:
        with self.amp:
            rows = probe_model(self.model, self.probe_x)
        tgt = self.control.targets_now()
        if tgt is not None:
            rows += [(li, None, "wk_target_pr", float(v)) for li, v in enumerate(tgt)]
        s, n = self.probe_loss_acc.take()
        rec = ProbeRecord(
            step=self.step,
            progress=self.step / self.cfg.max_steps,
            tokens=self.tokens,
            train_loss=s / n if n else math.nan,
            val_loss=val_loss,
            lr=lr_at(self.cfg, self.step),
            tokens_per_s=tokens_per_s,
            metrics=rows,
            history=self.history,
        )
        self.history = []
        return rec


def checkpoint_step(directory: str | Path) -> int:
    """The training step a checkpoint directory (:meth:`TrainingRun.save`) holds."""
    state = torch.load(Path(directory) / "state.pt", map_location="cpu", weights_only=False)
    return int(state["step"])


def train(cfg: TrialConfig, report: ProbeCallback | None = None, **kw: Any) -> TrialResult:
    """Run one trial; see the module docstring for the ``report`` protocol and
    :func:`training` for the keyword arguments."""
    steps = training(cfg, report, **kw)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def training(
    cfg: TrialConfig,
    report: ProbeCallback | None = None,
    *,
    checkpoint_dir: str | Path | None = None,
    resume_from: str | Path | None = None,
    snapshot_dir: str | Path | None = None,
    snapshot_every: int = 0,
    progress: ProgressFn | None = None,
    corpus: Corpus | None = None,
) -> Generator[int, None, TrialResult]:
    """:func:`train` one step at a time: yields the step number after each optimizer step
    (after that step's evaluation, probe and ``progress`` call) and returns the
    :class:`TrialResult` (``StopIteration.value``). Set-up and the step-0 probe run on the
    first ``next``; the test-loss pass on the one after the last step. A caller can
    interleave several trials step by step (``benchmarks/train_throughput.py`` does).

    ``checkpoint_dir``: where to write ``step_NNNNNNN/`` checkpoints (at probe steps that
    are multiples of ``cfg.checkpoint_every``, or every probe when it is 0); ``None``
    writes none. ``resume_from``: a checkpoint directory to continue from.
    ``snapshot_dir``: where to write ``step_NNNNNNN/`` weight snapshots, before ``report``
    sees the step: at probe steps that are multiples of ``snapshot_every`` (every probe
    when it is 0) and at the last step.
    ``progress(step, info)`` is called after every step with loss/throughput for displays;
    ``info["loss"]`` is a 0-d tensor (formatting it reads it: a device sync on CUDA).
    """
    t_start = time.perf_counter()
    tr = TrainingRun(cfg, corpus)
    if resume_from is not None:
        tr.load(resume_from)

    def emit(rec: ProbeRecord) -> None:
        ckpt = None
        due = cfg.checkpoint_every == 0 or rec.step % cfg.checkpoint_every == 0
        if checkpoint_dir is not None and (due or rec.step == cfg.max_steps):
            ckpt = tr.save(Path(checkpoint_dir) / f"step_{rec.step:07d}")
        snap_due = snapshot_every == 0 or rec.step % snapshot_every == 0
        if snapshot_dir is not None and (snap_due or rec.step == cfg.max_steps):
            tr.save_weights(Path(snapshot_dir) / f"step_{rec.step:07d}")
        if report is not None:
            report(rec, ckpt)

    if tr.step == 0:
        emit(tr.probe(tr.val_loss(), 0.0))
    timer = StepTimer()
    last_val = yield from _train_to_end(tr, emit, progress, timer,
                                        resumed=resume_from is not None)
    return _result(tr, last_val, timer, t_start)


@dataclass
class Span:
    """Training-only seconds and tokens summed over a span of steps."""

    seconds: float = 0.0
    tokens: int = 0

    def rate(self) -> float:
        """Tokens per second over the span (0 when it is empty)."""
        return self.tokens / max(self.seconds, 1e-9)

    def take_rate(self) -> float:
        """:meth:`rate`, then start a new span."""
        r = self.rate()
        self.seconds, self.tokens = 0.0, 0
        return r


class StepTimer:
    """Training-only time and tokens (probes and evaluation excluded) over three spans:
    since the last history record (``window``), since the last probe (``probe``) and
    over the whole run (``total``)."""

    def __init__(self) -> None:
        self.window, self.probe, self.total = Span(), Span(), Span()

    def add(self, seconds: float, tokens: int) -> None:
        for span in (self.window, self.probe, self.total):
            span.seconds += seconds
            span.tokens += tokens


def _train_to_end(tr: TrainingRun, emit: Callable[[ProbeRecord], None],
                  progress: ProgressFn | None, timer: StepTimer, *,
                  resumed: bool) -> Generator[int, None, float]:
    """Train from ``tr.step`` to ``max_steps``: history at log/eval/probe steps, a probe
    (``emit``) at probe steps; yields each step number. Returns the last validation loss
    (NaN if none)."""
    cfg = tr.cfg
    last_val = math.nan
    while tr.step < cfg.max_steps:
        if cfg.fail_at_step >= 0 and tr.step == cfg.fail_at_step and not resumed:
            raise InjectedFailure(f"fail_at_step={cfg.fail_at_step}: injected test failure")
        t0 = time.perf_counter()
        loss = tr.train_step()
        if tr.device.type == "cuda" and tr.step % cfg.log_every == 0:
            torch.cuda.synchronize()
        timer.add(time.perf_counter() - t0, cfg.batch_size * cfg.block_size)
        step = tr.step
        is_eval = step % cfg.eval_every == 0 or step == cfg.max_steps
        is_probe = step % cfg.probe_every == 0 or step == cfg.max_steps
        val = tr.val_loss() if (is_eval or is_probe) else math.nan
        if not math.isnan(val):
            last_val = val
        if step % cfg.log_every == 0 or is_eval or is_probe:
            s, n = tr.loss_acc.take()
            tr.history.append(StepRecord(step, s / n if n else math.nan, val,
                                         lr_at(cfg, step - 1), timer.window.take_rate()))
        if is_probe:
            emit(tr.probe(val, timer.probe.take_rate()))
        if progress is not None:
            progress(step, {"loss": loss, "val_loss": last_val,
                            "tokens_per_s": timer.total.rate()})
        yield step
    return last_val


def _result(tr: TrainingRun, last_val: float, timer: StepTimer, t_start: float) -> TrialResult:
    """The trial's summary: test loss on the fixed test batches, throughput, where."""
    cfg = tr.cfg
    test_starts = fixed_starts(tr.corpus.test, cfg.block_size, cfg.test_batches * cfg.batch_size,
                               TEST_SEED)
    test_loss = mean_loss(tr.model, tr.corpus.test, test_starts, cfg, tr.device, tr.amp)
    return TrialResult(
        steps=tr.step,
        final_val_loss=last_val if not math.isnan(last_val) else tr.val_loss(),
        test_loss=test_loss,
        unigram_entropy=unigram_entropy(tr.corpus.test),
        wall_s=time.perf_counter() - t_start,
        tokens_per_s=timer.total.rate(),
        device=str(tr.device),
        data_note=tr.corpus.note,
        n_params=tr.model.n_params(),
        extra={"host": socket.gethostname(), "pid": os.getpid(), "vocab_size":
               tr.corpus.vocab_size},
    )
