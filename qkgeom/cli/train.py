"""``qkgeom train``: one trial on this machine, with a progress bar and a closing summary."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import click

from qkgeom.cli import main
from qkgeom.cli.common import user_errors


class ProgressLine:
    """A one-line progress display on stderr: bar, step, loss, throughput, ETA."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.t0 = time.monotonic()
        self.last = 0.0

    def __call__(self, step: int, info: dict) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self.last < 0.25 and step < self.total):
            return
        self.last = now
        frac = step / self.total
        eta = (now - self.t0) / max(frac, 1e-9) * (1 - frac)
        bar = "#" * int(28 * frac)
        val = info["val_loss"]
        val_s = f" val {val:.3f}" if val == val else ""
        sys.stderr.write(
            f"\r[{bar:<28}] {step}/{self.total} loss {info['loss']:.3f}{val_s} "
            f"{info['tokens_per_s']:,.0f} tok/s ETA {eta:4.0f}s "
        )
        if step >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


@main.command()
@click.option("--preset", "preset_name", default="smoke", show_default=True,
              help="Trial settings to start from: smoke, cpu or paper.")
@click.option("--data", default=None, envvar="QKGEOM_DATA",
              help="Corpus: a directory with wiki.*.raw, a text file, wikitext-103 or "
              "wikitext-2 (download). Default: $QKGEOM_DATA, else wikitext-103.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override one config field (repeatable), e.g. --set n_layer=4.")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Run directory for config.json, probes.jsonl and checkpoints "
              "(default runs/train-<preset>-<time>).")
# not cli.common.db_option: without --db (or $QKGEOM_DB) a run is recorded nowhere, where
# every other command falls back to sqlite:///qkgeom.db
@click.option("--db", default=None,
              help="Also record into this results database (URL or SQLite path; "
              "$QKGEOM_DB is used when set).")
@click.option("--name", "sweep_name", default="train",
              help="Sweep name under which --db records the trial.", show_default=True)
@click.option("--checkpoints/--no-checkpoints", default=True, show_default=True,
              help="Keep a checkpoint at every probe under OUT/checkpoints.")
@click.option("--resume", "resume_dir", type=click.Path(exists=True, file_okay=False),
              default=None, help="Continue from a checkpoint directory (OUT/checkpoints/step_N).")
@click.option("--overwrite", is_flag=True,
              help="Reuse a non-empty --out: delete its earlier probes.jsonl, result.json "
              "and checkpoints first.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def train(preset_name, data, sets, out, db, sweep_name, checkpoints, resume_dir, overwrite,
          quiet):
    """Train one trial and probe its Q/K geometry as it trains."""
    with user_errors():
        from qkgeom.config import preset
        from qkgeom.engine.train import train as run_trial
        from qkgeom.names import check_sweep_name
        from qkgeom.records import METRICS

        check_sweep_name(sweep_name, what="--name")  # before anything is read or written
        cfg = preset(preset_name)
        if data:
            cfg = cfg.with_overrides({"dataset": data})
        cfg = cfg.with_overrides(list(sets))
        if out and Path(out).is_dir() and any(Path(out).iterdir()) and not resume_dir:
            if not overwrite:
                from qkgeom.errors import QkgeomError

                raise QkgeomError(
                    f"--out {out} is not empty (an earlier run's files); give a new --out, "
                    "--overwrite to replace them, or --resume OUT/checkpoints/step_N to "
                    "continue that run")
            _clear_run_dir(Path(out))
        from qkgeom.engine.data import load_corpus

        corpus = load_corpus(cfg.dataset)  # fails before anything is written
        run_dir = Path(out or f"runs/train-{preset_name}-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        with ProbeSink(run_dir, db or os.environ.get("QKGEOM_DB"), sweep_name, cfg,
                       resume_dir=resume_dir) as sink:
            bar = ProgressLine(cfg.max_steps, enabled=not quiet)
            click.echo(f"qkgeom train: preset {preset_name}, {cfg.n_layer} layers, n_embd "
                       f"{cfg.n_embd}, init {cfg.init}, arm {cfg.arm}, seed {cfg.seed} -> "
                       f"{run_dir}", err=True)
            try:
                result = run_trial(
                    cfg, sink,
                    checkpoint_dir=run_dir / "checkpoints" if checkpoints else None,
                    resume_from=resume_dir, progress=bar, corpus=corpus,
                )
            except BaseException as e:
                sink.failed(e)
                raise
            sink.finished(result)
        summary = {**result.__dict__, "run_dir": str(run_dir)}
        (run_dir / "result.json").write_text(json.dumps(summary, indent=2) + "\n")

    click.echo(f"\n{result.data_note}")
    click.echo(f"device {result.device}, {result.n_params:,} parameters, {result.steps} steps in "
               f"{result.wall_s:.1f} s ({result.tokens_per_s:,.0f} training tokens/s)")
    click.echo(f"test loss       {result.test_loss:.4f} nats/char")
    click.echo(f"unigram entropy {result.unigram_entropy:.4f} nats/char (of the test text)")
    if sink.last is not None:
        final = {(li, n): v for li, h, n, v in sink.last.metrics if h is None}
        layers = sorted({li for li, _ in final})
        cols = [n for n in ("pr_q", "pr_k", "pr_wk", "qk_erank", "entropy") if n in METRICS]
        click.echo(f"\nfinal probe (step {sink.last.step}), layer-level:")
        click.echo("layer " + " ".join(f"{c:>9}" for c in cols))
        for li in layers:
            click.echo(f"{li:>5} " + " ".join(f"{final.get((li, c), float('nan')):9.3f}"
                                              for c in cols))
    click.echo(f"\nprobe records: {run_dir / 'probes.jsonl'}")
    if sink.store is not None:
        click.echo(f"recorded as trial {sink.trial_key!r} of sweep {sweep_name!r} in "
                   f"{sink.url_shown}")


def _clear_run_dir(run_dir: Path) -> None:
    """Remove what an earlier ``qkgeom train`` wrote into ``run_dir`` (--overwrite)."""
    import shutil

    for name in ("config.json", "probes.jsonl", "result.json"):
        (run_dir / name).unlink(missing_ok=True)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)


class ProbeSink:
    """The :data:`~qkgeom.engine.train.ProbeCallback` of ``qkgeom train``: appends each
    probe to probes.jsonl (flushed: survives a crash) and, with --db, records the trial
    through :class:`qkgeom.store.recorder.TrialRecorder`, as a sweep's driver does. A
    context manager: leaving it closes the file and the database."""

    def __init__(self, run_dir: Path, db: str | None, sweep_name: str, cfg,
                 resume_dir: str | Path | None = None) -> None:
        from qkgeom.plan.spec import trial_key

        self.run_dir = run_dir
        self.resume_dir = resume_dir
        self.beater = None
        self.path = run_dir / "probes.jsonl"
        self.fh = self.path.open("a", encoding="utf-8")
        self.last = None
        self.store = None
        self.recorder = None
        self.trial_id = None
        self.trial_key = trial_key(cfg.n_layer, cfg.init, cfg.arm, cfg.seed)
        if db:
            try:
                self._open(db, sweep_name, cfg)
            except BaseException:
                self.close()
                raise

    def _open(self, db: str, sweep_name: str, cfg) -> None:
        from qkgeom.engine.train import checkpoint_step, pick_device
        from qkgeom.store import open_store, resolve_url, safe_url
        from qkgeom.store.lease import Beater, database_identity
        from qkgeom.store.lifecycle import HEARTBEAT_S
        from qkgeom.store.recorder import TrialRecorder
        from qkgeom.sweeps.files import stamp_directory
        from qkgeom.sweeps.provenance import provenance
        from qkgeom.sweeps.ship import code_version

        url = resolve_url(db)
        self.url_shown = safe_url(url)
        self.store = open_store(url)
        self._check_existing(sweep_name, cfg)
        sid = self.store.ensure_sweep(sweep_name, {"kind": "train"}, code_version(),
                                      heartbeat_s=HEARTBEAT_S)
        self.trial_id = self.store.ensure_trial(
            sid, self.trial_key, cfg.to_dict(), depth=cfg.n_layer, init=cfg.init,
            arm=cfg.arm, seed=cfg.seed, status="running",
        )
        self.recorder = TrialRecorder(self.store, sid)
        # what an earlier run of this trial stored after the step this one starts from
        # (all of it, without --resume) goes with the write that starts this attempt
        restored = None if self.resume_dir is None else checkpoint_step(self.resume_dir)
        self.recorder.started(self.trial_id, provenance(str(pick_device(cfg))), restart=True,
                              restored_step=restored)
        # the run's checkpoints are this database's (qkgeom sweep delete asks)
        stamp_directory(str(self.run_dir / "checkpoints"), database_identity(self.store),
                        sweep_name)
        # a heartbeat every HEARTBEAT_S from a thread: a running trial whose heartbeats
        # stop has lost its process (what qkgeom status and sweep delete judge by)
        tid = self.trial_id
        self.beater = Beater(url, HEARTBEAT_S,
                             lambda store: store.heartbeat(sid, tid) >= 0).start()

    def __enter__(self) -> ProbeSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.fh.close()
        if self.beater is not None:
            self.beater.stop()
        if self.store is not None:
            self.store.close()

    def _check_existing(self, sweep_name: str, cfg) -> None:
        """Refuse to write into a sweep made by ``qkgeom sweep``, or into a stored trial
        whose config differs: either would mix two runs' probes under one trial."""
        from qkgeom.errors import QkgeomError

        stored = self.store.sweep_spec(sweep_name)
        if stored is None:
            return
        if stored != {"kind": "train"}:
            raise QkgeomError(f"sweep {sweep_name!r} in {self.url_shown} was made by qkgeom "
                              "sweep; record this run under another --name")
        tid = self.store.trial_id(self.store.sweep_id(sweep_name), self.trial_key)
        if tid is not None and self.store.get_trial(tid).config != json.loads(
                json.dumps(cfg.to_dict())):
            raise QkgeomError(f"trial {self.trial_key!r} of sweep {sweep_name!r} in "
                              f"{self.url_shown} was recorded with a different config; "
                              "record this run under another --name")

    def __call__(self, record, checkpoint) -> None:
        self.fh.write(json.dumps(record.to_dict(), allow_nan=True) + "\n")
        self.fh.flush()
        self.last = record
        if self.recorder is not None:
            self.recorder.reported(
                self.trial_id, record,
                saved=None if checkpoint is None else str(Path(checkpoint).resolve()))

    def failed(self, e: BaseException) -> None:
        self.fh.close()
        if self.recorder is not None:
            error = f"{type(e).__name__}: {e}"
            if isinstance(e, KeyboardInterrupt):
                self.recorder.interrupted(self.trial_id, error)
            else:
                self.recorder.failed(self.trial_id, error)

    def finished(self, result) -> None:
        self.fh.close()
        if self.recorder is not None:
            self.recorder.result(self.trial_id, test_loss=result.test_loss)
            self.recorder.finished(self.trial_id, device=result.device,
                                   host=result.extra.get("host"))
