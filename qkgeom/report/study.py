"""A study for notebooks: ``qkgeom.open_study(db, sweep)``.

:class:`Study` reads one sweep of a results database (opened read-only) and returns
polars DataFrames (:meth:`Study.trials`, :meth:`Study.trajectories`, :meth:`Study.finals`,
:meth:`Study.arms`, :meth:`Study.pretrained`), the statistics the CLI prints (the same
functions of :mod:`qkgeom.analysis` and :mod:`qkgeom.report.render`, as their dataclasses), and
the project's altair charts (:meth:`Study.chart`). Every call reads the database again,
so a study that is still running shows its newest rows. ``qkgeom serve`` builds its page
from the same methods. See docs/python-api.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import polars as pl

from qkgeom import analysis as A
from qkgeom.errors import QkgeomError
from qkgeom.store import queries as Q

if TYPE_CHECKING:
    from qkgeom.store import Store

FINISHED = "terminated"
CHART_KINDS = ("trajectories", "metric", "intervention", "correlation", "checkpoints",
               "final-gap")
ARM_METRICS = ("entropy", "pr_wk", "pr_k")
TRIAL_COLUMNS = {
    "trial_id": pl.Int64, "trial_key": pl.String, "depth": pl.Int64, "init": pl.String,
    "arm": pl.String, "seed": pl.Int64, "status": pl.String, "attempts": pl.Int64,
    "step": pl.Int64, "max_steps": pl.Int64, "progress": pl.Float64, "val_loss": pl.Float64,
    "test_loss": pl.Float64, "host": pl.String, "device": pl.String, "error": pl.String,
    "stale_s": pl.Float64,
    # the provenance of the trial's latest attempt (trial_attempts; null before one)
    "code_version": pl.String, "git_commit": pl.String, "git_dirty": pl.Boolean,
    "versions": pl.String,
}
# columns of the frames that factor columns join (trials, per-trial trajectories, finals,
# the gap frame): a factor of the same name is the column ``config.NAME`` instead
FRAME_COLUMNS = frozenset(TRIAL_COLUMNS) | {"cell", "layer", "value", "metric", "n_seeds",
                                            "pr_k", "model", "peak"}


def factor_column(name: str) -> str:
    """The column of config key ``name`` as a factor: ``name``, or ``config.NAME`` when a
    trial column has that name (``status``, ``device``, ``step`` ...), so that both are
    kept and neither is mistaken for the other (``--where config.NAME=V`` reads the
    same)."""
    return f"config.{name}" if name in FRAME_COLUMNS else name


def open_study(db: str | None = None, sweep: str | None = None) -> Study:
    """Open sweep ``sweep`` of the database ``db`` (URL or SQLite file; default
    ``$QKGEOM_DB``) read-only. ``sweep`` may be omitted when the database holds one sweep.
    Close it with :meth:`Study.close` (or use it in a ``with`` block)."""
    from qkgeom.store import open_store

    store = open_store(db, create=False, readonly=True)
    try:
        name = A.resolve_sweep(store, sweep)
    except BaseException:  # the study owns the store from here on; until then, we do
        store.close()
        raise
    return Study(store, name, owns_store=True)


def _versions(attempt: dict[str, Any]) -> str | None:
    """``python 3.11.7, torch 2.13.0, ray 2.60.0, cuda -`` of an attempt row (None: none)."""
    if not attempt:
        return None
    return ", ".join(f"{k} {attempt.get(k) or '-'}" for k in ("python", "torch", "ray", "cuda"))


def _num(v: Any) -> float | None:
    if v is None:
        return None
    v = float(v)
    return None if math.isnan(v) else v


class Study:
    """One sweep of an open store. Built by :func:`open_study` (or by the server, which
    shares one store between requests: ``Study(store, name)``)."""

    def __init__(self, store: Store, sweep: str, *, owns_store: bool = False) -> None:
        self.store = store
        self.name = sweep
        self.sweep_id = store.require_sweep(sweep)
        self._owns = owns_store

    # ------------------------------------------------------------------ plumbing
    def close(self) -> None:
        if self._owns:
            self.store.close()

    def __enter__(self) -> Study:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Study({self.name!r}, db={self.store.safe_url!r})"

    def version(self) -> tuple[Any, ...]:
        """A cheap fingerprint of the sweep's stored data: it changes when a probe is
        written or a trial changes status (the server caches verdicts and charts on it)."""
        return Q.data_version(self.store, self.sweep_id)

    # ------------------------------------------------------------------ frames
    def trials(self) -> pl.DataFrame:
        """One row per trial: trial_id, (cell and factor columns for a sweep with cells,
        :meth:`factor_frame`), trial_key, depth, init, arm, seed, status, attempts,
        step (latest probe), max_steps, progress (step / max_steps; 1 once terminated),
        val_loss (at the latest probe), test_loss (once finished), host, device, error (the
        last line of the trial's error text), stale_s (a running trial's seconds without a
        heartbeat once its driver is gone, else null; its error then says so), and the
        provenance of its latest attempt: code_version, git_commit, git_dirty, versions
        (``python 3.11.7, torch 2.13.0, ray 2.60.0, cuda -``)."""
        from datetime import datetime, timezone

        from qkgeom.store.lease import read_lease
        from qkgeom.store.lifecycle import no_heartbeat_s, stale_note

        sweeps = self.store.sweeps()
        lease = read_lease(self.store, self.sweep_id)
        every = dict(zip(sweeps["name"], sweeps["heartbeat_s"])).get(self.name)
        now = datetime.now(timezone.utc)
        t = self.store.trials(self.name)
        by = self.store.last_probes(self.sweep_id)
        latest = {a["trial_id"]: a for a in self.store.attempts(self.name).iter_rows(named=True)}
        rows = []
        for r in t.iter_rows(named=True):
            a = latest.get(r["id"]) or {}
            cfg = json.loads(r["config"]) if r["config"] else {}
            step, val = by.get(int(r["id"]), (None, None))
            max_steps = cfg.get("max_steps")
            if r["status"] == FINISHED:
                prog = 1.0
            elif step is not None and max_steps:
                prog = min(1.0, step / max_steps)
            else:
                prog = 0.0
            err = (r["error"] or "").strip().splitlines()
            stale = no_heartbeat_s(r["status"], r["heartbeat_at"], r["started_at"], every, now)
            if stale is not None:
                err = [stale_note(stale, self.name, lease)]
            rows.append({
                "trial_id": r["id"], "trial_key": r["trial_key"], "depth": r["depth"],
                "init": r["init"], "arm": r["arm"], "seed": r["seed"], "status": r["status"],
                "attempts": r["attempts"], "step": step,
                "max_steps": int(max_steps) if max_steps is not None else None,
                "progress": prog, "val_loss": _num(val), "test_loss": _num(r["test_loss"]),
                "host": r["host"] or "", "device": r["device"] or "",
                "error": err[-1] if err else "", "stale_s": stale,
                "code_version": a.get("code_version"), "git_commit": a.get("git_commit"),
                "git_dirty": a.get("git_dirty"), "versions": _versions(a)})
        return self._with_factors(pl.DataFrame(rows, schema=TRIAL_COLUMNS,
                                               orient="row" if rows else None))

    # ------------------------------------------------------------------ factors
    def factors(self) -> list[str]:
        """The factors of the sweep's cells (a spec with ``cells`` or ``axes``): config
        keys whose value differs between cells, one name for keys that always change
        together (``n_embd`` with ``block_size``); empty for a sweep without cells. A key
        named like a trial column is ``config.KEY`` (:func:`factor_column`)."""
        return [factor_column(f.name) for f in self._factors()[0]]

    def _factors(self) -> tuple[list[Any], dict[str, dict[str, Any]]]:
        from qkgeom.report.sensitivity import study_factors

        rows = A.trial_rows(self.store, self.name)
        cells = sorted({r["cell"] for r in rows if r["cell"] is not None})
        if len(cells) < 2:
            return [], {}
        return study_factors({c: [r["config"] for r in rows if r["cell"] == c]
                              for c in cells})

    def factor_frame(self) -> pl.DataFrame:
        """One row per trial: trial_id, cell and one column per factor (:meth:`factors`)
        with the trial's value: what to join a frame on to group it by factor."""
        factors, values = self._factors()
        rows = [{"trial_id": r["trial_id"], "cell": r["cell"],
                 **{factor_column(f.name): values.get(r["cell"], {}).get(f.name)
                    for f in factors}}
                for r in A.trial_rows(self.store, self.name)]
        if not rows:
            return pl.DataFrame(schema={"trial_id": pl.Int64, "cell": pl.String})
        return pl.DataFrame(rows, schema_overrides={"trial_id": pl.Int64, "cell": pl.String},
                            strict=False, infer_schema_length=None)

    def cells(self) -> pl.DataFrame:
        """One row per cell: cell, each factor's value, n_trials, terminated (one row with
        cell null for a sweep without cells)."""
        f = self.factor_frame()
        t = self.store.trials(self.name).select(pl.col("id").alias("trial_id"), "status")
        j = f.join(t, on="trial_id")
        keys = [c for c in f.columns if c != "trial_id"]
        return (j.group_by(keys, maintain_order=True)
                .agg(pl.len().alias("n_trials"),
                     (pl.col("status") == FINISHED).sum().alias("terminated"))
                .sort("cell", nulls_last=True))

    def check_facet(self, facet: str | None) -> str:
        """A chart's facet: a factor of the sweep or ``cell`` (default: the first
        factor); anything else is refused with the choices."""
        names = self.factors()
        if facet is None:
            if not names:
                raise QkgeomError(f"sweep {self.name!r} has no cells to facet by; the "
                                  "final-gap chart needs a sweep with cells or axes")
            return names[0]
        if facet not in (*names, "cell"):
            raise QkgeomError(f"facet {facet!r}: sweep {self.name!r} has the factors "
                              f"{', '.join([*names, 'cell']) if names else 'none'}")
        return facet

    def _with_factors(self, df: pl.DataFrame) -> pl.DataFrame:
        """``df`` (with trial_id) with the cell and factor columns after trial_id (a sweep
        with cells; others are returned as they are)."""
        if not self._factors()[0]:
            return df
        f = self.factor_frame()
        extra = [c for c in f.columns if c != "trial_id" and c not in df.columns]
        if not extra:
            return df
        out = df.join(f.select("trial_id", *extra), on="trial_id", how="left")
        i = df.columns.index("trial_id") + 1
        return out.select([*df.columns[:i], *extra, *df.columns[i:]])

    def progress(self) -> dict[str, Any]:
        """The whole study's progress: n_trials, counts per status, stale (running trials
        whose driver is gone), fraction (mean of the trials' progress), finished (every
        trial terminated)."""
        t = self.trials()
        counts = {s: n for s, n in t.group_by("status").len().sort("status").iter_rows()}
        n = t.height
        return {"n_trials": n, "status": counts, "stale": int(t["stale_s"].is_not_null().sum()),
                "fraction": float(t["progress"].mean()) if n else 0.0,
                "finished": n > 0 and counts.get(FINISHED, 0) == n}

    def metrics(self) -> list[str]:
        """Metric names a trajectory can be asked for (qkgeom's and the database's)."""
        return A.known_metrics(self.store)

    def trajectories(self, metric: str = "pr_q", *, per_trial: bool = False,
                     arm: str | None = None, finished_only: bool = False,
                     trials: Collection[int] | None = None) -> pl.DataFrame:
        """Layer-level ``metric`` over training.

        Default: the mean over seeds per (depth, init, arm, layer, step): columns depth,
        init, arm, layer, step, progress, value, n_seeds. ``per_trial``: one row per
        (trial, step, layer) with trial_id, seed and status instead of n_seeds. Every trial
        counts unless ``finished_only``; ``arm`` keeps one arm; ``trials`` keeps those
        trial ids (e.g. one cell's, from :meth:`trials`).
        """
        metric = A.check_metric(self.store, metric)
        df = Q.sweep_layer_values(self.store, self.sweep_id, metric, arm=arm,
                                  status=FINISHED if finished_only else None)
        if trials is not None:
            df = df.filter(pl.col("trial_id").is_in(list(trials)))
        if per_trial:
            return self._with_factors(df.select("trial_id", "depth", "init", "arm", "seed",
                                                "status", "step", "progress", "layer",
                                                "value"))
        return (df.group_by(["depth", "init", "arm", "layer", "step"])
                .agg(pl.col("progress").mean(), pl.col("value").mean(),
                     pl.col("value").count().alias("n_seeds"))
                .sort(["depth", "init", "arm", "layer", "step"]))

    def finals(self, metric: str = "pr_q", *, finished_only: bool = False) -> pl.DataFrame:
        """``metric`` at each trial's latest probe, per layer: trial_id, depth, init, arm,
        seed, status, layer, step, value, test_loss (a running trial's latest probe is not
        the end of training: filter on status, or pass ``finished_only``)."""
        metric = A.check_metric(self.store, metric)
        df = self._with_factors(Q.final_values(self.store, self.sweep_id, metric))
        return df.filter(pl.col("status") == FINISHED) if finished_only else df

    def arms(self, *, baseline: str = A.BASELINE_ARM) -> pl.DataFrame:
        """The intervention arms beside their baselines, one row per arm trial: depth, init,
        arm, seed, status, step, test_loss and, at the latest probe and averaged over
        layers, entropy, pr_wk (the achieved W_K weight PR) and pr_k (key PR_K), each with
        the paired baseline trial's value (``baseline_*``, same depth, init and seed).
        Empty when the sweep has no arm other than ``baseline``."""
        keys = ["trial_id", "depth", "init", "arm", "seed", "status", "step", "test_loss"]
        schema = {"depth": pl.Int64, "init": pl.String, "arm": pl.String, "seed": pl.Int64,
                  "status": pl.String, "step": pl.Int64, "test_loss": pl.Float64}
        for m in ARM_METRICS:
            schema[m] = pl.Float64
        for m in ("test_loss", *ARM_METRICS):
            schema[f"baseline_{m}"] = pl.Float64
        df = Q.final_layer_means(self.store, self.sweep_id, ARM_METRICS)
        if df.height == 0 or set(df["arm"].to_list()) <= {baseline}:
            return pl.DataFrame(schema=schema)
        w = df.pivot(on="metric", index=keys, values="value")
        for m in ARM_METRICS:
            if m not in w.columns:
                w = w.with_columns(pl.lit(None, dtype=pl.Float64).alias(m))
        base = w.filter(pl.col("arm") == baseline).select(
            "depth", "init", "seed", *[pl.col(m).alias(f"baseline_{m}")
                                       for m in ("test_loss", *ARM_METRICS)])
        out = w.filter(pl.col("arm") != baseline).join(base, on=["depth", "init", "seed"],
                                                       how="left")
        return out.select(list(schema)).cast(schema).sort(["arm", "depth", "init", "seed"])

    def pretrained(self) -> pl.DataFrame:
        """Pretrained models measured in this database (they belong to no sweep): model,
        n_checkpoints, first_step, last_step."""
        return A.pretrained_models(self.store)

    # ------------------------------------------------------------------ statistics
    # The same calls as ``qkgeom stats ...`` (finished trials only unless told).

    def sign_test(self, **kw: Any) -> A.SignTestReport:
        """``qkgeom stats sign-test``: see :func:`qkgeom.analysis.sign_test`."""
        if "window" in kw:
            kw["window"] = A.parse_window(kw["window"])
        return A.sign_test(self.store, self.name, **kw)

    def slopes(self, **kw: Any) -> A.SlopesReport:
        """``qkgeom stats slopes``: see :func:`qkgeom.analysis.slopes`."""
        if "window" in kw:
            kw["window"] = A.parse_window(kw["window"])
        return A.slopes(self.store, self.name, **kw)

    def directional(self, arm: str, **kw: Any) -> A.DirectionalReport:
        """``qkgeom stats directional-confidence``: see :func:`qkgeom.analysis.directional`."""
        return A.directional(self.store, self.name, arm=arm, **kw)

    def correlate(self, x: str, y: str, **kw: Any) -> A.CorrelationReport:
        """``qkgeom stats correlate``: see :func:`qkgeom.analysis.correlate`."""
        return A.correlate(self.store, self.name, x=x, y=y, **kw)

    def checkpoint_trends(self) -> dict[str, A.CheckpointTrendReport | QkgeomError]:
        """:meth:`checkpoint_trend` of every pretrained model in the database, or the error
        that says why a model has none (no checkpoint with a known step)."""
        out: dict[str, A.CheckpointTrendReport | QkgeomError] = {}
        for model in self.pretrained()["model"].to_list():
            try:
                out[model] = A.checkpoint_trend(self.store, model)
            except QkgeomError as e:
                out[model] = e
        return out

    def checkpoint_frame(self, trends: dict[str, Any] | None = None) -> pl.DataFrame:
        """PR_Q - PR_K (mean over layers) at every checkpoint with a step of every
        pretrained model in the database: model, step, value, peak (the model's peak).
        ``trends``: :meth:`checkpoint_trends` when the caller already has it."""
        rows = []
        for model, rep in (self.checkpoint_trends() if trends is None else trends).items():
            if isinstance(rep, QkgeomError):
                continue  # no checkpoint with a known step: nothing to draw
            o = rep.overall
            rows += [{"model": model, "step": int(st), "value": float(v),
                      "peak": o.peak_step is not None and int(st) == int(o.peak_step)}
                     for st, v in zip(o.steps, o.values)]
        return pl.DataFrame(rows, schema={"model": pl.String, "step": pl.Int64,
                                          "value": pl.Float64, "peak": pl.Boolean})

    def checkpoint_trend(self, model: str) -> A.CheckpointTrendReport:
        """``qkgeom stats checkpoint-trend``: see :func:`qkgeom.analysis.checkpoint_trend`."""
        return A.checkpoint_trend(self.store, model)

    def claims(self, *, seed: int = 0, n_boot: int = 10_000,
               finished_only: bool = True) -> list[Any]:
        """Every claim of the paper with its verdict on the data stored now (what
        ``qkgeom report`` prints): a list of :class:`qkgeom.report.claims.Claim`
        (also importable as ``qkgeom.report.render.Claim``)."""
        from qkgeom.report.claims import compute_claims

        return compute_claims(self.store, self.name, seed=seed, n_boot=n_boot,
                              finished_only=finished_only).claims

    def report(self, out_dir: str, **kw: Any) -> list[Any]:
        """Write the report files (``qkgeom report --out out_dir``); their paths."""
        from qkgeom.report.render import build_report

        return build_report(self.store, self.name, out_dir, **kw)

    # ------------------------------------------------------------------ charts
    def gap_frame(self, *, finished_only: bool = True) -> pl.DataFrame:
        """PR_Q - PR_K at each baseline trial's last probe, per layer: trial_id, the cell
        and factor columns (a sweep with cells), depth, init, seed, layer, value."""
        q = self.finals("pr_q", finished_only=finished_only)
        k = self.finals("pr_k", finished_only=finished_only)
        keys = [c for c in q.columns if c not in ("value", "step", "test_loss", "status")]
        j = q.join(k.select("trial_id", "layer", pl.col("value").alias("pr_k")),
                   on=["trial_id", "layer"])
        j = j.filter(pl.col("arm") == A.BASELINE_ARM)
        return j.select(*keys, (pl.col("value") - pl.col("pr_k")).alias("value"))

    def chart(self, kind: str = "trajectories", *, metric: str | None = None,
              per_trial: bool = False, finished_only: bool = True, x: str = "pr_k",
              y: str = "entropy", seed: int = 0, facet: str | None = None,
              trials: Collection[int] | None = None) -> Any:
        """The project's altair charts (they render inline in Jupyter).

        ``trajectories``: PR_Q and PR_K per layer (``qkgeom plot trajectories``; one pair
        of lines per seed of the baseline arm with ``per_trial``), or, with
        ``metric``, that metric per layer of the baseline arm, mean over seeds or one line
        per seed (``per_trial``); ``metric`` alone is the same; ``intervention``: the arms
        over training; ``correlation``: ``y`` against ``x``; ``checkpoints``: PR_Q - PR_K
        over the pretrained models' checkpoints (:meth:`checkpoint_frame`); ``final-gap``:
        PR_Q - PR_K at the last probe per layer, one panel per value of ``facet`` (a factor
        of :meth:`factors`, or ``cell``; default the first factor).
        ``finished_only`` as in the CLI (pass False for a running sweep). ``trials``
        (trajectories and metric charts): draw only those trial ids, e.g. one cell's.
        """
        from qkgeom.report import plots

        if kind not in CHART_KINDS:
            raise QkgeomError(f"unknown chart {kind!r}; use one of {', '.join(CHART_KINDS)}")
        fin = finished_only
        if kind == "metric" or (kind == "trajectories" and metric is not None):
            if metric is None:
                raise QkgeomError("chart('metric') needs metric=NAME, e.g. metric='pr_k'")
            df = self.trajectories(metric, per_trial=True, finished_only=fin, trials=trials)
            base = df.filter(pl.col("arm") == A.BASELINE_ARM)
            df = base if base.height else df
            if per_trial:
                df = df.group_by(["depth", "init", "layer", "seed", "step"]).agg(
                    pl.col("progress").mean(), pl.col("value").mean())
            return plots.metric_trajectories(df, metric, per_trial=per_trial)
        if kind == "trajectories" and (per_trial or trials is not None):
            # PR_Q and PR_K from the runs: one pair per seed, or (some trials) their mean
            df = pl.concat([self.trajectories(m, per_trial=True, finished_only=fin,
                                              trials=trials)
                            .with_columns(pl.lit(m).alias("metric")) for m in ("pr_q", "pr_k")])
            base = df.filter(pl.col("arm") == A.BASELINE_ARM)
            return plots.trajectories(base if base.height else df, per_seed=per_trial)
        if kind == "trajectories":
            return plots.trajectories(A.trajectory_frame(self.store, self.name,
                                                         finished_only=fin))
        if kind == "checkpoints":
            return plots.checkpoint_trends(self.checkpoint_frame())
        if kind == "final-gap":
            return plots.final_gap(self.gap_frame(finished_only=fin),
                                   facet=self.check_facet(facet))
        if kind == "intervention":
            return plots.intervention(A.intervention_frame(self.store, self.name,
                                                           finished_only=fin))
        from qkgeom.stats import spearman

        pts = A.correlation_points(self.store, self.name, x=x, y=y, finished_only=fin)
        return plots.correlation(pts, x=x, y=y, seed=seed,
                                 rho=spearman(pts[x].to_numpy(), pts[y].to_numpy()))
