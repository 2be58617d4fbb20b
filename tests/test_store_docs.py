"""Every ``sql`` block of docs/schema.md runs on both backends and returns rows."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from conftest_store import make_record

from qkgeom.store import VIEWS, open_store
from qkgeom.store.models import Base

pytest_plugins = ["store_fixtures"]  # db_url

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


@pytest.fixture
def study(db_url):
    with open_store(db_url) as store:
        sid = store.ensure_sweep("study", {}, "v")
        for arm in ("none", "shrink"):
            for seed in (0, 1):
                tid = store.ensure_trial(sid, f"d2-{arm}-s{seed}", {}, depth=2,
                                         init="gaussian", arm=arm, seed=seed)
                recs = [make_record(s, n_layer=2, n_head=2, max_steps=20) for s in (0, 10, 20)]
                recs[-1].metrics.append((1, None, "wk_target_pr", math.nan))
                store.write_probes(tid, recs)
                status = "error" if (arm, seed) == ("shrink", 1) else "terminated"
                store.set_trial_status(tid, status, error="RuntimeError: x" if
                                       status == "error" else None)
        store.write_pretrained("gpt2", "main", None, {}, [
            (0, None, "pr_q", 5.0), (0, None, "pr_k", 3.0), (1, None, "pr_q", 6.0),
            (1, None, "pr_k", 2.0)])
    return db_url


@pytest.mark.parametrize("i", range(len(QUERIES)))
def test_doc_query_runs(study, i):
    with open_store(study, create=False, readonly=True) as store:
        df = store.sql(QUERIES[i].strip().rstrip(";"))
    assert df.height > 0, QUERIES[i]
