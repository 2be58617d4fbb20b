"""Every ``sql`` block of docs/schema.md runs on both backends and returns the rows its
planted data imply."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import make_record

from qkgeom.records import METRIC_DEFINITIONS, METRICS
from qkgeom.store import VIEWS, open_store
from qkgeom.store.models import Base

DOC = Path(__file__).resolve().parents[1] / "docs" / "schema.md"
QUERIES = re.findall(r"```sql\n(.*?)```", DOC.read_text(), flags=re.S)


def test_doc_has_examples_and_documents_every_table_view_and_column():
    assert len(QUERIES) >= 5
    text = DOC.read_text()
    for name in VIEWS:
        assert f"`{name}`" in text, name
    for table in Base.metadata.sorted_tables:
        assert f"### `{table.name}`" in text, table.name
        section = text.split(f"### `{table.name}`", 1)[1].split("\n### ", 1)[0]
        for col in table.columns:
            assert f"`{col.name}`" in section, (table.name, col.name)


ARMS = ("none", "shrink")
WIDTH = {0: 32, 1: 48}  # each seed's n_embd (a factor of v_factors)
NAMES = list(METRICS)


def off(arm: str, seed: int) -> float:
    """Each trial's values are shifted by its own offset, so joins and groupings show."""
    return 10.0 * ARMS.index(arm) + seed


def planted(arm: str, seed: int, step: int, layer: int, head: int | None, metric: str):
    """The value make_record writes, plus the trial's offset (NaN: wk_target_pr of layer 1
    at the last step)."""
    if metric == "wk_target_pr" and step == 20 and layer == 1 and head is None:
        return None
    return (off(arm, seed) + step * 0.001 + layer + NAMES.index(metric) * 0.1
            + (0.0 if head is None else 0.01 * (head + 1)))


@pytest.fixture
def study(db_url):
    with open_store(db_url) as store:
        sid = store.ensure_sweep("study", {}, "v")
        for arm in ARMS:
            for seed in (0, 1):
                tid = store.ensure_trial(sid, f"d2-{arm}-s{seed}", {"n_embd": WIDTH[seed],
                                         "lr": 1e-3}, depth=2, init="gaussian", arm=arm,
                                         seed=seed, cell=f"e{WIDTH[seed]}")
                recs = [make_record(s, n_layer=2, n_head=2, max_steps=20) for s in (0, 10, 20)]
                for r in recs:
                    r.metrics = [(la, h, n, v + off(arm, seed)) for la, h, n, v in r.metrics]
                    r.val_loss = 2.6 + 0.01 * off(arm, seed)
                recs[-1].metrics = [m for m in recs[-1].metrics
                                    if m[:3] != (1, None, "wk_target_pr")]
                recs[-1].metrics.append((1, None, "wk_target_pr", math.nan))
                store.write_probes(tid, recs)
                if arm == "none":  # provenance of one attempt, two for seed 1
                    for attempt in range(1, seed + 2):
                        store.record_attempt(tid, dict(PROVENANCE, git_dirty=attempt > 1),
                                             attempt=attempt)
                status = "error" if (arm, seed) == ("shrink", 1) else "terminated"
                store.set_trial_status(tid, status, error="RuntimeError: x" if
                                       status == "error" else None)
                if status == "terminated":
                    store.set_trial_result(tid, test_loss=2.5 + 0.01 * off(arm, seed))
        store.write_pretrained("gpt2", "main", None, {}, [
            (0, None, "pr_q", 5.0), (0, None, "pr_k", 3.0), (1, None, "pr_q", 6.0),
            (1, None, "pr_k", 2.0)])
    return db_url


PROVENANCE = {"code_version": "0.1.0+h0123456789abcdef", "git_commit": "c0ffee" * 6 + "c0ff",
              "python": "3.11.7", "torch": "2.13.0+cpu", "ray": "2.60.0", "cuda": None,
              "host": "h", "device": "cpu", "details": {"platform": "Linux"}}
TRIALS = [(a, s) for a in ARMS for s in (0, 1)]
STEPS = (0, 10, 20)


def _n_rows(metric: str) -> int:
    return len(TRIALS) * len(STEPS) * 2 * (1 + (2 if METRICS[metric]["per_head"] else 0))


def _qk_erank_heads() -> list[tuple]:
    rows = [(f"d2-{a}-s{s}", la, h, planted(a, s, 20, la, h, "qk_erank"))
            for a, s in TRIALS for la in (0, 1) for h in (0, 1)]
    return sorted(rows, key=lambda r: r[3])[:10]


class _Any:
    """Any value but NULL (timestamps)."""


ANY = _Any()

# The rows every documented query must return on the fixture above, computed from the
# planted values (a query without an entry here fails: add its expected rows).
EXPECTED = {
    "q_exceeds_k": lambda: [("study", 2, la, 4, 0) for la in (0, 1)],  # pr_q < pr_k always
    "entropy_nats": lambda: [
        (a, st, st / 20, np.mean([planted(a, s, st, la, None, "entropy") for s in (0, 1)
                                  for la in (0, 1)]), 2) for a in ARMS for st in STEPS],
    "t.status IN ('error', 'interrupted')": lambda: [
        ("study", "d2-shrink-s1", "error", 0, None, ANY, "RuntimeError: x")],
    "FROM v_trajectories": lambda: [
        (2, "gaussian", st, st / 20, np.mean([planted("none", s, st, 1, None, "pr_k")
                                              for s in (0, 1)]), 2) for st in STEPS],
    "shrink_pr_wk": lambda: [
        (2, "gaussian", la, s, planted("shrink", s, 20, la, None, "pr_wk"),
         planted("none", s, 20, la, None, "pr_wk"), 10.0) for la in (0, 1) for s in (0, 1)],
    "p.val_loss": lambda: [(f"d2-{a}-s{s}", 2, "gaussian", a, s, 20, 2.6 + 0.01 * off(a, s))
                           for a, s in TRIALS if (a, s) != ("shrink", 1)],
    "AS qk_erank": _qk_erank_heads,
    "nan_values": lambda: sorted(
        [(m, 4 if m == "wk_target_pr" else 0, _n_rows(m)) for m in METRICS],
        key=lambda r: (-r[1], r[0])),
    "FROM v_pretrained": lambda: [("gpt2", "main", 0, 5.0, 3.0), ("gpt2", "main", 1, 6.0, 2.0)],
    "AVG(t.test_loss)": lambda: [  # terminated trials only: shrink seed 1 ended in error
        ("study", "none", 2, 2.5 + 0.01 * (off("none", 0) + off("none", 1)) / 2),
        ("study", "shrink", 1, 2.5 + 0.01 * off("shrink", 0))],
    "FROM trial_attempts": lambda: [
        (f"d2-none-s{s}", n, PROVENANCE["code_version"], PROVENANCE["git_commit"], n > 1,
         "3.11.7", "2.13.0+cpu", "2.60.0", None, "h", "cpu")
        for s in (0, 1) for n in range(1, s + 2)],
    "FROM v_factors": lambda: [  # terminated only: shrink seed 1 ended in error
        (32, 1e-3, "none", 1, 2.5 + 0.01 * off("none", 0)),
        (32, 1e-3, "shrink", 1, 2.5 + 0.01 * off("shrink", 0)),
        (48, 1e-3, "none", 1, 2.5 + 0.01 * off("none", 1))],
    "FROM metric_definitions": lambda: [(m, i["unit"], i["per_head"], i["doc"])
                                        for m, i in sorted(METRIC_DEFINITIONS.items())],
}


def _same(got, want) -> bool:
    if want is ANY:
        return got is not None
    if isinstance(want, bool):
        return bool(got) == want
    if isinstance(want, float):
        return got is not None and math.isclose(float(got), want, rel_tol=1e-9, abs_tol=1e-12)
    return got == want


@pytest.mark.parametrize("i", range(len(QUERIES)))
def test_doc_query_runs(study, i):
    with open_store(study, create=False, readonly=True) as store:
        df = store.sql(QUERIES[i].strip().rstrip(";"))
    keys = [k for k in EXPECTED if k in QUERIES[i]]
    assert len(keys) == 1, f"add this query's expected rows to EXPECTED: {QUERIES[i]}"
    want = EXPECTED[keys[0]]()
    got = df.rows()
    assert len(got) == len(want), (QUERIES[i], got)
    for g, w in zip(got, want):
        assert len(g) == len(w) and all(_same(a, b) for a, b in zip(g, w)), (g, w)
