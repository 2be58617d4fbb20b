"""What a user watches: ``qkgeom status`` (table and ``--json``) on trials in every state,
and the ``qkgeom train`` progress line."""

from __future__ import annotations

import json
import math
import re

from click.testing import CliRunner

from qkgeom.cli import main
from qkgeom.plan.pairing import baseline_rows
from qkgeom.records import ProbeRecord

ERROR_TEXT = 'Traceback (most recent call last):\n  File "x.py"\nRuntimeError: out of memory'
RETRY_TEXT = "Traceback ...\nqkgeom.train.InjectedFailure: fail_at_step=5: injected test failure"
# trial -> (status, attempts, probe steps with their val_loss, host, device, error)
PLANTED = {
    "d2-gaussian-none-s0": ("terminated", 1, {0: 3.5, 20: 2.75, 40: 2.25}, "h1", "cpu", None),
    "d2-gaussian-none-s1": ("error", 3, {0: 3.5, 20: 2.5}, "h2", "cuda:0", ERROR_TEXT),
    # failed once, waiting for its retry: pending, with the failure's text
    "d2-gaussian-shrink-s0": ("pending", 1, {0: math.nan}, "h1", "cpu", RETRY_TEXT),
    "d2-tied-none-s0": ("pending", 0, {}, None, None, None),
    "d2-tied-none-s1": ("running", 1, {0: 3.25}, "h3", "cpu", None),
}


def planted_db(tmp_path) -> str:
    from qkgeom.store import open_store

    url = f"sqlite:///{tmp_path / 's.db'}"
    with open_store(url) as store:
        sid = store.ensure_sweep("st", {}, "v")
        for key, (status, attempts, probes, host, device, error) in PLANTED.items():
            depth, init, arm, seed = key.split("-")
            tid = store.ensure_trial(sid, key, {"max_steps": 40}, depth=2, init=init, arm=arm,
                                     seed=int(seed[1:]), status="pending")
            store.write_probes(tid, [ProbeRecord(
                step=s, progress=s / 40, tokens=s, train_loss=math.nan, val_loss=v, lr=1e-3,
                tokens_per_s=0.0, metrics=[(0, None, "pr_q", 1.0)]) for s, v in probes.items()])
            for _ in range(attempts):
                store.set_trial_status(tid, "running", bump_attempts=True, host=host,
                                       device=device)
            store.set_trial_status(tid, status, error=error)
    return url


def test_status_json_for_every_state(tmp_path):
    url = planted_db(tmp_path)
    r = CliRunner().invoke(main, ["status", "--db", url, "--name", "st", "--json"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    rows = {x["trial"]: x for x in json.loads(r.output)}
    assert set(rows) == set(PLANTED)
    for key, (status, attempts, probes, host, device, error) in PLANTED.items():
        last = max(probes) if probes else None
        val = probes.get(last) if probes else None
        beat = rows[key].pop("heartbeat_at")  # when it last went running, if it did
        assert (beat is None) == (attempts == 0), key
        assert rows[key] == {
            "trial": key, "status": status, "attempts": attempts, "step": last,
            "max_steps": 40,
            "val_loss": None if val is None or math.isnan(val) else val,
            "snapshots": 0, "test_loss": None,  # none planted
            "host": host or "", "device": device or "",
            "error": error.splitlines()[-1] if error else "",
            # no heartbeat interval recorded: nothing is judged stale (tests/test_lifecycle.py)
            "stale": False, "no_heartbeat_s": None, "note": "",
            "provenance": None}, key  # planted without attempt rows


def test_sweep_side_reads_on_both_backends(store):
    """Store.last_probes / snapshot_counts / pairing.baseline_rows against hand-planted rows:
    one sweep's reads never see another sweep's trials, NaN comes back as None, head-level
    rows and resume checkpoints are not counted."""
    nan = math.nan
    ids = {}
    for sweep in ("a", "b"):
        sid = store.ensure_sweep(sweep, {}, "v")
        for seed in (0, 1):
            ids[sweep, seed] = store.ensure_trial(sid, f"k{seed}", {"max_steps": 40}, depth=2,
                                                 init="gaussian", arm="none", seed=seed)
    a0, a1, b0 = ids["a", 0], ids["a", 1], ids["b", 0]
    probes = {a0: {0: 3.5, 20: 2.75, 40: nan}, a1: {0: 3.25}, b0: {0: 9.0, 60: 8.0}}
    for tid, by_step in probes.items():
        store.write_probes(tid, [ProbeRecord(
            step=s, progress=s / 40, tokens=s, train_loss=nan, val_loss=v, lr=1e-3,
            tokens_per_s=0.0,
            metrics=[(0, None, "pr_wk", 10.0 + s), (1, None, "pr_wk", 20.0 + s),
                     (1, 0, "pr_wk", 99.0), (0, None, "pr_k", nan)])
            for s, v in by_step.items()])
    for step in (0, 20):
        store.add_checkpoint(a0, step, f"/snap/{step}", kind="snapshot")
    store.add_checkpoint(a0, 20, "/resume/20", kind="resume")
    store.add_checkpoint(b0, 0, "/snap/b0", kind="snapshot")

    sid_a, sid_b = store.require_sweep("a"), store.require_sweep("b")
    assert store.last_probes(sid_a) == {a0: (40, None), a1: (0, 3.25)}
    assert store.last_probes(sid_b) == {b0: (60, 8.0)}
    assert store.snapshot_counts(sid_a) == {a0: 2}
    assert store.snapshot_counts(sid_b) == {b0: 1}
    assert baseline_rows(store, a0, "pr_wk") == [(0, 0, 10.0), (0, 1, 20.0), (20, 0, 30.0),
                                                (20, 1, 40.0), (40, 0, 50.0), (40, 1, 60.0)]
    assert baseline_rows(store, b0, "pr_wk") == [(0, 0, 10.0), (0, 1, 20.0), (60, 0, 70.0),
                                                (60, 1, 80.0)]
    assert baseline_rows(store, a1, "pr_k") == [(0, 0, None)]
    assert baseline_rows(store, a1 + b0 + 100, "pr_wk") == []


def test_status_table_shows_errors_of_failed_and_waiting_trials(tmp_path):
    url = planted_db(tmp_path)
    r = CliRunner().invoke(main, ["status", "--db", url], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    lines = {ln.split()[0]: ln for ln in r.output.splitlines()[1:-1]}
    assert lines["d2-gaussian-none-s0"].split()[1:5] == ["terminated", "1", "40/40", "2.2500"]
    assert lines["d2-gaussian-none-s1"].split()[1:5] == ["error", "3", "20/40", "2.5000"]
    assert lines["d2-gaussian-none-s1"].endswith("RuntimeError: out of memory")
    assert lines["d2-gaussian-shrink-s0"].split()[1:5] == ["pending", "1", "0/40", "-"]
    assert lines["d2-gaussian-shrink-s0"].endswith("injected test failure")
    assert lines["d2-tied-none-s0"].split()[1:4] == ["pending", "0", "-"]
    assert r.output.splitlines()[-1] == "1 error, 2 pending, 1 running, 1 terminated"


def test_train_progress_line(wikitext_dir, tmp_path):
    out = tmp_path / "run"
    r = CliRunner().invoke(main, ["train", "--preset", "smoke", "--data", str(wikitext_dir),
                                  "--out", str(out)], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    err = r.stderr
    assert err.startswith(f"qkgeom train: preset smoke, 2 layers, n_embd 32, init gaussian, "
                          f"arm none, seed 0 -> {out}\n")
    updates = re.findall(r"\r\[(#*) *\] (\d+)/40 loss ([\d.]+)(?: val ([\d.]+))? "
                         r"([\d,]+) tok/s ETA +(\d+)s ", err)
    assert updates, err
    steps = [int(u[1]) for u in updates]
    assert steps == sorted(set(steps)) and steps[0] >= 1 and steps[-1] == 40
    for bar, step, loss, *_ in updates:
        assert len(bar) == int(28 * int(step) / 40)  # the bar is the share of steps done
        assert 0 < float(loss) < 10
    bar, _, _, val, tok_s, eta = updates[-1]
    assert err.endswith(" \n")  # the finished line ends the display
    # the last update shows the final validation loss and the run's throughput, the same
    # numbers the run directory records
    probes = [json.loads(x) for x in (out / "probes.jsonl").read_text().splitlines()]
    result = json.loads((out / "result.json").read_text())
    assert val == f"{probes[-1]['val_loss']:.3f}" and probes[-1]["step"] == 40
    assert tok_s == f"{result['tokens_per_s']:,.0f}" and eta == "0"
    # --quiet: no progress display
    r = CliRunner().invoke(main, ["train", "--preset", "smoke", "--data", str(wikitext_dir),
                                  "--out", str(tmp_path / "q"), "--quiet"],
                           catch_exceptions=False)
    assert r.exit_code == 0 and "\r[" not in r.stderr and "tok/s ETA" not in r.stderr
