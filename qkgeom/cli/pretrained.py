"""``qkgeom probe-pretrained``: Q/K geometry of a pretrained model or of a trial's checkpoints."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from qkgeom.cli import main
from qkgeom.cli.common import db_option, user_errors


def _progress_factory(quiet: bool, live: bool):  # type: ignore[no-untyped-def]
    """Per-revision progress on stderr: a live line on a terminal, else every quarter."""
    if quiet:
        return None

    def make(label: str):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        state = {"next": 0.25}

        def show(done: int, total: int, info: dict) -> None:
            frac = done / max(total, 1)
            if not live and frac < state["next"] and done < total:
                return
            state["next"] = (int(frac * 4) + 1) / 4
            line = (f"  {label}: {done:,}/{total:,} tokens ({100 * frac:5.1f}%), "
                    f"{info.get('tokens_per_s', 0.0):,.0f} tok/s, "
                    f"{time.perf_counter() - t0:,.0f} s")
            if live:
                click.echo("\r" + line, nl=done >= total, err=True)
            else:
                click.echo(line, err=True)

        return show

    return make


@main.command("probe-pretrained")
@click.option("--model", "model", default=None, metavar="ID_OR_PATH",
              help="Hugging Face Hub id (downloaded at --revisions when online) or a local "
                   "directory (with --gguf-file for a GGUF file inside it).")
@click.option("--gguf-file", default=None, metavar="F",
              help="GGUF file inside --model's directory (or an absolute path).")
@click.option("--revisions", default=None, metavar="R1,R2,...",
              help="Comma-separated Hub revisions, e.g. step1000,step143000 for Pythia. "
                   "A revision's step is parsed from stepN.")
@click.option("--checkpoints", "checkpoints", default=None, metavar="SPEC",
              help="Measure a qkgeom trial's checkpoints instead: SWEEP/TRIAL_KEY (its weight "
                   "snapshots, looked up in --db, read from the sweep's storage: a path or "
                   "s3://, gs://, file:// URI) or a directory (path or URI) of step_N/ "
                   "checkpoints. Stored as model 'qkgeom:SPEC', revisions step_N.")
@click.option("--text", "text", default=None, metavar="PATH",
              help="UTF-8 text to measure on. Default: the WikiText test text "
                   "($QKGEOM_DATA/wiki.test.raw or the qkgeom cache).")
@click.option("--max-tokens", type=int, default=131_072, show_default=True,
              help="Text tokens to measure (0: the whole text). Memory does not grow with it.")
@click.option("--chunk-tokens", type=int, default=4096, show_default=True,
              help="Tokens per forward pass (sequences per batch = chunk / seq-len).")
@click.option("--seq-len", type=int, default=None,
              help="Tokens per sequence incl. BOS/CLS/SEP. Default: 256 (the block size for "
                   "qkgeom checkpoints).")
@click.option("--erank-seqs", type=int, default=8, show_default=True,
              help="Sequences entering token_erank (a d_head x d_head SVD per head each).")
@click.option("--name", default=None,
              help="Model id to store under. Default: --model (plus #GGUF file), or "
                   "qkgeom:SPEC.")
@click.option("--dtype", default="float32", show_default=True,
              help="Weights dtype for transformers models (metrics are float64 anyway).")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:1, ...")
@db_option
@click.option("--prerot", is_flag=True,
              help="Also measure rotary models' pre-rotary projections (pr_q_prerot, "
                   "pr_k_prerot): two more covariances per layer.")
@click.option("--force", is_flag=True,
              help="Measure revisions already stored for this model again (default: skip).")
@click.option("--ray", "use_ray", is_flag=True,
              help="Run the revisions in parallel as tasks on a local Ray instance.")
@click.option("--address", default=None, metavar="HOST:PORT",
              help="Run the revisions as tasks on a running Ray cluster ('auto' on a head "
                   "node). Workers must reach --model (Hub or shared path) or the checkpoints.")
@click.option("--cpus-per-revision", type=float, default=1.0, show_default=True,
              help="CPUs per Ray task (also its torch threads).")
@click.option("--gpus-per-revision", type=float, default=0.0, show_default=True,
              help="GPUs per Ray task, fractional to share a GPU (0.25: four per GPU); "
                   "> 0 measures on the task's GPU.")
@click.option("--retries", type=int, default=2, show_default=True,
              help="Ray: resubmissions of a revision that failed other than by a user error.")
@click.option("--quiet", "-q", is_flag=True, help="No progress display.")
def probe_pretrained(model: str | None, gguf_file: str | None, revisions: str | None,
                     checkpoints: str | None, text: str | None, max_tokens: int,
                     chunk_tokens: int, seq_len: int | None, erank_seqs: int, name: str | None,
                     dtype: str, device: str, db: str | None, prerot: bool, force: bool,
                     use_ray: bool, address: str | None, cpus_per_revision: float,
                     gpus_per_revision: float, retries: int, quiet: bool) -> None:
    """Measure query/key geometry of a pretrained model at one or more revisions.

    Captures queries and keys of every layer and head (before and after rotary
    embeddings; grouped key heads expanded), streams their float64 covariances over the
    text, recomputes attention entropy from q and k with the model's mask, and stores
    every metric per model, revision, layer and head (see v_pretrained). Offline, set
    HF_HUB_OFFLINE=1 and pass --model PATH to local files.

    Revisions already stored for the model are skipped (--force redoes them). With --ray
    or --address, several revisions run in parallel as Ray tasks, each stored as it
    finishes; --model qkgeom:SWEEP/TRIAL --revisions step_N,... picks a trial's checkpoints.
    """
    with user_errors():
        from qkgeom.errors import QkgeomError

        rev_list = [r.strip() for r in revisions.split(",") if r.strip()] if revisions \
            else None
        if model is not None and model.startswith("qkgeom:") and checkpoints is None:
            model, checkpoints = None, model[len("qkgeom:"):]
            ckpt_revs, revisions = rev_list, None
        else:
            ckpt_revs = None
        if retries < 0:
            raise QkgeomError("--retries must be >= 0")

        if (model is None) == (checkpoints is None):
            raise QkgeomError("pass exactly one of --model ID_OR_PATH or --checkpoints SPEC")
        for opt, v in (("--chunk-tokens", chunk_tokens), ("--erank-seqs", erank_seqs + 1),
                       ("--max-tokens", max_tokens + 1)):
            if v < 1:
                raise QkgeomError(f"{opt} must be positive")
        if checkpoints is not None and (gguf_file or revisions):
            raise QkgeomError("--gguf-file and --revisions apply to --model, not --checkpoints")

        from qkgeom import pretrained as P
        from qkgeom.store import open_store

        # refuse before the database is opened (and created): nothing to store
        if model is not None and model.startswith(("/", "./", "../", "~")) and \
                not Path(model).expanduser().exists():
            raise QkgeomError(f"--model {model}: no such file or directory; pass --model PATH "
                              "to a local copy (a directory with config.json and weights, or "
                              "a directory plus --gguf-file FILE) or a Hugging Face repo id "
                              "(org/name)")
        if text is None:
            text = str(P.default_text())
        elif not Path(text).expanduser().is_file():
            raise QkgeomError(f"--text {text}: no such file; pass a UTF-8 text file "
                              "(e.g. wiki.test.raw)")
        progress = _progress_factory(quiet, live=sys.stderr.isatty())
        ray = None
        if use_ray or address:
            ray = P.RayOptions(address=address, cpus_per_revision=cpus_per_revision,
                               gpus_per_revision=gpus_per_revision, retries=retries)
        note = (lambda m: click.echo(f"note: {m}", err=True)) if not quiet else None
        common = dict(text_path=text, max_tokens=max_tokens or None, chunk_tokens=chunk_tokens,
                      erank_seqs=erank_seqs, name=name, device=device, progress=progress,
                      force=force, ray=ray)
        with open_store(db) as store:
            if checkpoints is not None:
                if seq_len is not None:
                    raise QkgeomError("--seq-len is fixed by a checkpoint's block_size")
                done = P.probe_checkpoints(
                    checkpoints, store=store, revisions=ckpt_revs,
                    note=lambda m: click.echo(f"note: {m}", err=True), **common)
            else:
                done = P.probe_pretrained(model, revisions=rev_list, gguf_file=gguf_file,
                                          seq_len=seq_len, dtype=dtype, store=store,
                                          prerot=prerot, note=note, **common)
        for s in done:
            m = s.meta
            click.echo(f"{s.model} @ {s.revision} (step {s.step}): {m['n_layers']} layers x "
                       f"{m['n_heads']} heads, {m['tokens']:,} tokens in {m['wall_s']:.1f} s "
                       f"({m['tokens_per_s']:,.0f} tok/s); {s.n_rows} rows -> run {s.run_id}")
