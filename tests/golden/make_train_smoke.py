"""Record this machine's numbers of the golden trainings (tests/test_golden.py) from the
flat layout, git 0268ac6, and add them to tests/golden/train-smoke.json as one more machine.

    git worktree add /tmp/flat 0268ac6
    python tests/golden/make_train_smoke.py /tmp/flat [--data DIR]

The trainings run in a separate process with the old checkout first on PYTHONPATH (its
code, this environment's packages); an entry whose numbers equal an existing machine's is
not added twice.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

FILE = Path(__file__).with_name("train-smoke.json")


def run_case(flat: Path, data: str, sets: list[str]) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="qkgeom-golden-"))
    args = [a for s in sets for a in ("--set", s)]
    r = subprocess.run([sys.executable, "-c", "from qkgeom.cli import main; main()", "train",
                        "--preset", "smoke", "--data", data, *args, "--out", str(tmp / "run"),
                        "--no-checkpoints", "--quiet"], capture_output=True, text=True,
                       cwd=tempfile.gettempdir(), env={**os.environ, "PYTHONPATH": str(flat)})
    if r.returncode != 0:
        sys.exit(f"the flat layout's qkgeom train failed:\n{r.stderr[-3000:]}")
    probes = []
    for line in (tmp / "run" / "probes.jsonl").read_text().splitlines():
        p = json.loads(line)
        probes.append({"step": p["step"], "train_loss": p["train_loss"],
                       "val_loss": p["val_loss"], "lr": p["lr"], "metrics": p["metrics"],
                       "history": [{k: h[k] for k in ("step", "train_loss", "val_loss", "lr")}
                                   for h in p.get("history", [])]})
    return {"probes": probes,
            "test_loss": json.loads((tmp / "run" / "result.json").read_text())["test_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("flat", type=Path, help="a checkout of git 0268ac6")
    ap.add_argument("--data", default=os.environ.get("QKGEOM_DATA", "../shared/data/wikitext"))
    ap.add_argument("--cpu", default=None, help="how to name this machine in the file")
    a = ap.parse_args()
    if not (a.flat / "qkgeom" / "tune.py").exists():
        sys.exit(f"{a.flat} is not a checkout of the flat layout (git 0268ac6)")
    golden = json.loads(FILE.read_text())
    cases = {}
    for case, v in golden["machines"][0]["cases"].items():
        got = run_case(a.flat, str(Path(a.data).resolve()), [*golden["common_sets"], *v["sets"]])
        cases[case] = {"sets": v["sets"], **got}
    if any(m["cases"] == cases for m in golden["machines"]):
        print("this machine's numbers are already recorded")
        return
    import torch

    cpu = a.cpu or f"torch cpu capability {torch.backends.cpu.get_cpu_capability()}"
    golden["machines"].append({"made_by": "tests/golden/make_train_smoke.py with the flat "
                               "layout (git 0268ac6)", "cpu": cpu, "cases": cases})
    FILE.write_text(json.dumps(golden, separators=(",", ":")))
    print(f"added the numbers of {cpu} to {FILE}")


if __name__ == "__main__":
    main()
