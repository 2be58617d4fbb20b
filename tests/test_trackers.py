"""Opt-in trackers (issue 30, 44): a real smoke sweep with ``--logger tensorboard --logger
mlflow --logger wandb`` (W&B offline); the values are read back with the trackers' own
readers (tensorboard's event accumulator, the MLflow client) and, for W&B, from its
offline run files by the reader below (the files are LevelDB-log framed protobuf
``Record`` messages; wandb 0.31 has no Python reader of its own), and compared with the
database, metric by metric."""

from __future__ import annotations

import json

import pytest
from sweep_fixtures import run_cli

from qkgeom.store import open_store
from qkgeom.sweeps.trackers import flat_result

pytestmark = pytest.mark.ray


def wandb_history(path) -> tuple[str, list[dict[str, float]], dict[str, float]]:
    """``(run name, history rows, summary)`` of one W&B offline run file
    (``run-*.wandb``): a 7-byte header, then 32 KiB blocks of records, each a 7-byte
    header (crc32, little-endian length, type: 1 full, 2 first, 3 middle, 4 last) and a
    chunk of one serialised ``wandb_internal_pb2.Record``."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, out, buf = 32768, 7, [], b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:  # block padding
            pos += room
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            buf = chunk
        elif kind == 3:
            buf += chunk
        elif kind == 4:
            out.append(buf + chunk)
    name, rows, summary = "", [], {}

    def key(item) -> str:
        return item.key or "/".join(item.nested_key)

    for raw in out:
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            name = rec.run.display_name
        elif kind == "history":
            rows.append({key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            summary.update({key(i): json.loads(i.value_json) for i in rec.summary.update})
    return name, rows, summary


def test_flat_result_names_every_metric_and_keeps_step_zero():
    rec = {"step": 0, "val_loss": 3.5, "train_loss": None, "tokens_per_s": 10.0,
           "metrics": [[0, None, "pr_q", 2.5], [1, 3, "entropy", 0.25]]}
    got = flat_result({"step": 0, "record": json.dumps(rec), "training_iteration": 1})
    assert got == {"val_loss": 3.5, "tokens_per_s": 10.0, "pr_q/layer0": 2.5,
                   "entropy/layer1/head3": 0.25, "timesteps_total": 0,
                   "training_iteration": 0}
    assert flat_result({"step": 40, "record": "", "test_loss": 2.0})["test_loss"] == 2.0
    assert flat_result({"step": 40, "record": ""}) is None  # nothing to log


def test_direct_writes_with_a_logger_is_refused(scratch):  # noqa: F811
    p = run_cli(["sweep", "--preset", "smoke", "--db", "postgresql://u@h/db",
                 "--direct-writes", "--logger", "tensorboard"], scratch, check=False)
    assert p.returncode != 0 and "--logger needs the driver" in p.stderr, p.stderr
    assert not list(scratch.glob("*.db"))


def test_tensorboard_mlflow_and_wandb_get_the_databases_values(scratch, wikitext_dir,  # noqa: F811
                                                               monkeypatch):
    for var in ("WANDB_MODE", "WANDB_DIR", "WANDB_API_KEY"):  # the defaults: offline, cwd
        monkeypatch.delenv(var, raising=False)
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    db = f"sqlite:///{scratch / 't.db'}"
    run_cli(["sweep", "--preset", "smoke", "--set", "max_steps=40", "--set", "grid.seeds=[0]",
             "--set", "grid.depths=[1]", "--set", "grid.inits=[gaussian]",
             "--set", "interventions.arms=[hold]", "--set", "interventions.seeds=[0]",
             "--set", "interventions.depth=1", "--db", db, "--data", str(wikitext_dir),
             "--storage", str(scratch / "rr"), "--logger", "tensorboard", "--logger", "mlflow",
             "--logger", "wandb", "--progress-every", "60"], scratch,
            env={"WANDB_SILENT": "true"})
    # W&B: offline by default, under the working directory, one run per trial
    wb = {}
    for f in (scratch / "wandb").glob("offline-run-*/run-*.wandb"):
        name, rows, summary = wandb_history(f)
        wb[name.split("_")[0]] = ({r["_step"]: r for r in rows}, summary)
    client = MlflowClient(f"sqlite:///{scratch / 'mlflow.db'}")
    exp = client.get_experiment_by_name("qkgeom-smoke")
    runs = {r.data.tags.get("trial_name"): r for r in client.search_runs([exp.experiment_id])}
    with open_store(db) as store:
        trials = store.trials("smoke")
        assert sorted(runs) == sorted(trials["trial_key"].to_list())
        assert sorted(wb) == sorted(trials["trial_key"].to_list()), sorted(wb)
        for tid, key in zip(trials["id"], trials["trial_key"]):
            want = {}
            for p in store.read_probes(tid):
                want[("val_loss", p.step)] = p.val_loss
                for layer, head, name, value in p.metrics:
                    tag = f"{name}/layer{layer}" + ("" if head is None else f"/head{head}")
                    want[(tag, p.step)] = value
            assert len(want) > 60  # 3 probes x (1 layer + 4 heads) x metrics
            (tb_dir,) = (scratch / "rr" / "qkgeom-smoke").glob(f"{key}_*")
            ea = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
            ea.Reload()
            run = runs[key]
            for (tag, step), v in want.items():
                tb = {e.step: e.value for e in ea.Scalars(f"ray/tune/{tag}")}
                ml = {m.step: m.value for m in client.get_metric_history(run.info.run_id, tag)}
                assert tb[step] == pytest.approx(v, rel=1e-6, abs=1e-6), (key, tag, step)
                assert ml[step] == pytest.approx(v, rel=1e-12, abs=1e-12), (key, tag, step)
                assert wb[key][0][step][tag] == pytest.approx(v, rel=1e-12, abs=1e-12), \
                    (key, tag, step)
            test_loss = trials.filter(trials["id"] == tid)["test_loss"][0]
            assert run.data.metrics["test_loss"] == pytest.approx(test_loss, rel=1e-12)
            assert wb[key][1]["test_loss"] == pytest.approx(test_loss, rel=1e-12)
