"""Issue 44, item 5: the report's header names the code that trained the study (each
trial's latest attempt in ``trial_attempts``), counted by hand here."""

from __future__ import annotations

from qkgeom.report.render import code_rows
from qkgeom.store import open_store


def test_the_header_counts_each_trials_latest_attempt(db_url):
    with open_store(db_url) as store:
        sid = store.ensure_sweep("s", {}, "v")
        prov = {"code_version": "0.1.0+hA", "git_commit": "abcdef0123456789", "python": "3.11",
                "torch": "2.13", "ray": "2.60", "host": "vm"}
        for i in range(3):
            t = store.ensure_trial(sid, f"k{i}", {}, depth=1, init="gaussian", arm="none",
                                   seed=i)
            store.start_attempt(t, dict(prov, git_dirty=i == 1))
        # k2 ran again elsewhere, from an installed wheel with no commit: that one counts
        store.start_attempt(t, dict(prov, code_version="0.1.0+hB", git_commit=None,
                                    host="node2", cuda="12.4"))
        rows = {r["setting"]: r["this study"] for r in code_rows(store, "s")}
    assert rows == {
        "code (qkgeom @ git commit)": "0.1.0+hA @ abcdef012345 (1 trial); "
                                      "0.1.0+hA @ abcdef012345 (uncommitted changes) (1 trial); "
                                      "0.1.0+hB (no git checkout) (1 trial)",
        "Python, torch, Ray, CUDA": "python 3.11, torch 2.13, ray 2.60, cuda - (2 trials); "
                                    "python 3.11, torch 2.13, ray 2.60, cuda 12.4 (1 trial)",
        "hosts": "node2 (1 trial); vm (2 trials)"}


def test_a_sweep_without_attempts_has_no_code_rows(sqlite_url):
    with open_store(sqlite_url) as store:
        sid = store.ensure_sweep("old", {}, "v")
        store.ensure_trial(sid, "k", {}, depth=1, init="gaussian", arm="none", seed=0)
        assert code_rows(store, "old") == []
