"""Training: determinism, stop-and-restore equality, learning, data handling, CLI errors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from click.testing import CliRunner

from qkgeom.cli import main
from qkgeom.config import ConfigError, TrialConfig, preset
from qkgeom.engine.data import DataError, load_corpus, unigram_entropy
from qkgeom.engine.train import InjectedFailure, lr_at, train, training


def collect(cfg, **kw):
    recs = []
    res = train(cfg, lambda r, c: recs.append((r, c)), **kw)
    return res, recs


def metric_map(rec):
    return {(li, h, n): v for li, h, n, v in rec.metrics}


def assert_same_metrics(a, b):
    ma, mb = metric_map(a), metric_map(b)
    assert ma.keys() == mb.keys()
    for k in ma:
        assert ma[k] == pytest.approx(mb[k], rel=1e-9, abs=1e-12, nan_ok=True), k
    assert a.val_loss == pytest.approx(b.val_loss, rel=1e-9)
    assert a.train_loss == pytest.approx(b.train_loss, rel=1e-9, nan_ok=True)


def test_probes_cover_every_layer_head_and_metric(tiny_cfg):
    res, recs = collect(tiny_cfg)
    assert [r.step for r, _ in recs] == [0, 20, 40]
    names = {"pr_q", "pr_k", "pr_wq", "pr_wk", "qk_pr", "qk_erank", "token_erank", "entropy",
             "entropy_norm"}
    for r, _ in recs:
        keys = metric_map(r)
        for li in range(tiny_cfg.n_layer):
            for n in names:
                assert (li, None, n) in keys
                for h in range(tiny_cfg.n_head):
                    assert (li, h, n) in keys
        assert all(math.isfinite(v) for v in keys.values())
    assert math.isnan(recs[0][0].train_loss) and math.isfinite(recs[1][0].train_loss)
    assert recs[-1][0].val_loss < recs[0][0].val_loss
    assert res.steps == 40 and "wiki.valid.raw" in res.data_note


def test_same_seed_same_numbers_other_seed_differs(tiny_cfg):
    _, a = collect(tiny_cfg)
    _, b = collect(tiny_cfg)
    for (ra, _), (rb, _) in zip(a, b):
        assert_same_metrics(ra, rb)
    _, c = collect(tiny_cfg.with_overrides({"seed": 1}))
    assert metric_map(c[-1][0])[(0, None, "pr_k")] != metric_map(a[-1][0])[(0, None, "pr_k")]


def test_training_steps_one_at_a_time_and_returns_what_train_returns(tiny_cfg):
    res, recs = collect(tiny_cfg)
    got = []
    gen = training(tiny_cfg, lambda r, c: got.append(r))
    steps = []
    with pytest.raises(StopIteration) as done:
        while True:
            steps.append(next(gen))
            # a probe is reported before its step is yielded, never after
            assert [r.step for r in got] == [0] + [s for s in (20, 40) if s <= steps[-1]]
    assert steps == list(range(1, tiny_cfg.max_steps + 1))
    assert done.value.value.test_loss == pytest.approx(res.test_loss, rel=1e-9)
    for a, (b, _) in zip(got, recs):
        assert_same_metrics(a, b)


@pytest.mark.parametrize("arm", ["none", "shrink"])
def test_stop_and_restore_gives_the_uninterrupted_metrics(tiny_cfg, tmp_path, arm):
    cfg = tiny_cfg.with_overrides({"arm": arm, "max_steps": 60, "probe_every": 20})
    _, full = collect(cfg)
    # the same run killed at step 30 (after the step-20 checkpoint), then restored
    crashing = cfg.with_overrides({"fail_at_step": 30})
    got = []
    with pytest.raises(InjectedFailure):
        train(crashing, lambda r, c: got.append((r, c)), checkpoint_dir=tmp_path)
    ckpt = got[-1][1]
    assert ckpt is not None and ckpt.endswith("step_0000020")
    _, rest = collect(crashing, resume_from=ckpt)
    resumed = got + rest
    assert [r.step for r, _ in resumed] == [r.step for r, _ in full] == [0, 20, 40, 60]
    for (ra, _), (rb, _) in zip(full, resumed):
        assert_same_metrics(ra, rb)


def test_training_beats_unigram_entropy(wikitext_dir):
    cfg = preset("smoke").with_overrides(
        {"dataset": str(wikitext_dir), "max_steps": 150, "n_embd": 48, "block_size": 64,
         "batch_size": 16, "probe_every": 150, "eval_every": 150}
    )
    res, _ = collect(cfg)
    assert res.test_loss < res.unigram_entropy - 0.3, (res.test_loss, res.unigram_entropy)


def test_warmup_as_a_fraction_of_training():
    cfg = TrialConfig(lr=1e-3, min_lr=1e-4, warmup_frac=0.04, warmup_steps=999, max_steps=1500)
    assert cfg.warmup == 60  # the fraction wins over warmup_steps
    assert lr_at(cfg, 59) == pytest.approx(1e-3 * 60 / 61)
    assert lr_at(cfg, 60) == pytest.approx(1e-3)
    # cosine from step 60 to 1500: halfway (step 780) is the midpoint of lr and floor
    assert lr_at(cfg, 780) == pytest.approx(5.5e-4)
    assert TrialConfig(warmup_steps=7).warmup == 7
    with pytest.raises(ValueError, match="warmup_frac"):
        TrialConfig(warmup_frac=1.0)


def test_lr_schedule_warmup_then_cosine():
    cfg = TrialConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    assert lr_at(cfg, 0) < lr_at(cfg, 5) < lr_at(cfg, 9) <= 1e-3
    assert lr_at(cfg, 10) == pytest.approx(1e-3)
    assert lr_at(cfg, 60) == pytest.approx(5.5e-4)
    assert lr_at(cfg, 110) == pytest.approx(1e-4)


# ------------------------------------------------------------------------- data
def test_corpus_from_valid_and_test_only(corpus, wikitext_dir):
    raw = (wikitext_dir / "wiki.valid.raw").read_text(encoding="utf-8")
    assert len(corpus.train) == len(raw)
    assert corpus.decode(corpus.train[:200]) == raw[:200]
    assert "trained on wiki.valid.raw" in corpus.note
    # characters of the test text unseen in training map to the unknown id 0
    test_raw = (wikitext_dir / "wiki.test.raw").read_text(encoding="utf-8")
    unseen = set(test_raw) - set(raw)
    assert (np.asarray(corpus.test) == 0).sum() == sum(test_raw.count(c) for c in unseen)
    # unigram entropy against a direct count (unseen characters pooled into one symbol)
    pooled = ["\0" if ch in unseen else ch for ch in test_raw]
    _, counts = np.unique(pooled, return_counts=True)
    p = counts / counts.sum()
    assert unigram_entropy(corpus.test) == pytest.approx(-(p * np.log(p)).sum(), rel=1e-9)


def test_encoded_corpus_is_cached_and_memory_mapped(wikitext_dir):
    a = load_corpus(str(wikitext_dir))
    b = load_corpus(str(wikitext_dir))
    assert isinstance(b.train, np.memmap) and a.key == b.key


def test_single_text_file_is_split(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("abcdefghij" * 1000)
    c = load_corpus(str(f))
    assert len(c.train) == 9000 and len(c.val) == 500 and len(c.test) == 500


def test_missing_or_empty_data_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match="--data"):
        load_corpus(str(tmp_path / "nope"))
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(DataError, match="empty"):
        load_corpus(str(tmp_path / "e.txt"))


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ConfigError, match="did you mean 'n_layer'"):
        TrialConfig.from_dict({"n_layers": 4})
    with pytest.raises(ConfigError, match="not divisible"):
        TrialConfig(n_embd=30, n_head=4)
    with pytest.raises(ConfigError, match="max_steps"):
        TrialConfig(max_steps=0)
    cfg = preset("cpu")
    assert TrialConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.with_overrides(["lr=0.01", "bias=true"]).bias is True


# ------------------------------------------------------------------------- CLI
def test_cli_train_writes_records_and_summary(wikitext_dir, tmp_path):
    r = CliRunner().invoke(main, ["train", "--preset", "smoke", "--data", str(wikitext_dir),
                                  "--out", str(tmp_path / "run"), "--quiet"])
    assert r.exit_code == 0, r.output
    assert "test loss" in r.output and "unigram entropy" in r.output
    lines = (tmp_path / "run" / "probes.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [0, 20, 40]
    assert (tmp_path / "run" / "checkpoints" / "step_0000040" / "state.pt").exists()


@pytest.mark.parametrize("args,msg", [
    (["--set", "n_layr=3"], "unknown config key 'n_layr'"),
    (["--set", "n_embd=33"], "not divisible"),
    (["--set", "max_steps=-5"], "max_steps"),
    (["--set", "lr"], "expected key=value"),
    (["--data", "/definitely/not/here"], "--data"),
])
def test_cli_bad_input_one_line_error(tmp_path, args, msg):
    r = CliRunner().invoke(main, ["train", "--out", str(tmp_path / "x"), *args])
    assert r.exit_code != 0
    assert msg in r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "x").exists()  # nothing written


def test_cli_train_records_into_database(wikitext_dir, tmp_path):
    from qkgeom.store import open_store

    db = f"sqlite:///{tmp_path / 'r.db'}"
    args = ["train", "--preset", "smoke", "--data", str(wikitext_dir), "--quiet", "--db", db]
    r = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    # the same trial again (a rerun) leaves one row per (step, layer, head, metric)
    r = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    st = open_store(db)
    t = st.sql("select status, attempts from trials")
    assert t.rows() == [("terminated", 2)]
    # the final test loss is stored: the one the run printed and wrote to result.json
    printed = json.loads((tmp_path / "b" / "result.json").read_text())["test_loss"]
    assert st.sql("select test_loss from trials").item() == pytest.approx(printed, rel=1e-12)
    n = st.sql("select count(*) from probe_metrics").item()
    per_probe = 2 * (2 + 1) * 9  # layers x (heads + layer row) x metrics
    assert n == 3 * per_probe
    ck = st.sql("select step from checkpoints order by step")["step"].to_list()
    assert ck == [0, 20, 40]
    st.close()
    # a different config under the same trial key would mix two runs' probes: refused,
    # and nothing stored changes
    r = CliRunner().invoke(main, [*args, "--out", str(tmp_path / "c"), "--set", "max_steps=20",
                                  "--set", "probe_every=10"])
    assert r.exit_code != 0 and "different config" in r.output and "Traceback" not in r.output
    st = open_store(db)
    assert st.sql("select count(*) from probe_metrics").item() == n
    assert st.sql("select status, attempts from trials").rows() == [("terminated", 2)]
    st.close()
