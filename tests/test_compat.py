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

import tarfile
from pathlib import Path

from sweep_fixtures import assert_matches_reference, run_cli

FIXTURE = Path(__file__).parent / "golden" / "flat-sweep.tar.gz"


def trials(db: Path) -> dict[str, tuple[str, int]]:
    from qkgeom.store import open_store

    with open_store(f"sqlite:///{db}", create=False, readonly=True) as store:
        t = store.trials("sig")
    return {k: (s, a) for k, s, a in zip(t["trial_key"], t["status"], t["attempts"])}


def test_a_sweep_of_the_flat_layout_resumes_with_todays_code(scratch, wikitext_dir):
    with tarfile.open(FIXTURE) as tar:
        tar.extractall(scratch, filter="data")
    db = scratch / "sig.db"
    before = trials(db)
    assert before == {"d1-gaussian-none-s0": ("terminated", 1),
                      "d1-orthogonal-none-s0": ("interrupted", 1)}
    p = run_cli(["sweep", "--resume", "--name", "sig", "--db", str(db), "--data",
                 str(wikitext_dir), "--storage", str(scratch / "first"),
                 "--progress-every", "60"], scratch)
    out = p.stdout + p.stderr
    assert "no Ray experiment" not in out, out  # Tune restored the old experiment
    assert "ran with qkgeom 0.1.0+h" in out, out  # the code change is said, not hidden
    after = trials(db)
    assert after["d1-gaussian-none-s0"] == before["d1-gaussian-none-s0"]  # not retrained
    assert after["d1-orthogonal-none-s0"] == ("terminated", 2)
    assert assert_matches_reference(f"sqlite:///{db}", "sig") == 2
