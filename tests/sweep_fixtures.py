"""Helpers for the sweep/tune/cluster tests (functions; the fixtures ``scratch`` and
``pg_database_url`` are in tests/conftest.py).

Ray's scratch (``_temp_dir``) and Tune's storage live under short directories in /tmp,
never in the repository. PostgreSQL tests read ``QKGEOM_TEST_PG_URL`` (``.ci/postgres.sh``)
and skip without it, except under CI (any truthy ``CI``) where its absence fails.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QKGEOM = str(Path(sys.executable).with_name("qkgeom"))


def cli_env(scratch: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["QKGEOM_RAY_STORAGE"] = str(scratch / "ray_results")
    env.setdefault("QKGEOM_CACHE", str(ROOT / ".pytest_cache" / "qkgeom-data"))
    env["TMPDIR"] = "/tmp"
    return env


def run_cli(args: list[str], scratch: Path, timeout: float = 300, check: bool = True,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run([QKGEOM, *args], env={**cli_env(scratch), **(env or {})},
                       capture_output=True, text=True,
                       timeout=timeout, cwd=scratch)
    if check and p.returncode != 0:
        raise AssertionError(f"qkgeom {' '.join(args)} failed ({p.returncode}):\n"
                             f"{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
    return p


def probe_counts(db: str, sweep: str) -> dict[str, tuple[int, int]]:
    """trial_key -> (probe rows, metric rows)."""
    from qkgeom.store import open_store

    with open_store(db) as store:
        df = store.sql(
            "SELECT t.trial_key, (SELECT count(*) FROM probes p WHERE p.trial_id = t.id) AS np, "
            "(SELECT count(*) FROM probe_metrics m WHERE m.trial_id = t.id) AS nm "
            "FROM trials t JOIN sweeps s ON s.id = t.sweep_id WHERE s.name = :n",
            {"n": sweep})
    return {k: (int(a), int(b)) for k, a, b in df.iter_rows()}


def assert_sweep_complete(db: str, sweep: str, plan) -> None:  # type: ignore[no-untyped-def]
    """Every trial terminated with the expected number of probe and metric rows."""
    from qkgeom.store import open_store

    with open_store(db) as store:
        trials = store.trials(sweep)
    assert sorted(trials["trial_key"].to_list()) == sorted(t.key for t in plan.trials)
    bad = trials.filter(trials["status"] != "terminated")
    assert bad.height == 0, bad.select("trial_key", "status", "error").to_dicts()
    counts = probe_counts(db, sweep)
    # an arm with a baseline-relative target runs with the baseline_pr filled in from the
    # database: the stored config, not the plan's placeholder, is what it trained with
    import json

    stored = {k: json.loads(c) for k, c in zip(trials["trial_key"], trials["config"])}
    for t in plan.trials:
        n_probe = plan.probes_per_trial(t.key)
        n_metric = metric_rows(t, stored[t.key] if t.needs_baseline else None)
        assert counts[t.key] == (n_probe, n_metric), (t.key, counts[t.key], n_probe, n_metric)


def metric_rows(t, config: dict | None = None) -> int:  # type: ignore[no-untyped-def]
    """Metric rows trial spec ``t`` (run with ``config``, default its own) writes in all
    (from a real uninterrupted run)."""
    return sum(len(r.metrics) for r in reference_records(config or t.config))


_REF_CACHE: dict[str, list] = {}
_REF_TEST_LOSS: dict[str, float] = {}


def _ref_key(config: dict) -> tuple[str, dict]:
    import json

    cfg = dict(config, device="cpu", fail_at_step=-1, threads=1)
    return json.dumps(cfg, sort_keys=True), cfg


def reference_records(config: dict) -> list:
    """The probe records of a direct, uninterrupted ``train()`` of ``config`` (cached)."""
    from qkgeom.config import TrialConfig
    from qkgeom.engine.train import train

    key, cfg = _ref_key(config)
    if key not in _REF_CACHE:
        recs: list = []
        result = train(TrialConfig.from_dict(cfg), lambda r, c: recs.append(r))
        _REF_CACHE[key] = recs
        _REF_TEST_LOSS[key] = result.test_loss
    return _REF_CACHE[key]


def reference_test_loss(config: dict) -> float:
    """The final test loss of the same direct, uninterrupted ``train()`` (cached)."""
    reference_records(config)
    return _REF_TEST_LOSS[_ref_key(config)[0]]


def assert_matches_reference(db: str, sweep: str, keys: list[str] | None = None,
                             tol: float = 1e-6) -> int:
    """Each trial's stored metrics equal an uninterrupted direct train() of its config."""
    import json

    from qkgeom.store import open_store

    checked = 0
    with open_store(db) as store:
        trials = store.trials(sweep)
        for row in trials.iter_rows(named=True):
            if keys is not None and row["trial_key"] not in keys:
                continue
            got = store.read_probes(row["id"])
            ref = reference_records(json.loads(row["config"]))
            assert [r.step for r in got] == [r.step for r in ref], \
                (row["trial_key"], [r.step for r in got], [r.step for r in ref])
            for g, r in zip(got, ref):
                gm = {(a, b, c): v for a, b, c, v in g.metrics}
                rm = {(a, b, c): v for a, b, c, v in r.metrics}
                assert gm.keys() == rm.keys(), (row["trial_key"], g.step)
                for k, v in rm.items():
                    w = gm[k]
                    if math.isnan(v):
                        assert math.isnan(w), (row["trial_key"], g.step, k)
                    else:
                        assert abs(w - v) <= tol * max(1.0, abs(v)), \
                            (row["trial_key"], g.step, k, w, v)
                assert abs(g.val_loss - r.val_loss) <= tol * max(1.0, abs(r.val_loss))
            ref_test = reference_test_loss(json.loads(row["config"]))
            assert row["test_loss"] is not None, row["trial_key"]
            assert abs(row["test_loss"] - ref_test) <= tol * max(1.0, abs(ref_test)), \
                (row["trial_key"], row["test_loss"], ref_test)
            checked += 1
    return checked
