"""Checkpoint families over Ray: one Ray task per revision, stored as each one finishes.

``qkgeom probe-pretrained --revisions r1,r2,... --ray`` (a local Ray instance) or
``--address HOST:PORT`` (a running cluster) runs :func:`qkgeom.pretrained.runs.measure_job` for
each revision as a Ray task with ``cpus_per_revision`` CPUs and ``gpus_per_revision``
(fractional) GPUs. Tasks only measure; the driver writes each revision's rows to the
database the moment its task returns, so workers need no database access and an
interrupted family keeps every finished revision (a rerun skips them). A task that fails
with anything but a :class:`~qkgeom.errors.QkgeomError` (a deterministic, user-facing
error) is resubmitted up to ``retries`` times; a crashed worker process is retried by Ray
itself (``max_retries``). Failures are reported per revision at the end.

Test only (like training's ``fail_at_step``): ``$QKGEOM_TEST_FAIL_REVISION`` set to
``LABEL[:N],...`` makes revision LABEL's task raise :class:`qkgeom.engine.train.InjectedFailure` on
its first N attempts (default 1), a real failed Ray task that exercises ``--retries``.

Ray is started and stopped by :mod:`qkgeom.sweeps.ray_session` (as for ``qkgeom sweep``:
the same local instance set-up, clean-up and orphan reaper).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkgeom.errors import QkgeomError
from qkgeom.pretrained.base import PretrainedError
from qkgeom.pretrained.runs import RevisionJob, Stored, measure_job

if TYPE_CHECKING:
    from qkgeom.store import Store

FAULT_ENV = "QKGEOM_TEST_FAIL_REVISION"


@dataclass
class RayOptions:
    """Where and with what resources revisions run (see ``probe-pretrained --help``)."""

    address: str | None = None  # None: a local Ray instance
    cpus_per_revision: float = 1.0
    gpus_per_revision: float = 0.0
    retries: int = 2
    num_cpus: int | None = None  # local instance only (default: all cores)


def injected_faults(spec: str | None) -> dict[str, int]:
    """TEST ONLY: ``$QKGEOM_TEST_FAIL_REVISION`` (``LABEL[:N],...``) as {label: attempts to
    fail}; empty when unset."""
    out: dict[str, int] = {}
    for part in (spec or "").split(","):
        label, _, n = part.strip().partition(":")
        if label:
            if n and not n.isdigit():
                raise PretrainedError(f"${FAULT_ENV}: {part!r} is not LABEL or LABEL:N "
                                      "(a test-only setting: unset it)")
            out[label] = int(n or 1)
    return out


def _measure_task(job: RevisionJob, text: str, text_path: str, kw: dict, threads: int,
                  attempt: int = 1, fail_attempts: int = 0) -> tuple[list, dict, float]:
    """Body of a Ray task: measure one revision and return its rows (stored by the driver).

    ``attempt``: 1 for the first submission; attempts up to ``fail_attempts`` (test only,
    :func:`injected_faults`) raise before measuring.
    """
    import socket

    import torch

    if attempt <= fail_attempts:
        from qkgeom.engine.train import InjectedFailure

        raise InjectedFailure(f"{FAULT_ENV}: injected failure of {job.label}, attempt "
                              f"{attempt} of the first {fail_attempts}")
    torch.set_num_threads(max(1, threads))
    if kw.get("device", "cpu") == "cpu" and os.environ.get("CUDA_VISIBLE_DEVICES") \
            and kw.pop("_gpu", False):
        kw["device"] = "cuda"
    kw.pop("_gpu", None)
    t0 = time.perf_counter()
    m = measure_job(job, text, text_path, **kw)
    m.meta["host"] = socket.gethostname()
    return m.rows, m.meta, time.perf_counter() - t0


def _one_line(e: BaseException) -> str:
    cause = getattr(e, "cause", None) or e
    msg = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {msg[-1] if msg else ''}".strip()


def _cluster_resources(opts: RayOptions) -> dict[str, float]:
    """The connected cluster's resources; a :class:`PretrainedError` if one revision's task
    can never be placed on it."""
    import ray

    res = ray.cluster_resources()
    if opts.gpus_per_revision > 0 and res.get("GPU", 0) < opts.gpus_per_revision:
        raise PretrainedError(f"--gpus-per-revision {opts.gpus_per_revision} but the Ray "
                              f"cluster has {res.get('GPU', 0):g} GPUs; lower it or "
                              "add GPU nodes")
    if res.get("CPU", 0) < opts.cpus_per_revision:
        raise PretrainedError(f"--cpus-per-revision {opts.cpus_per_revision} but the Ray "
                              f"cluster has {res.get('CPU', 0):g} CPUs")
    return res


def run_on_ray(name: str, jobs: list[RevisionJob], text: str, text_path: str | Path, *,
               store: Store | None, opts: RayOptions,
               note: Callable[[str], None] | None = None, **kw: Any) -> list[Stored]:
    """Measure ``jobs`` as Ray tasks; store each result as it arrives; return what was stored.

    Raises :class:`PretrainedError` after all tasks have ended if any revision failed
    (every other revision is stored by then), naming each failed revision and its error.
    """
    import ray

    from qkgeom.sweeps.ray_session import ray_running

    say = note or (lambda _m: None)
    if opts.gpus_per_revision < 0 or opts.cpus_per_revision <= 0:
        raise PretrainedError("--gpus-per-revision must be >= 0 and --cpus-per-revision > 0")
    faults = injected_faults(os.environ.get(FAULT_ENV))
    with ray_running(opts.address, num_cpus=opts.num_cpus):
        res = _cluster_resources(opts)
        task = ray.remote(_measure_task).options(
            num_cpus=opts.cpus_per_revision, num_gpus=opts.gpus_per_revision,
            max_retries=opts.retries)  # worker crashes; exceptions are retried below
        text_ref = ray.put(text)
        kw = dict(kw, _gpu=opts.gpus_per_revision > 0)
        threads = max(1, int(opts.cpus_per_revision))

        def submit(job: RevisionJob, attempt: int) -> Any:
            return task.remote(job, text_ref, str(text_path), dict(kw), threads, attempt,
                               faults.get(job.label, 0))

        pending = {submit(j, 1): (j, 1) for j in jobs}
        n = len(jobs)
        say(f"{name}: {n} revision(s) as Ray tasks ({opts.cpus_per_revision:g} CPU, "
            f"{opts.gpus_per_revision:g} GPU each) on {res.get('CPU', 0):g} CPUs, "
            f"{res.get('GPU', 0):g} GPUs")
        t0 = time.perf_counter()
        out: list[Stored] = []
        failed: list[tuple[str, str]] = []
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            ref = ready[0]
            job, attempt = pending.pop(ref)
            try:
                rows, meta, wall = ray.get(ref)
            except Exception as e:  # RayTaskError wraps the task's own exception
                msg = _one_line(e)
                user = isinstance(getattr(e, "cause", None), QkgeomError)
                if not user and attempt <= opts.retries:
                    say(f"  {job.label}: attempt {attempt} failed ({msg}); retrying")
                    pending[submit(job, attempt + 1)] = (job, attempt + 1)
                    continue
                failed.append((job.label, msg))
                say(f"  [{len(out) + len(failed)}/{n}] {job.label}: FAILED after {attempt} "
                    f"attempt(s): {msg}")
                continue
            rid = store.write_pretrained(name, job.label, job.step, meta, rows) \
                if store is not None else None
            out.append(Stored(name, job.label, job.step, rid, len(rows), meta))
            say(f"  [{len(out) + len(failed)}/{n}] {job.label}: {meta['tokens']:,} tokens in "
                f"{wall:,.1f} s on {meta.get('host', '?')}; stored as run {rid} "
                f"({time.perf_counter() - t0:,.0f} s elapsed)")
    if failed:
        raise PretrainedError(
            f"{len(failed)} of {n} revision(s) failed ("
            + "; ".join(f"{lab}: {msg}" for lab, msg in failed)
            + f"); the other {len(out)} are stored: fix the cause and rerun (stored "
            "revisions are skipped)")
    return out
