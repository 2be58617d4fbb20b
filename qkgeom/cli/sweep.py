"""``qkgeom sweep`` (run a study on Ray Tune) and ``qkgeom status`` (its progress, from the DB).

Ray is imported only inside the commands (through :mod:`qkgeom.sweeps.driver` and
:mod:`qkgeom.sweeps.cluster`), so ``qkgeom --help`` stays instant.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from qkgeom.cli import main
from qkgeom.cli.common import db_option, user_errors

if TYPE_CHECKING:
    from qkgeom.plan.spec import SweepPlan


# a group that runs a sweep when no subcommand is named: `qkgeom sweep --preset smoke` and
# every other existing invocation keep working beside `qkgeom sweep delete`
@main.group(invoke_without_command=True)
@click.option("--preset", "preset_name", default=None, metavar="NAME",
              help="Sweep preset: smoke, cpu or paper (default smoke).")
@click.option("--spec", "spec_file", type=click.Path(dir_okay=False), default=None,
              help="Sweep spec file (YAML or TOML); see docs/sweeps.md.")
@click.option("--name", default=None, help="Sweep name (default: the spec's name / preset).")
@db_option
@click.option("--data", default=None, envvar="QKGEOM_DATA",
              help="Corpus for every trial: a directory with wiki.*.raw, a text file, "
              "wikitext-103 or wikitext-2. Default: $QKGEOM_DATA, else the preset's.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Override a trial config key (e.g. max_steps=300) or, dotted, a spec key "
              "(e.g. grid.seeds=3). Repeatable.")
@click.option("--address", default=None,
              help="Join a running Ray cluster (e.g. 127.0.0.1:6379, or 'auto' on a head).")
@click.option("--cluster", "cluster_file", type=click.Path(dir_okay=False), default=None,
              help="Start/update this Ray cluster (cluster/aws.yaml ...) and run the sweep's "
              "driver on its head node, detached.")
@click.option("--dry-run", is_flag=True,
              help="Validate and print what would run, start nothing: the plan's trials; "
              "with --cluster, build the wheel to ship and print the derived cluster file "
              "and the remote command instead (no Ray, no database).")
@click.option("--resume", is_flag=True,
              help="Continue sweep --name: restart errored and unfinished trials from their "
              "last checkpoints; finished trials are not rerun.")
@click.option("--gpus-per-trial", type=float, default=None,
              help="GPUs per trial, fractional to share a GPU (default: 0.25 when the cluster "
              "has GPUs, else 0).")
@click.option("--cpus-per-trial", type=float, default=1.0, show_default=True,
              help="CPUs per trial (also its torch thread count).")
@click.option("--max-concurrent", type=click.IntRange(min=1), default=None,
              help="At most this many trials at once (default: as resources allow).")
@click.option("--max-failures", type=int, default=2, show_default=True,
              help="Retries per trial, each from its last checkpoint.")
@click.option("--direct-writes", is_flag=True,
              help="Workers write their probe rows themselves (PostgreSQL only).")
@click.option("--storage", default=None, envvar="QKGEOM_RAY_STORAGE",
              help="Ray Tune storage root (default ~/ray_results); shared storage (NFS, "
              "s3://...) on a multi-node cluster.")
@click.option("--snapshots", default=None, metavar="POLICY",
              help="Weight snapshots kept in the Tune storage (for probe-pretrained "
              "--checkpoints SWEEP/TRIAL): all (every probe step), none, or every:N (probe "
              "steps that are multiples of N, and the last). Default: the spec's "
              "'snapshots', else all.")
@click.option("--progress-every", type=float, default=10.0, show_default=True,
              help="Seconds between progress lines when nothing changes.")
@click.option("--logger", "loggers", multiple=True,
              type=click.Choice(["tensorboard", "mlflow", "wandb"]),
              help="Also log every probe to this tracker, through Ray Tune's logger "
              "callbacks (repeatable): TensorBoard event files in the trial dirs, an MLflow "
              "store ($MLFLOW_TRACKING_URI, else ./mlflow.db), W&B offline. The database "
              "stays the source of truth (docs/sweeps.md, 'Trackers').")
@click.option("--prune-age", type=float, default=60.0, hidden=True,
              help="Seconds before a superseded resume checkpoint is pruned (tests).")
@click.option("--heartbeat-every", "heartbeat_s", type=click.FloatRange(min=0.1),
              default=None, hidden=True,
              help="Seconds between the running trials' heartbeats (default 30; tests).")
@click.pass_context
def sweep(ctx: click.Context, preset_name: str | None, spec_file: str | None,
          name: str | None, db: str | None, data: str | None, sets: tuple[str, ...],
          address: str | None,
          cluster_file: str | None, dry_run: bool, resume: bool, gpus_per_trial: float | None,
          cpus_per_trial: float, max_concurrent: int | None, max_failures: int,
          direct_writes: bool, storage: str | None, snapshots: str | None,
          progress_every: float, prune_age: float, heartbeat_s: float | None,
          loggers: tuple[str, ...]) -> None:
    """Run a study (geometry grid + intervention arms) on Ray Tune into the database.

    With a command instead (qkgeom sweep delete --name NAME), act on a stored sweep.
    """
    if ctx.invoked_subcommand is not None:
        _refuse_run_options(ctx)
        return
    from qkgeom.plan.spec import plan_from

    with user_errors():
        from_db = resume and preset_name is None and spec_file is None
        _check_sweep_args(address, cluster_file, cpus_per_trial, gpus_per_trial, max_failures,
                          from_db, name, snapshots, prune_age)
        plan = None if from_db else plan_from(preset_name, spec_file, name=name, data=data,
                                              sets=sets, snapshots=snapshots)
        if dry_run and not cluster_file:
            _print_plan(plan)
            return
        if cluster_file:
            from qkgeom.sweeps.cluster import launch_on_cluster

            if loggers:
                raise click.UsageError("--logger runs in the sweep's driver: with --cluster, "
                                       "start the sweep on the head (qkgeom sweep --address "
                                       "auto --logger ...) instead")

            launch_on_cluster(
                cluster_file, plan=plan, name=name or plan.name, spec_file=spec_file,
                preset=preset_name, data=data, sets=sets, db=db, resume=resume,
                gpus_per_trial=gpus_per_trial, cpus_per_trial=cpus_per_trial,
                max_concurrent=max_concurrent, max_failures=max_failures,
                direct_writes=direct_writes, storage=storage, snapshots=snapshots,
                dry_run=dry_run,
            )
            return
        _run_here(plan, name, db, address=address, storage=storage, resume=resume,
                  cpus_per_trial=cpus_per_trial, gpus_per_trial=gpus_per_trial,
                  max_concurrent=max_concurrent, max_failures=max_failures,
                  direct_writes=direct_writes, progress_every_s=progress_every,
                  prune_age_s=prune_age, loggers=tuple(loggers),
                  **({"heartbeat_s": heartbeat_s} if heartbeat_s else {}))


def _refuse_run_options(ctx: click.Context) -> None:
    """Options of a run given before a subcommand (``qkgeom sweep --name x delete``) would
    be silently ignored: refuse them, naming where they go."""
    from click.core import ParameterSource

    given = [p.opts[0] for p in ctx.command.params if isinstance(p, click.Option)
             and ctx.get_parameter_source(p.name) == ParameterSource.COMMANDLINE]
    if given:
        raise click.UsageError(
            f"{', '.join(given)} before '{ctx.invoked_subcommand}' belong to a sweep run; "
            f"give the command's own options after it: qkgeom sweep "
            f"{ctx.invoked_subcommand} --help")


def _check_sweep_args(address: str | None, cluster_file: str | None, cpus_per_trial: float,
                      gpus_per_trial: float | None, max_failures: int, from_db: bool,
                      name: str | None, snapshots: str | None, prune_age: float) -> None:
    """Refuse option combinations that cannot run (``from_db``: a resume without a spec,
    rebuilt from the database)."""
    if address and cluster_file:
        raise click.UsageError("give either --address or --cluster, not both")
    if cpus_per_trial <= 0:
        raise click.BadParameter("must be positive", param_hint="--cpus-per-trial")
    if gpus_per_trial is not None and gpus_per_trial < 0:
        raise click.BadParameter("must be >= 0", param_hint="--gpus-per-trial")
    if max_failures < 0:
        raise click.BadParameter("must be >= 0", param_hint="--max-failures")
    if from_db and not name:
        raise click.UsageError("--resume needs --name NAME (the sweep to continue)")
    if from_db and snapshots is not None:
        raise click.UsageError("--snapshots is part of the stored spec: resume without it")
    if prune_age < 0:
        raise click.BadParameter("must be >= 0", param_hint="--prune-age")


def _print_plan(plan: SweepPlan | None) -> None:
    """``--dry-run`` without ``--cluster``: the plan's trials, as JSON, with each
    seed-level claim's power at the planned seeds (stats.registry.planned_power)."""
    if plan is None:
        raise click.UsageError("--dry-run needs --preset or --spec")
    from qkgeom.plan.spec import plan_summary
    from qkgeom.stats.registry import planned_power

    summary = plan_summary(plan)
    base = {t.seed for t in plan.trials if t.arm == "none"}
    summary["power"] = planned_power(len(base), {a: len(set(s)) for a, s in
                                                 summary["arms"].items() if a != "none"})
    click.echo(json.dumps(summary, indent=1))


def _run_here(plan: SweepPlan | None, name: str | None, db: str | None,
              **options: Any) -> None:
    """Run the sweep from this process (local Ray, or ``--address``), then print the
    trials' table and how to read the results; ``options``: :class:`SweepOptions` fields."""
    import signal

    from qkgeom.sweeps.driver import (
        SweepOptions,
        install_signal_handlers,
        plan_for_resume,
        restore_signal_handlers,
        run_sweep,
        shutdown,
    )

    if options["direct_writes"] and db is not None and not _is_pg(db):
        from qkgeom.plan.spec import SweepError

        raise SweepError("--direct-writes needs a PostgreSQL database; drop it to let "
                         "the driver write (works with SQLite)")
    if plan is None:
        from qkgeom.store import resolve_url

        plan = plan_for_resume(name, resolve_url(db))
    # a signal during start-up (before Ray's and the sweep's own handlers) still ends with
    # the summary line and the resume command, not a silent exit
    early = install_signal_handlers()
    summary: dict[str, Any] | None = None
    stopped = False
    try:
        summary = run_sweep(plan, SweepOptions(db_url=db, **options))
        stopped = bool(summary.get("interrupted"))
    except KeyboardInterrupt:  # a second signal, or one outside Tune's loop
        stopped = True
    finally:
        # once stopping, further Ctrl-C / SIGTERM must not cut the clean-up and the summary
        # short (they would end in click's 'Aborted!' and exit 1)
        if stopped:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, signal.SIG_IGN)
        try:
            shutdown()
        finally:
            if not stopped:
                restore_signal_handlers(early)
    if stopped or summary is None:
        _report_interrupted(plan.name, db)
    _print_summary(plan.name, summary, db)


def _print_summary(name: str, summary: dict[str, Any], db: str | None) -> None:
    """The trials' table, the totals and the commands that read the results; a
    ClickException when trials did not finish."""
    from qkgeom.store import safe_url

    rows = status_rows(summary["db_url"], name)
    click.echo("")
    click.echo(format_status(rows))
    n_err = summary["errors"]
    click.echo(f"\nsweep {name}: {len(rows) - n_err}/{len(rows)} trials terminated "
               f"in {summary['wall_s']:.0f} s")
    url = safe_url(summary["db_url"])
    click.echo("results:\n"
               f"  qkgeom status --name {name} --db '{url}'\n"
               f"  qkgeom query --db '{url}' \"SELECT * FROM trials\"\n"
               f"  qkgeom stats sign-test --sweep {name} --db '{url}'")
    if n_err:
        n_wait = len(summary.get("waiting") or {})
        wait = (f", {n_wait} of them arm(s) waiting for a baseline that did not finish "
                "(they run after it)" if n_wait else "")
        raise click.ClickException(
            f"{n_err} trial(s) did not finish{wait}; retry them from their checkpoints "
            f"with: qkgeom sweep --resume --name {name}" + (f" --db '{url}'" if db else ""))


def _report_interrupted(name: str, db: str | None) -> None:
    """After SIGINT/SIGTERM: the table and a last line from the database, then exit
    128 + the signal's number (the trials that were running are ``interrupted``)."""
    import signal
    import sys

    from qkgeom.store import resolve_url, safe_url
    from qkgeom.sweeps.driver import absolute_sqlite_url, interrupted_by

    why = interrupted_by() or "SIGINT"
    url = absolute_sqlite_url(resolve_url(db))
    try:
        rows = status_rows(url, name)
    except Exception:  # the sweep may not have reached the database
        click.echo(f"\nsweep {name} interrupted by {why} before it was recorded in the "
                   "database: nothing ran; start it again with the same command")
        sys.exit(128 + int(getattr(signal, why, signal.SIGINT)))
    if rows:
        click.echo("")
        click.echo(format_status(rows))
    n = {s: sum(1 for r in rows if r["status"] == s) for s in
         ("terminated", "interrupted", "pending", "error")}
    click.echo(f"\nsweep {name} interrupted by {why}: {n['terminated']}/{len(rows)} trials "
               f"terminated, {n['interrupted']} interrupted, {n['pending']} not started"
               + (f", {n['error']} failed" if n["error"] else "")
               + f"; continue with: qkgeom sweep --resume --name {name}"
               + (f" --db '{safe_url(url)}'" if db else ""), err=False)
    sys.exit(128 + int(getattr(signal, why, signal.SIGINT)))


def _is_pg(db: str) -> bool:
    return db.startswith(("postgresql", "postgres"))


def status_rows(db: str | None, name: str | None) -> list[dict[str, Any]]:
    """Per-trial progress of sweep ``name`` (or the only sweep) from the database.

    A running trial whose driver stopped sending heartbeats has ``stale`` true,
    ``no_heartbeat_s`` (seconds) and a ``note`` that says what to do
    (:func:`qkgeom.store.lifecycle.no_heartbeat_s`); ``provenance`` is its latest attempt's
    ``trial_attempts`` row (code, git commit and dirty flag, versions, host, device).
    """
    from datetime import datetime, timezone

    from qkgeom.store import open_store
    from qkgeom.store.lease import read_lease
    from qkgeom.store.lifecycle import no_heartbeat_s, stale_note

    with open_store(db, create=False, readonly=True) as store:
        sweeps = store.sweeps()
        if name is None:
            if sweeps.height != 1:
                from qkgeom.errors import QkgeomError

                names = sweeps["name"].to_list()
                raise QkgeomError(f"the database holds {len(names)} sweeps "
                                  f"({', '.join(names) or 'none'}); pick one with --name")
            name = sweeps["name"][0]
        sid = store.require_sweep(name)
        every = dict(zip(sweeps["name"], sweeps["heartbeat_s"])).get(name)
        trials = store.trials(name)
        last_by = store.last_probes(sid)
        n_snaps = store.snapshot_counts(sid)
        latest = {r["trial_id"]: r for r in store.attempts(name).iter_rows(named=True)}
        lease = read_lease(store, sid)
    now = datetime.now(timezone.utc)
    rows = []
    for t in trials.iter_rows(named=True):
        cfg = json.loads(t["config"]) if isinstance(t["config"], str) else (t["config"] or {})
        step, val = last_by.get(t["id"], (None, math.nan))
        age = no_heartbeat_s(t["status"], t["heartbeat_at"], t["started_at"], every, now)
        beat = t["heartbeat_at"]
        rows.append(dict(trial=t["trial_key"], status=t["status"], attempts=t["attempts"],
                         step=step, max_steps=cfg.get("max_steps"), val_loss=val,
                         snapshots=n_snaps.get(t["id"], 0),
                         test_loss=math.nan if t["test_loss"] is None else t["test_loss"],
                         host=t["host"] or "", device=t["device"] or "",
                         error=((t["error"] or "").strip().splitlines()[-1:] or [""])[0][:80],
                         heartbeat_at=None if beat is None else _utc(beat).isoformat(),
                         stale=age is not None,
                         no_heartbeat_s=None if age is None else round(age, 1),
                         note="" if age is None else stale_note(age, name, lease),
                         provenance=_provenance(latest.get(t["id"]))))
    return rows


def _provenance(attempt: dict[str, Any] | None) -> dict[str, Any] | None:
    """The latest attempt's ``trial_attempts`` row for ``status --json`` (None: none)."""
    if attempt is None:
        return None
    out = {k: v for k, v in attempt.items() if k not in ("trial_key", "trial_id", "details")}
    out["started_at"] = _utc(out["started_at"]).isoformat()
    out["details"] = json.loads(attempt["details"]) if attempt["details"] else None
    return out


def _utc(t: Any) -> Any:
    """A stored timestamp as UTC (SQLite gives them back naive)."""
    from datetime import timezone

    return t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t.astimezone(timezone.utc)


def format_status(rows: list[dict[str, Any]]) -> str:
    """The status table: a stale running trial shows its note in the error column."""
    head = ["trial", "status", "tries", "step", "val_loss", "test_loss", "snaps", "host",
            "device", "error"]

    def loss(v: float | None) -> str:
        return "-" if v is None or v != v else f"{v:.4f}"

    body = []
    for r in rows:
        step = "-" if r["step"] is None else f"{r['step']}/{r['max_steps']}"
        err = r["error"] if r["status"] in ("error", "pending", "interrupted") else ""
        body.append([r["trial"], r["status"], str(r["attempts"]), step, loss(r["val_loss"]),
                     loss(r.get("test_loss")), str(r.get("snapshots", 0)), r["host"],
                     r["device"], r.get("note") or err])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in [head, *body]]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    n_stale = sum(1 for r in rows if r.get("stale"))
    lines.append(", ".join(f"{v} {k}" + (f" ({n_stale} stale: no heartbeat)"
                                         if k == "running" and n_stale else "")
                           for k, v in sorted(counts.items())))
    return "\n".join(lines)


@main.command()
@click.option("--name", default=None, help="Sweep name (optional with a single sweep).")
@db_option
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def status(name: str | None, db: str | None, as_json: bool) -> None:
    """Per-trial progress of a sweep, read from the database (works while it runs).

    A running trial whose driver stopped sending heartbeats (killed, its machine gone)
    is shown as stale, with how long; qkgeom sweep --resume takes the sweep over and marks
    it interrupted, unless its driver still holds the sweep's lease (the last line names
    the driver that holds it).
    """
    with user_errors():
        rows = status_rows(db, name)
        driver = driver_line(db, name)
    if as_json:
        click.echo(json.dumps([{k: (None if isinstance(v, float) and v != v else v)
                                for k, v in r.items()} for r in rows], indent=1))
    else:
        click.echo(format_status(rows) + (f"\n{driver}" if driver else ""))


def driver_line(db: str | None, name: str | None) -> str | None:
    """``driver: pid 4242 on vm (qkgeom sweep), last heartbeat 3 s ago by the database's
    clock: live`` for the sweep's lease (qkgeom.store.lease), or None when none is held."""
    from qkgeom.store import open_store
    from qkgeom.store.lease import read_lease

    with open_store(db, create=False, readonly=True) as store:
        names = store.sweep_names()
        name = name or (names[0] if len(names) == 1 else None)
        sid = None if name is None else store.sweep_id(name)
        lease = None if sid is None else read_lease(store, sid)
    if lease is None:
        return None
    gone = lease.gone()
    return f"driver: {lease.holder()}: " + ("live" if gone is None else f"gone ({gone})")


@sweep.command("delete")
@click.option("--name", required=True, help="The sweep to delete.")
@db_option
@click.option("--yes", is_flag=True, help="Delete without asking.")
@click.option("--dry-run", is_flag=True,
              help="List what would be deleted; opens the database read-only, changes nothing.")
@click.option("--stopped", is_flag=True,
              help="You know its driver has stopped: delete even though a trial is recorded "
                   "as running with no heartbeat to prove it (never against a live lease).")
def delete(name: str, db: str | None, yes: bool, dry_run: bool, stopped: bool) -> None:
    """Delete a sweep: its rows (trials, probes, metrics, training steps, checkpoints) and
    the files qkgeom made for it (Tune experiment directories, resume checkpoints, weight
    snapshots).

    Only files provably the sweep's are removed; other sweeps' rows and files, the working
    directory, HOME and a merged copy's origin are never touched (docs/sweeps.md). Asks
    first, unless --yes; refuses while the sweep may be running.
    """
    from qkgeom.store import open_store, resolve_url
    from qkgeom.store.engine import sqlite_path
    from qkgeom.sweeps.files import plan_removal, remove_sweep

    with user_errors():
        url = resolve_url(db)
        path = sqlite_path(url) if url.startswith("sqlite") else None
        if path is not None and not Path(path).exists():
            from qkgeom.errors import QkgeomError

            raise QkgeomError(f"no database at {path}: nothing to delete (check --db)")
        with open_store(url, create=False, readonly=True) as store:
            plan = plan_removal(store, name, stopped=stopped)
        click.echo(format_removal(plan))
        if dry_run:
            click.echo("--dry-run: nothing was deleted")
            return
        plan.check_stopped()
        if not yes:
            click.confirm(f"delete sweep {name}, its rows and these files?", abort=True)
        # checked again inside the deleting transaction: the prompt may have waited long
        rows = remove_sweep(url, plan, stopped=stopped)
    click.echo(f"deleted sweep {name}: {_rows_text(rows)}; removed {len(plan.paths)} "
               f"path(s), {_size_text(plan.bytes)}")
    if plan.kept:
        click.echo(f"left {len(plan.kept)} path(s) in place (listed as kept above)")


_ROW_WORDS = {"trials": "trials", "trial_attempts": "attempts", "probes": "probes",
              "probe_metrics": "metric values",
              "train_steps": "training steps", "checkpoints": "checkpoint rows"}


def _rows_text(rows: dict[str, int]) -> str:
    return ", ".join(f"{n:,} {_ROW_WORDS.get(t, t + ' rows')}" for t, n in rows.items())


def _size_text(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def format_removal(plan: Any) -> str:
    """The listing ``qkgeom sweep delete`` shows before it deletes (and with --dry-run)."""
    lines = [f"sweep {plan.name} in {plan.db}: {_rows_text(plan.rows)}"]
    if plan.running:
        names = ", ".join(plan.running[:3]) + (", ..." if len(plan.running) > 3 else "")
        state = (f"it may be running: {plan.live[0]}" if plan.live
                 else "their driver is provably gone")
        lines.append(f"warning: {len(plan.running)} trial(s) are recorded as running "
                     f"({names}; {state})")
    elif plan.live:
        lines.append(f"warning: it may be running: {plan.live[0]}")
    if plan.origin:
        lines.append(f"merged from database {plan.origin}: its rows go, its files stay "
                     "(they are that database's)")
    if plan.storage is None:
        lines.append("no Ray storage is recorded for it: only its recorded checkpoint "
                     "locations are removed")
    lines.append(f"files: {len(plan.paths)} path(s), {_size_text(plan.bytes)}")
    lines += [f"  {loc}" for loc, _ in plan.paths]
    if plan.gone:
        lines.append(f"  ({plan.gone} recorded location(s) no longer exist)")
    for loc, why in plan.kept:
        lines.append(f"kept: {loc} ({why})")
    return "\n".join(lines)
