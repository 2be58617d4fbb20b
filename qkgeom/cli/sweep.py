"""``qkgeom sweep`` (run a study on Ray Tune) and ``qkgeom status`` (its progress, from the DB).

Ray is imported only inside the commands (through :mod:`qkgeom.tune`), so ``qkgeom --help``
stays instant.
"""

from __future__ import annotations

import json
import math
from typing import Any

import click

from qkgeom.cli import main
from qkgeom.cli.common import user_errors

DB_HELP = "Results database URL or SQLite file (default: $QKGEOM_DB, else sqlite:///qkgeom.db)."


@main.command()
@click.option("--preset", "preset_name", default=None, metavar="NAME",
              help="Sweep preset: smoke, cpu or paper (default smoke).")
@click.option("--spec", "spec_file", type=click.Path(dir_okay=False), default=None,
              help="Sweep spec file (YAML or TOML); see docs/sweeps.md.")
@click.option("--name", default=None, help="Sweep name (default: the spec's name / preset).")
@click.option("--db", default=None, metavar="URL", help=DB_HELP)
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
              help="With --cluster: validate, build the wheel to ship, print the derived "
              "cluster file and the remote command; start nothing.")
@click.option("--resume", is_flag=True,
              help="Continue sweep --name: restart errored and unfinished trials from their "
              "last checkpoints; finished trials are not rerun.")
@click.option("--gpus-per-trial", type=float, default=None,
              help="GPUs per trial, fractional to share a GPU (default: 0.25 when the cluster "
              "has GPUs, else 0).")
@click.option("--cpus-per-trial", type=float, default=1.0, show_default=True,
              help="CPUs per trial (also its torch thread count).")
@click.option("--max-concurrent", type=int, default=None,
              help="At most this many trials at once (default: as resources allow).")
@click.option("--max-failures", type=int, default=2, show_default=True,
              help="Retries per trial, each from its last checkpoint.")
@click.option("--direct-writes", is_flag=True,
              help="Workers write their probe rows themselves (PostgreSQL only).")
@click.option("--storage", default=None, envvar="QKGEOM_RAY_STORAGE",
              help="Ray Tune storage root (default ~/ray_results); shared storage (NFS, "
              "s3://...) on a multi-node cluster.")
@click.option("--progress-every", type=float, default=10.0, show_default=True,
              help="Seconds between progress lines when nothing changes.")
def sweep(preset_name: str | None, spec_file: str | None, name: str | None, db: str | None,
          data: str | None, sets: tuple[str, ...], address: str | None,
          cluster_file: str | None, dry_run: bool, resume: bool, gpus_per_trial: float | None,
          cpus_per_trial: float, max_concurrent: int | None, max_failures: int,
          direct_writes: bool, storage: str | None, progress_every: float) -> None:
    """Run a study (geometry grid + intervention arms) on Ray Tune into the database."""
    from qkgeom.sweep import plan_from

    with user_errors():
        if address and cluster_file:
            raise click.UsageError("give either --address or --cluster, not both")
        if dry_run and not cluster_file:
            raise click.UsageError("--dry-run goes with --cluster FILE")
        if cpus_per_trial <= 0:
            raise click.BadParameter("must be positive", param_hint="--cpus-per-trial")
        if gpus_per_trial is not None and gpus_per_trial < 0:
            raise click.BadParameter("must be >= 0", param_hint="--gpus-per-trial")
        if max_failures < 0:
            raise click.BadParameter("must be >= 0", param_hint="--max-failures")
        from_db = resume and preset_name is None and spec_file is None
        if from_db and not name:
            raise click.UsageError("--resume needs --name NAME (the sweep to continue)")
        plan = None if from_db else plan_from(preset_name, spec_file, name=name, data=data,
                                              sets=sets)
        if cluster_file:
            from qkgeom.tune import launch_on_cluster

            launch_on_cluster(
                cluster_file, plan=plan, name=name or plan.name, spec_file=spec_file,
                preset=preset_name, data=data, sets=sets, db=db, resume=resume,
                gpus_per_trial=gpus_per_trial, cpus_per_trial=cpus_per_trial,
                max_concurrent=max_concurrent, max_failures=max_failures,
                direct_writes=direct_writes, storage=storage, dry_run=dry_run,
            )
            return

        from qkgeom.tune import SweepOptions, plan_for_resume, run_sweep, shutdown

        if direct_writes and db is not None and not _is_pg(db):
            from qkgeom.tune import SweepError

            raise SweepError("--direct-writes needs a PostgreSQL database; drop it to let "
                             "the driver write (works with SQLite)")
        if plan is None:
            from qkgeom.store import resolve_url

            plan = plan_for_resume(name, resolve_url(db))
        opts = SweepOptions(db_url=db, address=address, storage=storage, resume=resume,
                            cpus_per_trial=cpus_per_trial, gpus_per_trial=gpus_per_trial,
                            max_concurrent=max_concurrent, max_failures=max_failures,
                            direct_writes=direct_writes, progress_every_s=progress_every)
        try:
            summary = run_sweep(plan, opts)
        finally:
            shutdown()
        rows = status_rows(summary["db_url"], plan.name)
        click.echo("")
        click.echo(format_status(rows))
        n_err = summary["errors"]
        click.echo(f"\nsweep {plan.name}: {len(rows) - n_err}/{len(rows)} trials terminated "
                   f"in {summary['wall_s']:.0f} s")
        from qkgeom.store import safe_url

        url = safe_url(summary["db_url"])
        click.echo("results:\n"
                   f"  qkgeom status --name {plan.name} --db '{url}'\n"
                   f"  qkgeom query --db '{url}' \"SELECT * FROM trials\"\n"
                   f"  qkgeom stats sign-test --sweep {plan.name} --db '{url}'")
        if n_err:
            raise click.ClickException(
                f"{n_err} trial(s) did not finish; retry them from their checkpoints with: "
                f"qkgeom sweep --resume --name {plan.name}" + (f" --db '{url}'" if db else ""))


def _is_pg(db: str) -> bool:
    return db.startswith(("postgresql", "postgres"))


def status_rows(db: str | None, name: str | None) -> list[dict[str, Any]]:
    """Per-trial progress of sweep ``name`` (or the only sweep) from the database."""
    from qkgeom.store import open_store

    store = open_store(db, create=False, readonly=True)
    try:
        if name is None:
            sweeps = store.sweeps()["name"].to_list()
            if len(sweeps) != 1:
                from qkgeom.errors import QkgeomError

                raise QkgeomError(f"the database holds {len(sweeps)} sweeps "
                                  f"({', '.join(sweeps) or 'none'}); pick one with --name")
            name = sweeps[0]
        sid = store.require_sweep(name)
        trials = store.trials(name).select(
            "id", "trial_key", "status", "attempts", "host", "device", "config", "error")
        last = store.sql(
            "SELECT p.trial_id, p.step, p.val_loss FROM probes p JOIN trials t "
            "ON t.id = p.trial_id WHERE t.sweep_id = :s ORDER BY p.trial_id, p.step",
            {"s": sid})
    finally:
        store.close()
    last_by: dict[int, tuple[int, float]] = {}
    for tid, step, val in last.iter_rows():
        last_by[tid] = (step, val)
    rows = []
    for tid, key, status, attempts, host, device, config, error in trials.iter_rows():
        cfg = json.loads(config) if isinstance(config, str) else (config or {})
        step, val = last_by.get(tid, (None, math.nan))
        rows.append(dict(trial=key, status=status, attempts=attempts,
                         step=step, max_steps=cfg.get("max_steps"), val_loss=val,
                         host=host or "", device=device or "",
                         error=(error or "").strip().splitlines()[-1:] or [""]))
        rows[-1]["error"] = rows[-1]["error"][0][:80]
    return rows


def format_status(rows: list[dict[str, Any]]) -> str:
    head = ["trial", "status", "tries", "step", "val_loss", "host", "device", "error"]
    body = []
    for r in rows:
        step = "-" if r["step"] is None else f"{r['step']}/{r['max_steps']}"
        val = "-" if r["val_loss"] is None or r["val_loss"] != r["val_loss"] \
            else f"{r['val_loss']:.4f}"
        err = r["error"] if r["status"] in ("error", "pending", "interrupted") else ""
        body.append([r["trial"], r["status"], str(r["attempts"]), step, val, r["host"],
                     r["device"], err])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in [head, *body]]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines.append(", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return "\n".join(lines)


@main.command()
@click.option("--name", default=None, help="Sweep name (optional with a single sweep).")
@click.option("--db", default=None, metavar="URL", help=DB_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def status(name: str | None, db: str | None, as_json: bool) -> None:
    """Per-trial progress of a sweep, read from the database (works while it runs)."""
    with user_errors():
        rows = status_rows(db, name)
    if as_json:
        click.echo(json.dumps([{k: (None if isinstance(v, float) and v != v else v)
                                for k, v in r.items()} for r in rows], indent=1))
    else:
        click.echo(format_status(rows))
