"""The study's read-side queries over the views: the SELECTs of :mod:`qkgeom.analysis` and
:class:`qkgeom.report.study.Study` that :class:`~qkgeom.store.Store` (reads of the tables:
sweeps, trials, last probes, ...) has no method for, each a named function. One query
lives in one place: a read that is a Store method is not repeated here.

Values always reach SQL as bound parameters; IN lists are expanding bind parameters
(``bindparam(name, expanding=True)``), never text built from values. Each function takes
an open :class:`~qkgeom.store.Store` and returns a polars DataFrame (float NULLs stay
null unless the docstring says NaN) or plain Python values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from qkgeom.errors import QkgeomError

if TYPE_CHECKING:
    import polars as pl

    from qkgeom.store.store import Store


def _with_lists(sql: str, *names: str) -> Any:
    """``text(sql)`` whose parameters ``names`` are expanding (``IN :name`` lists)."""
    from sqlalchemy import bindparam, text

    return text(sql).bindparams(*(bindparam(n, expanding=True) for n in names))


# --------------------------------------------------------------------------- sweeps


def metric_definition_names(store: Store) -> list[str]:
    """Metric names declared in ``metric_definitions``."""
    return store.sql("SELECT name FROM metric_definitions")["name"].to_list()


def data_version(store: Store, sweep_id: int) -> tuple[Any, ...]:
    """A cheap fingerprint of a sweep's stored data: (probes, sum of their steps, every
    trial's (id, status, attempts), pretrained runs in the database)."""
    p = store.sql(
        "SELECT COUNT(*) AS n, COALESCE(SUM(p.step), 0) AS s FROM probes p "
        "JOIN trials t ON t.id = p.trial_id WHERE t.sweep_id = :s", {"s": sweep_id})
    t = store.sql("SELECT id, status, attempts FROM trials WHERE sweep_id = :s "
                  "ORDER BY id", {"s": sweep_id})
    try:
        n_pre = int(store.sql("SELECT COUNT(*) AS n FROM pretrained_runs")["n"][0])
    except QkgeomError:  # an older schema without the table
        n_pre = 0
    return (int(p["n"][0]), int(p["s"][0]), tuple(t.iter_rows()), n_pre)


# --------------------------------------------------------------------------- metrics


def layer_values(store: Store, trial_ids: Sequence[int], metrics: Sequence[str]
                 ) -> pl.DataFrame:
    """Layer-level rows of ``metrics`` for ``trial_ids``: trial_id, step, progress,
    layer, metric, value (NaN for NULL)."""
    import polars as pl

    if not trial_ids:
        return pl.DataFrame(schema={"trial_id": pl.Int64, "step": pl.Int64,
                                    "progress": pl.Float64, "layer": pl.Int64,
                                    "metric": pl.String, "value": pl.Float64})
    df = store.sql(_with_lists(
        "SELECT trial_id, step, progress, layer, metric, value FROM v_layer_metrics "
        "WHERE metric IN :metrics AND trial_id IN :ids", "metrics", "ids"),
        {"metrics": list(metrics), "ids": [int(i) for i in trial_ids]})
    return df.with_columns(pl.col("progress").cast(pl.Float64),
                           pl.col("value").cast(pl.Float64).fill_null(float("nan")))


def probe_losses(store: Store, trial_ids: Sequence[int]) -> pl.DataFrame:
    """The validation loss at every probe of ``trial_ids``: trial_id, step, val_loss (NaN
    for NULL)."""
    import polars as pl

    if not trial_ids:
        return pl.DataFrame(schema={"trial_id": pl.Int64, "step": pl.Int64,
                                    "val_loss": pl.Float64})
    df = store.sql(_with_lists("SELECT trial_id, step, val_loss FROM probes "
                               "WHERE trial_id IN :ids", "ids"),
                   {"ids": [int(i) for i in trial_ids]})
    return df.with_columns(pl.col("val_loss").cast(pl.Float64).fill_null(float("nan")))


def sweep_layer_values(store: Store, sweep_id: int, metric: str, *, arm: str | None = None,
                       status: str | None = None) -> pl.DataFrame:
    """Layer-level ``metric`` of every trial of sweep ``sweep_id`` (optionally one arm,
    one status), ordered by trial, step, layer: trial_id, depth, init, arm, seed, status,
    step, progress, layer, value (null for NaN)."""
    import polars as pl

    where = ["sweep_id = :s", "metric = :m"]
    params: dict[str, Any] = {"s": sweep_id, "m": metric}
    if arm is not None:
        where.append("arm = :a")
        params["a"] = arm
    if status is not None:
        where.append("status = :status")
        params["status"] = status
    # the WHERE clause is assembled from the fixed conditions above, never from values
    df = store.sql("SELECT trial_id, depth, init, arm, seed, status, step, progress, layer, "
                   f"value FROM v_layer_metrics WHERE {' AND '.join(where)} "
                   "ORDER BY trial_id, step, layer", params)
    return df.with_columns(pl.col("progress").cast(pl.Float64),
                           pl.col("value").cast(pl.Float64).fill_nan(None))


def final_values(store: Store, sweep_id: int, metric: str) -> pl.DataFrame:
    """``metric`` at each trial's latest probe, per layer (``v_final``): trial_id, depth,
    init, arm, seed, status, layer, step, value, test_loss (nulls for NaN)."""
    import polars as pl

    df = store.sql(
        "SELECT f.trial_id, f.depth, f.init, f.arm, f.seed, t.status, f.layer, f.step, "
        "f.value, f.test_loss FROM v_final f JOIN trials t ON t.id = f.trial_id "
        "WHERE t.sweep_id = :s AND f.metric = :m ORDER BY f.trial_id, f.layer",
        {"s": sweep_id, "m": metric})
    return df.with_columns(pl.col("value").cast(pl.Float64).fill_nan(None),
                           pl.col("test_loss").cast(pl.Float64).fill_nan(None))


def final_layer_means(store: Store, sweep_id: int, metrics: Sequence[str]) -> pl.DataFrame:
    """Each of ``metrics`` at each trial's latest probe, averaged over layers: trial_id,
    depth, init, arm, seed, status, step, test_loss, metric, value (nulls for NaN)."""
    import polars as pl

    df = store.sql(_with_lists(
        "SELECT f.trial_id, f.depth, f.init, f.arm, f.seed, t.status, f.step, f.test_loss,"
        " f.metric, AVG(f.value) AS value FROM v_final f JOIN trials t "
        "ON t.id = f.trial_id WHERE t.sweep_id = :s AND f.metric IN :metrics "
        "GROUP BY f.trial_id, f.depth, f.init, f.arm, f.seed, t.status, f.step, "
        "f.test_loss, f.metric", "metrics"), {"s": sweep_id, "metrics": list(metrics)})
    if df.height == 0:
        return df
    return df.with_columns(pl.col("value").cast(pl.Float64).fill_nan(None),
                           pl.col("test_loss").cast(pl.Float64).fill_nan(None))


# --------------------------------------------------------------------------- pretrained


def pretrained_models(store: Store) -> pl.DataFrame:
    """model, n_checkpoints, first/last step (from ``pretrained_runs``)."""
    return store.sql(
        "SELECT model, COUNT(*) AS n_checkpoints, MIN(step) AS first_step, "
        "MAX(step) AS last_step FROM pretrained_runs GROUP BY model ORDER BY model")


def pretrained_layer_values(store: Store, model: str, metrics: Sequence[str]
                            ) -> pl.DataFrame:
    """Layer-level rows of ``metrics`` over ``model``'s checkpoints (``v_pretrained``):
    revision, step, layer, metric, value (NaN for NULL)."""
    import polars as pl

    df = store.sql(_with_lists(
        "SELECT revision, step, layer, metric, value FROM v_pretrained "
        "WHERE model = :model AND head IS NULL AND metric IN :metrics", "metrics"),
        {"model": model, "metrics": list(metrics)})
    return df.with_columns(pl.col("value").cast(pl.Float64).fill_null(float("nan")))
