"""Plain helpers shared by the tests: the in-process CLI (:func:`run`, :func:`invoke`),
probe records, a free port, child-process writers. Every fixture lives in
tests/conftest.py; this module holds functions only, so test modules import them without
pytest's assertion-rewrite warning.
"""

from __future__ import annotations

import math
import socket

from qkgeom.records import METRICS, ProbeRecord, StepRecord


def free_port() -> int:
    """A TCP port on 127.0.0.1 with nothing listening (for unreachable-server tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_record(step: int, *, n_layer: int = 8, n_head: int = 4, value: float | None = None,
                max_steps: int = 1000, history: int = 0) -> ProbeRecord:
    """A realistic probe record: every metric of METRICS per layer (head NULL) and, for
    per-head metrics, per head. Values are ``value`` or a deterministic function."""
    rows: list[tuple[int, int | None, str, float]] = []
    for layer in range(n_layer):
        for i, (name, info) in enumerate(METRICS.items()):
            heads = [None] + (list(range(n_head)) if info["per_head"] else [])
            for h in heads:
                v = value if value is not None else step * 0.001 + layer + i * 0.1 + (
                    0.0 if h is None else 0.01 * (h + 1))
                rows.append((layer, h, name, v))
    hist = [StepRecord(step=step - k, train_loss=2.0 + k, val_loss=math.nan, lr=1e-3,
                       tokens_per_s=1000.0) for k in range(history, 0, -1) if step - k >= 0]
    return ProbeRecord(step=step, progress=step / max_steps, tokens=step * 512,
                       train_loss=math.nan if step == 0 else 2.5, val_loss=2.6, lr=1e-3,
                       tokens_per_s=0.0 if step == 0 else 1234.5, metrics=rows, history=hist)


def writer_process(url: str, trial_key: str, n_probes: int, queue) -> None:
    """Child process body for the concurrency test: open, write n_probes one by one."""
    try:
        from qkgeom.store import open_store

        with open_store(url) as store:
            sid = store.ensure_sweep("concurrent", {"n": n_probes}, "test")
            tid = store.ensure_trial(sid, trial_key, {"key": trial_key}, depth=2,
                                     init="gaussian", arm="none", seed=0)
            store.set_trial_status(tid, "running", bump_attempts=True)
            written = 0
            for step in range(n_probes):
                rec = make_record(step, n_layer=2, n_head=2, history=2)
                store.write_probe(tid, rec)
                written += len(rec.metrics)
            store.set_trial_status(tid, "terminated")
        queue.put((trial_key, written, None))
    except BaseException as e:  # reported to the parent, which fails the test
        queue.put((trial_key, 0, f"{type(e).__name__}: {e}"))


def run(*args: str) -> tuple[int, str]:
    """Run the qkgeom CLI in-process: (exit code, output)."""
    r = invoke(*args)
    return r.exit_code, r.output


def invoke(*args: str, env: dict | None = None):
    """Run the qkgeom CLI in-process; returns click's Result."""
    from click.testing import CliRunner

    from qkgeom.cli import main

    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)
