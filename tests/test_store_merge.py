"""``qkgeom db merge`` driven as a user runs it: sweeps copied between SQLite and PostgreSQL
databases with every row of their trials (compared row by row with the source, ids aside),
the source never changed, and every refusal (a name clash, a running trial, the same
database twice, a bad --rename) leaving the target as it was."""

from __future__ import annotations

import math

import pytest
from helpers import invoke, make_record

TABLES = ["trials", "trial_attempts", "probes", "probe_metrics", "train_steps", "checkpoints"]


def fill(url: str, name: str, *, n_trials: int = 2, running: bool = False) -> None:
    """A sweep of ``n_trials`` finished trials with probes, history, attempts, a checkpoint,
    a NaN, an infinity and a baseline reference: every kind of row a merge must carry."""
    from qkgeom.store import open_store

    with open_store(url) as store:
        sid = store.ensure_sweep(name, {"name": name, "grid": {"seeds": [0, 1]}}, "0.1.0+test",
                                 heartbeat_s=15.0)
        for i in range(n_trials):
            tid = store.ensure_trial(sid, f"d2-gaussian-none-s{i}", {"seed": i, "lr": 1e-3},
                                     depth=2, init="gaussian", arm="none", seed=i,
                                     cell="e48" if i % 2 == 0 else "e64")
            store.set_trial_status(tid, "running", bump_attempts=True)
            store.record_attempt(tid, {"code_version": "0.1.0+test", "host": "h",
                                       "details": {"threads": 1}})
            recs = [make_record(s, n_layer=2, n_head=2, history=2) for s in (0, 5, 10)]
            recs[1].metrics.append((0, None, "qk_erank", math.inf))
            recs[2].metrics.append((1, None, "qk_erank", math.nan))
            store.write_probes(tid, recs)
            store.add_checkpoint(tid, 10, f"/runs/{name}/t{i}/ckpt", kind="snapshot")
            store.set_baseline_ref(tid, {"trial_key": "base", "attempt": 1})
            store.set_trial_result(tid, test_loss=1.5 + i)
            if not (running and i == 0):
                store.set_trial_status(tid, "terminated")


def rows(url: str, sweep: str) -> dict[str, list[tuple]]:
    """Every row of the sweep, per table, with ids replaced by trial keys (what a merge
    must keep), in a fixed order; NaN as None (stored NULL), datetimes to the second."""
    from qkgeom.store import open_store

    out: dict[str, list[tuple]] = {}
    with open_store(url, create=False, readonly=True) as store:
        keys = {r["id"]: r["trial_key"] for r in store.trials(sweep).iter_rows(named=True)}
        from sqlalchemy import select

        from qkgeom.store.models import TRIAL_TABLES, Sweep, Trial

        def norm(v):
            if hasattr(v, "isoformat"):
                v = v.replace(tzinfo=None, microsecond=0).isoformat()
            return None if isinstance(v, float) and v != v else v

        with store.engine.connect() as conn:
            s = Sweep.__table__
            sw = conn.execute(select(s).where(s.c.name == sweep)).one()._mapping
            out["sweeps"] = [tuple(norm(v) for k, v in sw.items() if k not in ("id", "name"))]
            t = Trial.__table__
            out["trials"] = sorted(
                tuple(norm(v) for k, v in r._mapping.items() if k not in ("id", "sweep_id"))
                for r in conn.execute(select(t).where(t.c.id.in_(list(keys)))))
            for tab in TRIAL_TABLES:
                got = conn.execute(select(tab).where(tab.c.trial_id.in_(list(keys)))).all()
                out[tab.name] = sorted(
                    tuple(keys[v] if k == "trial_id" else norm(v)
                          for k, v in r._mapping.items()) for r in got)
    return out


def counts(url: str) -> dict[str, int]:
    from sqlalchemy import func, select

    from qkgeom.store import open_store
    from qkgeom.store.models import Base

    with open_store(url, create=False, readonly=True) as store, store.engine.connect() as c:
        return {n: c.execute(select(func.count()).select_from(Base.metadata.tables[n]))
                .scalar_one() for n in ["sweeps", *TABLES]}


@pytest.mark.parametrize("direction", ["sqlite->postgresql", "postgresql->sqlite",
                                       "sqlite->sqlite"])
def test_merge_copies_every_row_and_changes_no_source_row(direction, sqlite_url, tmp_path,
                                                          request):
    other = f"sqlite:///{tmp_path / 'other.db'}"
    pg = request.getfixturevalue("pg_url") if "postgresql" in direction else None
    src, dst = {"sqlite->postgresql": (sqlite_url, pg), "postgresql->sqlite": (pg, sqlite_url),
                "sqlite->sqlite": (sqlite_url, other)}[direction]
    fill(src, "e96", n_trials=3)
    fill(src, "e128", n_trials=2)
    fill(dst, "cpu", n_trials=2)  # already in the target: must stay as it is
    before_src = {n: rows(src, n) for n in ("e96", "e128")}
    before_dst = rows(dst, "cpu")
    r = invoke("db", "merge", "--from", src, "--db", dst)
    assert r.exit_code == 0, r.output
    assert "copied sweep e96: 3 trials" in r.output and "copied sweep e128: 2 trials" in r.output
    for n in ("e96", "e128"):
        assert rows(dst, n) == before_src[n]  # every row, ids aside
        assert rows(src, n) == before_src[n]  # the source is unchanged
    assert rows(dst, "cpu") == before_dst
    # the merged sweeps are read like any other
    r = invoke("query", "--db", dst, "--format", "csv",
               "select cell, count(*) as n from v_factors group by cell order by cell")
    assert r.exit_code == 0, r.output
    assert r.output.split() == ["cell,n", "e48,4", "e64,3"]  # cpu 1+1, e96 2+1, e128 1+1


def test_a_clash_a_running_trial_and_bad_arguments_are_refused_and_nothing_is_written(
        sqlite_url, tmp_path):
    src = f"sqlite:///{tmp_path / 'src.db'}"
    fill(src, "cpu")
    fill(src, "busy", running=True)
    fill(sqlite_url, "cpu")
    before = counts(sqlite_url), rows(sqlite_url, "cpu")
    cases = [
        ((), "sweep 'cpu' already exists in"),
        (("--sweep", "cpu"), "Give --rename cpu=cpu-2"),
        (("--sweep", "busy"), "sweep 'busy' has 1 trial(s) still running"),
        (("--sweep", "nope"), "no sweep named 'nope' in"),
        (("--sweep", "cpu", "--rename", "cpu"), "give OLD=NEW"),
        (("--sweep", "cpu", "--rename", "other=x"), "'other' is not among the sweeps"),
        (("--sweep", "cpu", "--sweep", "busy", "--rename", "cpu=busy", "--rename", "busy=x"),
         "has 1 trial(s) still running"),
    ]
    for extra, message in cases:
        r = invoke("db", "merge", "--from", src, "--db", sqlite_url, *extra)
        assert r.exit_code != 0 and message in r.output, (extra, r.output)
        assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1
        assert (counts(sqlite_url), rows(sqlite_url, "cpu")) == before
    r = invoke("db", "merge", "--from", src, "--db", src)
    assert r.exit_code != 0 and "the same database" in r.output
    r = invoke("db", "merge", "--from", f"sqlite:///{tmp_path / 'none.db'}", "--db", sqlite_url)
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert not (tmp_path / "none.db").exists()  # a missing source is not created
    # the way out the message names works, and the copy is the source's
    r = invoke("db", "merge", "--from", src, "--db", sqlite_url, "--sweep", "cpu",
               "--rename", "cpu=cpu-2")
    assert r.exit_code == 0, r.output
    assert "copied sweep cpu -> cpu-2: 2 trials" in r.output
    assert rows(sqlite_url, "cpu-2") == rows(src, "cpu")
    assert rows(sqlite_url, "cpu") == before[1]


def test_a_merged_sweep_gives_the_statistics_of_its_source(tmp_path):
    """The statistics read the copy exactly as they read the original."""
    import json

    src, dst = (f"sqlite:///{tmp_path / n}" for n in ("a.db", "b.db"))
    fill(src, "s", n_trials=2)
    assert invoke("db", "merge", "--from", src, "--db", dst).exit_code == 0
    out = []
    for url in (src, dst):
        r = invoke("stats", "sign-test", "--db", url, "--sweep", "s", "--where", "cell=e48",
                   "--format", "json")
        assert r.exit_code == 0, r.output
        d = json.loads(r.output)
        out.append({k: v for k, v in d.items() if k not in ("db",)})
    assert out[0] == out[1]
