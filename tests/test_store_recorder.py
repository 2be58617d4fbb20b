"""qkgeom.store.recorder.TrialRecorder, the one writer ``qkgeom train --db`` and the sweep's
DbWriter record a running trial through: an attempt with its provenance, reports (probe
rows, checkpoint or snapshot rows, heartbeats), pruned checkpoints and the endings. SQLite
and PostgreSQL. The callers' own paths are in tests/test_train.py and tests/test_tune.py."""

from __future__ import annotations

from helpers import make_record

from qkgeom.store.recorder import TrialRecorder


def new_trial(store, key: str = "d1-gaussian-none-s0") -> tuple[int, int]:
    sid = store.ensure_sweep("rec", {"name": "rec"}, "v")
    tid = store.ensure_trial(sid, key, {"max_steps": 20}, depth=1, init="gaussian",
                             arm="none", seed=0)
    return sid, tid


def trial_row(store, tid: int) -> dict:
    rows = store.trials("rec").filter(id=tid).to_dicts()
    assert len(rows) == 1
    return rows[0]


def test_an_attempt_then_reports_store_probes_checkpoints_and_a_heartbeat(store):
    sid, tid = new_trial(store)
    rec = TrialRecorder(store, sid)
    assert rec.started(tid, {"code_version": "abc", "python": "3.11"}) == 1
    row = trial_row(store, tid)
    assert (row["status"], row["attempts"]) == ("running", 1)
    started_beat = row["heartbeat_at"]
    rec.placed(tid, host="h1", device="cpu", provenance={"host": "h1", "device": "cpu"})
    att = store.attempts("rec").to_dicts()
    assert [(a["attempt"], a["code_version"], a["host"], a["device"]) for a in att] == \
        [(1, "abc", "h1", "cpu")]

    rec.reported(tid, make_record(0, n_layer=1), saved="/ck/step_0000000")
    rec.reported(tid, make_record(10, n_layer=1))  # no checkpoint at this step
    # a report whose rows the worker wrote, with a snapshot: no probe, a snapshot row
    rec.reported(tid, None, step=20, saved="/snap/step_0000020", kind="snapshot")
    rec.reported(tid, None, step=None, saved="/nowhere")  # no step: no row
    assert [r.step for r in store.read_probes(tid)] == [0, 10]
    assert sorted(store.read_probes(tid)[1].metrics, key=str) == \
        sorted(make_record(10, n_layer=1).metrics, key=str)
    assert store.trial_checkpoints("rec", "d1-gaussian-none-s0") == [
        (0, "resume", "/ck/step_0000000"), (20, "snapshot", "/snap/step_0000020")]
    assert trial_row(store, tid)["heartbeat_at"] > started_beat

    rec.checkpoint(tid, 10, "/ck/step_0000010")
    rec.dropped_checkpoint(tid, 10, "/elsewhere")  # a newer save of the step keeps its row
    rec.dropped_checkpoint(tid, 0, "/ck/step_0000000")
    rec.dropped_checkpoint(tid, None, "/ck/step_0000010")  # no step: nothing to forget
    assert store.trial_checkpoints("rec", "d1-gaussian-none-s0") == [
        (10, "resume", "/ck/step_0000010"), (20, "snapshot", "/snap/step_0000020")]

    rec.result(tid, test_loss=1.25)
    rec.finished(tid, host="h2", device="cuda")
    row = trial_row(store, tid)
    assert (row["status"], row["test_loss"], row["host"], row["device"]) == \
        ("terminated", 1.25, "h2", "cuda")


def test_endings_retry_fail_and_interrupt(store):
    sid, tid = new_trial(store)
    rec = TrialRecorder(store, sid)
    rec.started(tid)
    rec.retrying(tid, "boom once")
    assert (trial_row(store, tid)["status"], trial_row(store, tid)["error"]) == \
        ("pending", "boom once")
    rec.started(tid)
    rec.failed(tid, "boom twice")
    row = trial_row(store, tid)
    assert (row["status"], row["attempts"], row["error"]) == ("error", 2, "boom twice")
    rec.started(tid)
    rec.interrupted(tid, "KeyboardInterrupt: ")
    assert trial_row(store, tid)["status"] == "interrupted"
    assert [a["attempt"] for a in store.attempts("rec").to_dicts()] == [1, 2, 3]


def test_a_heartbeat_of_all_running_trials_leaves_the_others(store):
    sid, a = new_trial(store, "a")
    _, b = new_trial(store, "b")
    rec = TrialRecorder(store, sid)
    rec.started(a)  # b stays pending
    rec.alive()
    assert trial_row(store, a)["heartbeat_at"] is not None
    assert trial_row(store, b)["heartbeat_at"] is None
