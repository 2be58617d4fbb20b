"""Issue 40, item 3: a restarted attempt starts clean.

A worker is killed (SIGKILL, by the trainable's own fault hook, ``QKGEOM_TEST_FAULTS``) at
each point between a probe's database write and the checkpoint of that step: after a
worker's own write (``--direct-writes``, PostgreSQL), before ``tune.report`` with the
snapshot uploaded, and after ``tune.report`` returned (the driver wrote the probe; the step
has no checkpoint). The next attempt restores the checkpoint of step 100 and is killed as
soon as it has, so what the database holds then is exactly what that attempt starts from:
the steps up to 100, as an uninterrupted run stores them, and nothing of the killed attempt
after it. ``--resume`` then finishes both trials with every value of an uninterrupted run.
"""

from __future__ import annotations

import json

import pytest
from sweep_fixtures import assert_matches_reference, reference_records, run_cli

from qkgeom.store import open_store

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SPEC = """name: rc
trial: {preset: smoke, overrides: {max_steps: 200, probe_every: 50, eval_every: 50,
                                   checkpoint_every: 100}}
grid: {depths: [1], inits: [gaussian], seeds: 2}
"""
S0, S1 = "d1-gaussian-none-s0", "d1-gaussian-none-s1"


def _steps(db: str) -> dict[str, list[int]]:
    with open_store(db, create=False, readonly=True) as store:
        out = {}
        for r in store.trials("rc").iter_rows(named=True):
            out[r["trial_key"]] = [p.step for p in store.read_probes(r["id"])]
            rows = store.sql("SELECT step FROM train_steps WHERE trial_id = :t ORDER BY step",
                             {"t": r["id"]})["step"].to_list()
            assert not rows or max(rows) <= max(out[r["trial_key"]] or [0]), (r["trial_key"],
                                                                            rows)
    return out


def test_a_restored_attempt_starts_from_its_checkpoint_and_nothing_after_it(
        scratch, db_url, wikitext_dir):
    direct = db_url.startswith("postgresql")
    # where the first attempt dies: s0 after a probe the database has but no checkpoint
    # holds (its own write on PostgreSQL, the driver's otherwise); s1 with step 200's
    # snapshot uploaded and its checkpoint not yet reported (the database holds 150)
    first = {S0: ["written" if direct else "reported", 150], S1: ["report", 200]}
    faults = {k: [v, ["restored", None]] for k, v in first.items()}
    markers = scratch / "faults"
    markers.mkdir()
    env = {"QKGEOM_TEST_FAULTS": json.dumps({"dir": str(markers), "faults": faults})}
    (scratch / "spec.yaml").write_text(SPEC)
    args = ["sweep", "--spec", str(scratch / "spec.yaml"), "--db", db_url, "--data",
            str(wikitext_dir), "--max-failures", "1", "--progress-every", "60"]
    if direct:
        args.append("--direct-writes")
    p = run_cli(args, scratch, check=False, env=env)
    out = p.stdout + p.stderr
    assert sorted(f.name for f in markers.iterdir()) == [f"{S0}.0", f"{S0}.1", f"{S1}.0",
                                                        f"{S1}.1"], out
    with open_store(db_url, create=False, readonly=True) as store:
        st = {r["trial_key"]: (r["status"], r["attempts"])
              for r in store.trials("rc").iter_rows(named=True)}
    assert st == {S0: ("error", 2), S1: ("error", 2)}, (st, out)
    with open_store(db_url, create=False, readonly=True) as store:
        cfg = json.loads(store.trials("rc")["config"][0])
    ref = [r.step for r in reference_records(cfg)]
    assert ref == [0, 50, 100, 150, 200]
    # the second attempt restored step 100: the first attempt's 150 (and 200) are gone
    assert _steps(db_url) == {S0: [0, 50, 100], S1: [0, 50, 100]}, out
    p = run_cli(["sweep", "--resume", "--name", "rc", "--db", db_url, "--progress-every", "60"]
                + (["--direct-writes"] if direct else []), scratch, env=env)
    assert _steps(db_url) == {S0: ref, S1: ref}
    assert assert_matches_reference(db_url, "rc") == 2


def test_train_db_resume_starts_clean_from_its_checkpoint(tmp_path, wikitext_dir):
    """``qkgeom train --db ... --resume OUT/checkpoints/step_N``: the attempt it records
    starts with the rows the earlier run stored after step N deleted (a run without
    --resume starts from scratch: with all of them deleted)."""
    from qkgeom.cli.train import ProbeSink
    from qkgeom.config import TrialConfig

    url = f"sqlite:///{tmp_path / 't.db'}"
    out = tmp_path / "run"
    sets = ["--set", "max_steps=40", "--set", "probe_every=10", "--set", "eval_every=10"]
    run_cli(["train", "--preset", "smoke", "--data", str(wikitext_dir), "--out", str(out),
             "--db", url, "--name", "tr", *sets], tmp_path)

    def steps() -> list[int]:
        with open_store(url, create=False, readonly=True) as store:
            return [p.step for p in store.read_probes(int(store.trials("tr")["id"][0]))]

    assert steps() == [0, 10, 20, 30, 40]
    cfg = TrialConfig.from_dict(json.loads((out / "config.json").read_text()))
    for d in ("again", "fresh"):
        (tmp_path / d).mkdir()
    with ProbeSink(tmp_path / "again", url, "tr", cfg,
                   resume_dir=out / "checkpoints" / "step_0000020"):
        assert steps() == [0, 10, 20]  # before this attempt has written anything
    with ProbeSink(tmp_path / "fresh", url, "tr", cfg):
        assert steps() == []
