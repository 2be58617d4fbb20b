"""Write tests/golden/flat-sweep.tar.gz: a sweep started by the flat layout (qkgeom before
the layer packages, git 0268ac6) and interrupted with SIGTERM once its first trial has
finished and its second has probed past step 40. tests/test_compat.py resumes it with
today's code. Run from the repository root, with that release checked out at FLAT:

    git worktree add /tmp/flat 0268ac6
    python tests/golden/make_flat_sweep.py /tmp/flat

It trains on the WikiText files of $QKGEOM_DATA (or ../shared/data/wikitext).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "golden" / "flat-sweep.tar.gz"
SPEC = """name: sig
trial: {preset: smoke, overrides: {max_steps: 1500}}
grid: {depths: [1], inits: [gaussian, orthogonal], seeds: [0]}
"""


def trials(db: Path) -> dict[str, tuple[str, int]]:
    if not db.exists():
        return {}
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
            return {k: (s, a) for k, s, a in c.execute(
                "SELECT trial_key, status, attempts FROM trials")}
    except sqlite3.Error:
        return {}


def last_step(db: Path, key: str) -> int:
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as c:
        row = c.execute("SELECT MAX(p.step) FROM probes p JOIN trials t ON t.id = p.trial_id "
                        "WHERE t.trial_key = ?", (key,)).fetchone()
    return row[0] or 0


def main() -> None:
    flat = Path(sys.argv[1]).resolve()
    data = os.environ.get("QKGEOM_DATA") or str(ROOT.parent / "shared" / "data" / "wikitext")
    d = Path(tempfile.mkdtemp(prefix="qkflat-", dir="/tmp"))
    (d / "spec.yaml").write_text(SPEC)
    db = d / "sig.db"
    env = {**os.environ, "PYTHONPATH": str(flat), "TMPDIR": "/tmp"}
    cmd = [sys.executable, "-c", "import sys; from qkgeom.cli import main; "
           "sys.argv = ['qkgeom'] + sys.argv[1:]; main()", "sweep", "--spec", "spec.yaml",
           "--db", str(db), "--data", data, "--storage", str(d / "first"),
           "--max-concurrent", "1", "--progress-every", "60", "--snapshots", "none"]
    with open(d / "driver.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=d, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while time.monotonic() < deadline:
                st = trials(db)
                if [s for s, _ in st.values()].count("terminated") == 1 and \
                        last_step(db, "d1-orthogonal-none-s0") >= 40:
                    break
                if proc.poll() is not None:
                    sys.exit("the sweep ended early:\n" + (d / "driver.log").read_text())
                time.sleep(0.3)
            os.kill(proc.pid, signal.SIGTERM)
            rc = proc.wait(timeout=120)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    st = trials(db)
    print(f"driver exit {rc}; trials {json.dumps(st)}")
    # keep each trial's two newest Tune checkpoints (the experiment state a restore reads may
    # be one checkpoint behind the trial after a SIGTERM): the fixture
    # stays small; the older ones are what a long sweep accumulates, not what resumes
    for trial in (d / "first").glob("qkgeom-sig/*/"):
        ckpts = sorted(trial.glob("checkpoint_*"))
        for old in ckpts[:-2]:
            shutil.rmtree(old)
    with sqlite3.connect(db) as c:  # fold the WAL into the file before packing it
        c.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    with tarfile.open(OUT, "w:gz") as tar:
        for name in ("spec.yaml", "sig.db", "first"):
            tar.add(d / name, arcname=name)
    print(f"wrote {OUT} ({OUT.stat().st_size:,} bytes) from {d}")


if __name__ == "__main__":
    main()
