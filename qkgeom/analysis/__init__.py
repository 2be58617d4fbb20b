"""From the results database to the study's statistics: rows in, plain results out.

Everything here reads the store's tables and views through the named queries of
:mod:`qkgeom.store.queries` (polars frames; values bound as parameters), shapes the data,
and calls the pure functions of :mod:`qkgeom.stats`. Missing data raise
:class:`AnalysisError` saying what is missing and what to do.

One module per claim: :mod:`~qkgeom.analysis.gap` (claim 2: PR_Q - PR_K and slopes, trend
windows), :mod:`~qkgeom.analysis.correlation` (3), :mod:`~qkgeom.analysis.intervention`
(4: paired deltas, directional confidence), :mod:`~qkgeom.analysis.checkpoints` (5:
pretrained checkpoints); :mod:`~qkgeom.analysis.trials` picks the sweep and its trials;
:mod:`~qkgeom.analysis.common` holds constants and helpers. Every public name is
importable from ``qkgeom.analysis``.

Units of analysis
-----------------
* A *trajectory* is one (depth, init, layer) curve of the geometry trials (arm
  ``none``), averaged over seeds at each step (the paper's 54 for the full grid).
* A *run-level unit* is one (trial, layer) curve, no averaging.
* Layer-level rows only (head NULL): PR_Q / PR_K are then the PR of the heads
  concatenated, and per-head-by-nature metrics (entropy, qk_*) are the mean over heads.
* By default only trials with status ``terminated`` count (``finished_only``); a running
  trial's "final" probe is not the end of training.
"""

from __future__ import annotations

from qkgeom.analysis.checkpoints import CheckpointTrendReport, checkpoint_trend
from qkgeom.analysis.common import (
    BASELINE_ARM,
    DEFAULT_LAST_PROBES,
    LEVELS,
    PREDICTED_SIGN,
    SUMMARIES,
    TREND_WINDOWS,
    AnalysisError,
    fmt,
    make_rng,
    require_rows,
    unit_keys,
    wide,
)
from qkgeom.analysis.correlation import (
    CorrelationReport,
    correlate,
    correlation_points,
    matched_progress_correlation,
    metric_points,
)
from qkgeom.analysis.gap import (
    SignTestReport,
    SlopesReport,
    collapse_points,
    collapse_summary,
    parse_window,
    pr_gap_units,
    sign_test,
    slopes,
    summarise_gap,
    trajectory_frame,
    window_label,
    window_units,
)
from qkgeom.analysis.intervention import (
    DirectionalReport,
    PairedDeltas,
    PairedTrials,
    default_sign,
    directional,
    intervention_frame,
    intervention_values,
    key_check,
    mean_of_last_probes,
    pair_by_seed,
    paired_deltas,
    paired_trials,
    pairing_notes,
    require_pairs,
)
from qkgeom.analysis.scope import Scope, scope_fields, sweep_name
from qkgeom.analysis.trials import (
    SCALE_KEYS,
    arms_summary,
    cells_of,
    check_metric,
    known_metrics,
    require_one_cell,
    resolve_scope,
    resolve_sweep,
    select_trials,
    study_scale,
    sweep_trials,
    test_loss_pairs,
    trial_rows,
)
from qkgeom.store.queries import layer_values, pretrained_models

__all__ = [
    "BASELINE_ARM", "DEFAULT_LAST_PROBES", "LEVELS", "PREDICTED_SIGN", "SCALE_KEYS",
    "SUMMARIES", "TREND_WINDOWS", "AnalysisError", "CheckpointTrendReport",
    "CorrelationReport", "DirectionalReport", "PairedDeltas", "PairedTrials", "SignTestReport",
    "SlopesReport", "Scope", "arms_summary", "cells_of", "check_metric", "checkpoint_trend", "collapse_points",
    "collapse_summary", "correlate", "correlation_points", "default_sign", "directional",
    "fmt", "intervention_frame", "intervention_values", "key_check", "known_metrics",
    "layer_values", "make_rng", "mean_of_last_probes", "metric_points", "paired_deltas",
    "parse_window", "pair_by_seed", "paired_trials", "pairing_notes", "pr_gap_units",
    "pretrained_models", "require_one_cell", "require_pairs", "require_rows",
    "resolve_scope", "resolve_sweep", "scope_fields", "sweep_name", "select_trials",
    "sign_test", "slopes", "study_scale", "summarise_gap", "sweep_trials", "test_loss_pairs",
    "trajectory_frame", "trial_rows", "unit_keys", "window_label",
    "window_units", "wide", "matched_progress_correlation",
]
