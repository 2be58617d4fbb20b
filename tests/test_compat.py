"""A sweep started by the previous release resumes with today's code (issue 27).

tests/golden/flat-sweep.tar.gz holds what the flat layout (git 0268ac6, before the layer
packages) left after a SIGTERM: its database (one trial finished, one interrupted past
step 40) and its Ray Tune experiment, whose pickles name the old module paths
(``qkgeom.tune_trial``, ``qkgeom.tune_callbacks``, ...). tests/golden/make_flat_sweep.py
wrote it. Resumed here in another directory, the experiment is restored (not rerun from
scratch), the finished trial is not trained again, and every stored value equals an
uninterrupted run of today's code.
"""

from __future__ import annotations

import json
import math
import tarfile
from pathlib import Path

from sweep_fixtures import run_cli

FIXTURE = Path(__file__).parent / "golden" / "flat-sweep.tar.gz"


def trials(db: Path) -> dict[str, tuple[str, int]]:
    from qkgeom.store import open_store

    with open_store(f"sqlite:///{db}", create=False, readonly=True) as store:
        t = store.trials("sig")
    return {k: (s, a) for k, s, a in zip(t["trial_key"], t["status"], t["attempts"])}


def probe_rows(db: Path, key: str) -> list[tuple]:
    """Every metric row of trial ``key``, as stored."""
    from qkgeom.store import open_store

    with open_store(f"sqlite:///{db}", create=False, readonly=True) as store:
        return store.sql("SELECT m.step, m.layer, m.head_key, m.metric, m.value FROM "
                         "probe_metrics m JOIN trials t ON t.id = m.trial_id WHERE "
                         "t.trial_key = :k ORDER BY 1, 2, 3, 4", {"k": key}).rows()


def differs(got: float | None, want: float) -> bool:
    """A stored value (NaN stored as NULL) against a reference, to 1e-6 relative."""
    if math.isnan(want):
        return got is not None
    return got is None or abs(got - want) > 1e-6 * max(1.0, abs(want))


def resumed_records(db: Path, key: str, ckpt: Path, data: Path) -> list:
    """Today's ``train`` of trial ``key``'s stored config, resumed from ``ckpt``: the
    probes it reports after the checkpoint's step."""
    from qkgeom.config import TrialConfig
    from qkgeom.engine.train import train
    from qkgeom.store import open_store

    with open_store(f"sqlite:///{db}", create=False, readonly=True) as store:
        t = store.trials("sig")
        cfg = json.loads(t.filter(t["trial_key"] == key)["config"][0])
    cfg["dataset"] = str(data)
    out: list = []
    train(TrialConfig.from_dict(cfg), lambda rec, _ckpt: out.append(rec), resume_from=ckpt)
    return out


def test_a_sweep_of_the_flat_layout_resumes_with_todays_code(scratch, wikitext_dir):
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(scratch, filter="data")
    db = scratch / "sig.db"
    # its database is at an older revision: a resume refuses it until it is upgraded
    p = run_cli(["sweep", "--resume", "--name", "sig", "--db", str(db), "--data",
                 str(wikitext_dir), "--storage", str(scratch / "first")], scratch, check=False)
    assert p.returncode == 1 and f"run: qkgeom db upgrade --db sqlite:///{db}" in p.stderr, \
        p.stderr
    run_cli(["db", "upgrade", "--db", str(db)], scratch)
    before = trials(db)
    assert before == {"d1-gaussian-none-s0": ("terminated", 1),
                      "d1-orthogonal-none-s0": ("interrupted", 1)}
    finished = probe_rows(db, "d1-gaussian-none-s0")
    interrupted = probe_rows(db, "d1-orthogonal-none-s0")
    assert len(finished) > 100 and max(r[0] for r in interrupted) == 100
    p = run_cli(["sweep", "--resume", "--name", "sig", "--db", str(db), "--data",
                 str(wikitext_dir), "--storage", str(scratch / "first"),
                 "--progress-every", "60"], scratch)
    out = p.stdout + p.stderr
    assert "no Ray experiment" not in out, out  # Tune restored the old experiment
    assert "ran with qkgeom 0.1.0+h" in out, out  # the code change is said, not hidden
    after = trials(db)
    assert after["d1-gaussian-none-s0"] == before["d1-gaussian-none-s0"]  # not retrained
    assert after["d1-orthogonal-none-s0"] == ("terminated", 2)
    assert probe_rows(db, "d1-gaussian-none-s0") == finished  # its rows untouched
    # The interrupted trial continued from one of its checkpoints (the one Tune's
    # experiment state had registered: step 80 here, the result of step 100 had not yet
    # been): what it stored before that is the first run's, and every value from there on
    # equals today's code resumed from that checkpoint on this machine. (An uninterrupted
    # run is the reference only on the machine that wrote the fixture: on another CPU the
    # last bits of float64 linear algebra differ, and training carries them from 3e-5 at
    # step 40 to 2% at step 80, as seen on an AVX-512 machine on 2026-12-07.)
    key = "d1-orthogonal-none-s0"
    stored = {r[:4]: r[4] for r in probe_rows(db, key)}
    assert sorted({k[0] for k in stored}) == list(range(0, 1501, 20))
    old = {r[:4]: r[4] for r in interrupted}
    tried = []
    for ckpt in sorted((scratch / "first" / "qkgeom-sig").glob(f"{key}_*/checkpoint_*")):
        ref = resumed_records(db, key, ckpt, wikitext_dir)
        first = min(r.step for r in ref)
        want = {(r.step, layer, -1 if head is None else head, name): value
                for r in ref for layer, head, name, value in r.metrics}
        kept = {k: v for k, v in stored.items() if k[0] < first}
        new = {k: v for k, v in stored.items() if k[0] >= first}
        same_old = kept == {k: v for k, v in old.items() if k[0] < first}
        bad = [k for k, v in want.items() if differs(new.get(k), v)]
        if same_old and new.keys() == want.keys() and not bad:
            break
        tried.append(f"{ckpt.name} (from step {first}): first run's rows kept {same_old}, "
                     f"{len(bad)} values differ")
    else:
        raise AssertionError("no checkpoint of the trial explains its stored values: "
                             + "; ".join(tried))
