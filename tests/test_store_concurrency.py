"""Two processes writing different trials into one new SQLite file at the same time."""

from __future__ import annotations

import multiprocessing as mp

from conftest_store import writer_process

from qkgeom.store import open_store

N_PROBES = 300  # per process; 2 layers x (9 per-head metrics x 3 + 1) = 56 values each


def test_two_processes_one_sqlite_file(tmp_path):
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    ctx = mp.get_context("spawn")  # no fork of the test process's state
    q = ctx.Queue()
    procs = [ctx.Process(target=writer_process, args=(url, key, N_PROBES, q))
             for key in ("left", "right")]
    for p in procs:
        p.start()  # both open the brand-new file: creation itself races too
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    errors = [(k, e) for k, _, e in results if e]
    assert not errors, errors
    written = {k: n for k, n, _ in results}
    with open_store(url) as store:
        df = store.sql("SELECT t.trial_key, COUNT(*) AS n, COUNT(DISTINCT m.step) AS steps "
                       "FROM probe_metrics m JOIN trials t ON t.id = m.trial_id "
                       "GROUP BY t.trial_key ORDER BY t.trial_key")
        assert df.rows() == [("left", written["left"], N_PROBES),
                             ("right", written["right"], N_PROBES)]
        assert int(store.sql("SELECT COUNT(*) FROM probes").item()) == 2 * N_PROBES
        assert store.trials()["status"].to_list() == ["terminated", "terminated"]
        assert int(store.sql("SELECT COUNT(*) FROM sweeps").item()) == 1
