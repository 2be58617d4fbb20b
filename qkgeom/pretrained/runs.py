"""Measuring a family of revisions and storing each: the drivers behind ``probe-pretrained``.

A family is a list of :class:`RevisionJob` (Hub revisions of one transformers model, or a
qkgeom trial's checkpoints); :func:`run_jobs` skips revisions already stored, measures the
rest here or as Ray tasks (:mod:`qkgeom.pretrained.ray_probe`), and stores each through
:meth:`qkgeom.store.Store.write_pretrained`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qkgeom.pretrained.base import (
    DEFAULT_CHUNK_TOKENS,
    DEFAULT_ERANK_SEQS,
    DEFAULT_MAX_TOKENS,
    Measurement,
    PretrainedError,
    TokenProgress,
)
from qkgeom.pretrained.capture import measure_hf
from qkgeom.pretrained.checkpoints import (
    load_checkpoint,
    measure_gpt,
    resolve_checkpoints,
    revision_step,
)
from qkgeom.pretrained.load import is_local, load_hf
from qkgeom.pretrained.text import read_text

if TYPE_CHECKING:
    from qkgeom.pretrained.ray_probe import RayOptions
    from qkgeom.store import Store


@dataclass
class Stored:
    model: str
    revision: str
    step: int | None
    run_id: int | None
    n_rows: int
    meta: dict[str, Any]


@dataclass
class RevisionJob:
    """One revision of a family to measure: a Hub/local transformers model at a revision,
    or one qkgeom checkpoint directory (``location``: a path or URI)."""

    label: str
    step: int | None
    source: str  # "transformers" | "qkgeom"
    model_id: str | None = None
    revision: str | None = None
    gguf_file: str | None = None
    dtype: str = "float32"
    seq_len: int | None = None
    location: str | None = None


def measure_job(job: RevisionJob, text: str, text_path: str | Path, *,
                max_tokens: int | None = DEFAULT_MAX_TOKENS,
                chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                erank_seqs: int = DEFAULT_ERANK_SEQS, device: str = "cpu",
                prerot: bool = False, progress: TokenProgress | None = None) -> Measurement:
    """Load and measure one revision (in this process, or inside a Ray task)."""
    if job.source == "qkgeom":
        model, chars, cfg = load_checkpoint(job.location, device)
        m = measure_gpt(model, chars, text, max_tokens=max_tokens, chunk_tokens=chunk_tokens,
                        erank_seqs=erank_seqs, progress=progress)
        m.meta.update(text=str(text_path), checkpoint=str(job.location), config=cfg)
        return m
    loaded = load_hf(job.model_id, revision=job.revision, gguf_file=job.gguf_file,
                     dtype=job.dtype, device=device)
    m = measure_hf(loaded, text, max_tokens=max_tokens, seq_len=job.seq_len,
                   chunk_tokens=chunk_tokens, erank_seqs=erank_seqs, progress=progress,
                   prerot=prerot)
    m.meta["text"] = str(text_path)
    return m


def stored_revisions(store: Store | None, name: str) -> set[str]:
    """Revisions of model ``name`` already in the database."""
    if store is None:
        return set()
    return store.pretrained_revisions(name)


def run_jobs(name: str, jobs: list[RevisionJob], text_path: str | Path | None, *,
             store: Store | None, force: bool = False, ray: RayOptions | None = None,
             note: Callable[[str], None] | None = None,
             progress: Callable[[str], TokenProgress] | None = None, **kw: Any) -> list[Stored]:
    """Measure ``jobs`` and store each as revision ``job.label`` of model ``name``.

    Revisions already stored are skipped unless ``force``. ``ray``: a
    :class:`qkgeom.pretrained.ray_probe.RayOptions` to fan several revisions out as Ray tasks
    (each written here as it finishes); otherwise one after another in this process.
    """
    text, tpath = read_text(text_path)
    if not force:
        have = stored_revisions(store, name)
        skip = [j.label for j in jobs if j.label in have]
        if skip and note is not None:
            note(f"{name}: {len(skip)} revision(s) already stored, skipped "
                 f"({', '.join(skip[:5])}{', ...' if len(skip) > 5 else ''}); --force redoes them")
        jobs = [j for j in jobs if j.label not in have]
    if ray is not None and len(jobs) > 1:
        from qkgeom.pretrained.ray_probe import run_on_ray

        return run_on_ray(name, jobs, text, tpath, store=store, opts=ray, note=note, **kw)
    out = []
    for job in jobs:
        m = measure_job(job, text, tpath, progress=progress(job.label) if progress else None,
                        **kw)
        rid = store.write_pretrained(name, job.label, job.step, m.meta, m.rows) \
            if store else None
        out.append(Stored(name, job.label, job.step, rid, len(m.rows), m.meta))
    return out


def probe_pretrained(model_id: str, *, revisions: Sequence[str] | None = None,
                     gguf_file: str | None = None, text_path: str | Path | None = None,
                     max_tokens: int | None = DEFAULT_MAX_TOKENS, seq_len: int | None = None,
                     chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                     erank_seqs: int = DEFAULT_ERANK_SEQS, name: str | None = None,
                     dtype: str = "float32", device: str = "cpu", store: Store | None = None,
                     progress: Callable[[str], TokenProgress] | None = None,
                     prerot: bool = False, force: bool = False, ray: RayOptions | None = None,
                     note: Callable[[str], None] | None = None) -> list[Stored]:
    """Measure ``model_id`` at each revision and store it under ``name`` (default: the id).

    ``revisions`` default: ``[None]`` (the Hub's default branch, or the local files), stored
    as revision ``main`` (``local`` for a path; for a path, one revision names what it
    holds). A revision's step comes from its name (``stepN``), else None.
    ``progress(label)`` returns a per-revision progress callback (in-process runs).
    Revisions already stored under ``name`` are skipped unless ``force``; ``ray`` fans
    several revisions out over Ray (:func:`run_jobs`).
    """
    if revisions and len(revisions) > 1 and is_local(model_id):
        raise PretrainedError(f"{model_id} is a local directory, so --revisions can only name "
                              "the one revision it holds (e.g. --revisions step1000); measure "
                              "each revision's directory in turn with the same --name")
    name = name or (model_id + (f"#{gguf_file}" if gguf_file else ""))
    jobs = []
    for rev in (list(revisions) if revisions else [None]):
        label = rev or ("local" if is_local(model_id) else "main")
        jobs.append(RevisionJob(label, revision_step(label), "transformers", model_id=model_id,
                                revision=rev, gguf_file=gguf_file, dtype=dtype,
                                seq_len=seq_len))
    return run_jobs(name, jobs, text_path, store=store, force=force, ray=ray, note=note,
                    progress=progress, max_tokens=max_tokens, chunk_tokens=chunk_tokens,
                    erank_seqs=erank_seqs, device=device, prerot=prerot)


def probe_checkpoints(spec: str, *, store: Store | None, text_path: str | Path | None = None,
                      max_tokens: int | None = DEFAULT_MAX_TOKENS,
                      chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                      erank_seqs: int = DEFAULT_ERANK_SEQS, name: str | None = None,
                      device: str = "cpu", progress: Callable[[str], TokenProgress] | None = None,
                      note: Callable[[str], None] | None = None,
                      revisions: Sequence[str] | None = None, force: bool = False,
                      ray: RayOptions | None = None) -> list[Stored]:
    """Measure every checkpoint of a qkgeom trial; each is stored as revision ``step_N``.

    ``revisions``: only these (``step_N``, ``stepN`` or ``N``). Revisions already stored are
    skipped unless ``force``; ``ray`` fans them out over Ray (:func:`run_jobs`).
    """
    model_id, found = resolve_checkpoints(spec, store, note)
    name = name or model_id
    jobs = [RevisionJob(f"step_{st}", None if st < 0 else st, "qkgeom", location=str(d))
            for st, d in found]
    if revisions:
        want: dict[int, str] = {}
        for r in revisions:
            st = revision_step(r) if not r.strip().isdigit() else int(r)
            if st is None:
                raise PretrainedError(f"revision {r!r} of {model_id} is not step_N")
            want[st] = r
        have = {j.step for j in jobs}
        missing = [r for st, r in want.items() if st not in have]
        if missing:
            raise PretrainedError(f"{model_id} has no checkpoint for {', '.join(missing)}; "
                                  f"it has steps {', '.join(str(j.step) for j in jobs)}")
        jobs = [j for j in jobs if j.step in want]
    return run_jobs(name, jobs, text_path, store=store, force=force, ray=ray, note=note,
                    progress=progress, max_tokens=max_tokens, chunk_tokens=chunk_tokens,
                    erank_seqs=erank_seqs, device=device)
