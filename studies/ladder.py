"""Tables of the scale x learning-rate ladder (docs/findings.md) from the results databases.

For every cell (a sweep run from ``studies/ladder-*.yaml``, or the ``cpu`` preset, whose
configs are those of the cell n_embd 48 / lr 1e-3) this runs ``qkgeom report`` and reads the verdict of every
claim, then adds what the report does not tabulate across cells: the wall time, the seed by
seed picture of claim 2 (the gap at the last probe, per seed) and the last layer's
end-of-training PR_Q and PR_K per depth. Everything goes through the public CLI
(``qkgeom report``, ``qkgeom query``), so the numbers are the ones a user gets.

    python studies/ladder.py --cell e48-lr1e-3=cpu.db:cpu --cell e64-lr3e-3=ladder.db \
        --reports reports --json studies/ladder-verdicts.json > ladder.md

A cell is ``LABEL=DB[:SWEEP]`` (DB a SQLite file); SWEEP defaults to ``ladder-LABEL``.

``--per-seed DIR``: also the verdicts of the grid claims (2-*, 3) from each grid seed
alone. For seed s, a copy of the database in DIR has every other seed's arm-none trial
marked ``error`` (the report reads terminated trials only), and ``qkgeom report`` runs on
the copy; the cell's own database is never written.
"""

from __future__ import annotations

import argparse
import json
import re
import sqlite3
import subprocess
import sys
from collections import defaultdict
from datetime import datetime
from pathlib import Path

CLAIMS = ["2-gap", "2-slopes", "2-slopes-late", "3", "4-shrink", "4-hold",
          "4-shrink_act", "reality-check", "reality-check-act"]


def qkgeom(*args: str) -> str:
    out = subprocess.run(["qkgeom", *args], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"qkgeom {' '.join(args)} failed:\n{out.stderr}")
    return out.stdout


def query(db: str, sql: str) -> list[dict]:
    return json.loads(qkgeom("query", "--db", db, "--format", "json", sql))


def cell_facts(label: str, db: str, sweep: str, reports: Path) -> dict:
    out = reports / sweep
    qkgeom("report", "--db", db, "--sweep", sweep, "--out", str(out), "--format", "json")
    rep = json.loads((out / "report.json").read_text())
    claims = {c["key"]: c for c in rep["claims"]}
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", sweep):
        sys.exit(f"sweep name {sweep!r}: only letters, digits and _ . - are accepted")
    s = f"'{sweep}'"  # checked above: it cannot close the quote
    wall = query(db, f"""SELECT MIN(t.started_at) AS a, MAX(t.ended_at) AS b,
        COUNT(*) AS n, SUM(CASE WHEN t.status = 'terminated' THEN 1 ELSE 0 END) AS done
        FROM trials t JOIN sweeps w ON w.id = t.sweep_id WHERE w.name = {s}""")[0]
    secs = (datetime.fromisoformat(str(wall["b"])) -
            datetime.fromisoformat(str(wall["a"]))).total_seconds() if wall["a"] else None
    ends = query(db, f"""SELECT q.depth, q.init, q.seed, q.layer, q.value AS pr_q,
        k.value AS pr_k FROM v_final q JOIN v_final k ON k.trial_id = q.trial_id
        AND k.layer = q.layer AND k.metric = 'pr_k' JOIN trials t ON t.id = q.trial_id
        WHERE q.sweep = {s} AND q.metric = 'pr_q' AND q.arm = 'none'
        AND t.status = 'terminated' AND NOT (q.depth = 4 AND q.init = 'gaussian'
        AND q.seed > 1)""")
    per_seed: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    last: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for r in ends:
        per_seed[r["seed"]][0] += r["pr_q"] > r["pr_k"]
        per_seed[r["seed"]][1] += 1
        if r["layer"] == r["depth"] - 1:
            last[r["depth"]].append((r["pr_q"], r["pr_k"]))
    loss = query(db, f"""SELECT t.arm, AVG(t.test_loss) AS tl, COUNT(*) AS n FROM trials t
        JOIN sweeps w ON w.id = t.sweep_id WHERE w.name = {s} AND t.status = 'terminated'
        GROUP BY t.arm ORDER BY t.arm""")
    arms = {}
    for key in ("4-shrink", "4-hold", "4-shrink_act"):
        n = claims.get(key, {}).get("numbers", {}) or {}
        res = n.get("result", n)
        arms[key] = {k: res.get(k) for k in ("n_agree", "n_seeds", "directional_confidence",
                                              "mean_delta", "predicted_sign")}
    return {
        "label": label, "db": db, "sweep": sweep, "scale": rep.get("scale"),
        "rules_version": rep.get("rules_version", 1),
        "verdicts": {k: claims[k]["verdict"] for k in CLAIMS if k in claims},
        "measured": {k: claims[k]["measured"] for k in CLAIMS if k in claims},
        "wall_s": secs, "trials": wall["n"], "terminated": wall["done"],
        "gap_per_seed": {str(k): v for k, v in sorted(per_seed.items())},
        "last_layer": {str(d): {"pr_q": sum(a for a, _ in v) / len(v),
                                "pr_k": sum(b for _, b in v) / len(v),
                                "q_gt_k": sum(a > b for a, b in v), "n": len(v)}
                       for d, v in sorted(last.items())},
        "test_loss": {r["arm"]: r["tl"] for r in loss},
        "arms": arms,
    }


GRID_CLAIMS = ["2-gap", "2-slopes", "2-slopes-late", "3"]


def per_seed_verdicts(label: str, db: str, sweep: str, out: Path,
                      seeds: tuple[int, ...] = (0, 1)) -> dict[str, dict[str, str]]:
    """{seed: {grid claim: verdict}} with the geometry trials of that grid seed alone."""
    out.mkdir(parents=True, exist_ok=True)
    got = {}
    for seed in seeds:
        copy = out / f"{label}-seed{seed}.db"
        copy.unlink(missing_ok=True)
        # through SQLite's backup API: a plain file copy would miss what is still in the WAL
        src = sqlite3.connect(Path(db).absolute().as_uri() + "?mode=ro", uri=True)
        con = sqlite3.connect(copy)
        try:
            src.backup(con)
        finally:
            src.close()
        try:
            with con:
                (sid,) = con.execute("SELECT id FROM sweeps WHERE name = ?", (sweep,)).fetchone()
                con.execute("UPDATE trials SET status = 'error' WHERE sweep_id = ? AND "
                            "arm = 'none' AND seed <> ?", (sid, seed))
        finally:
            con.close()
        rep = out / f"{label}-seed{seed}"
        qkgeom("report", "--db", f"sqlite:///{copy}", "--sweep", sweep, "--out", str(rep),
               "--format", "json")
        claims = {c["key"]: c for c in json.loads((rep / "report.json").read_text())["claims"]}
        got[str(seed)] = {k: claims[k]["verdict"] for k in GRID_CLAIMS if k in claims}
    return got


def hm(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{int(s // 60)} min {int(s % 60):02d} s"


def markdown(cells: list[dict]) -> str:
    labels = [c["label"] for c in cells]
    md = ["| claim | " + " | ".join(labels) + " |", "|---" * (len(cells) + 1) + "|"]
    for k in CLAIMS:
        md.append(f"| {k} | " + " | ".join(c["verdicts"].get(k, "-") for c in cells) + " |")
    md += ["", "| cell | trials (terminated) | wall time | mean test loss (none / hold / "
           "shrink / shrink_act) |", "|---|---|---|---|"]
    for c in cells:
        tl = " / ".join(f"{c['test_loss'][a]:.3f}" if c["test_loss"].get(a) else "-"
                        for a in ("none", "hold", "shrink", "shrink_act"))
        md.append(f"| {c['label']} | {c['trials']} ({c['terminated']}) | {hm(c['wall_s'])} "
                  f"| {tl} |")
    md += ["", "| cell | 2-gap at the last probe, PR_Q > PR_K in (trial, layer) units, per "
           "seed | last layer, mean PR_Q / PR_K (PR_Q > PR_K in k of n runs) per depth | "
           "arms: seeds with the predicted sign (shrink, hold, shrink_act) |",
           "|---|---|---|---|"]
    for c in cells:
        gap = ", ".join(f"seed {s}: {a}/{n}" for s, (a, n) in c["gap_per_seed"].items())
        ll = "; ".join(f"d{d}: {v['pr_q']:.2f} / {v['pr_k']:.2f} ({v['q_gt_k']}/{v['n']})"
                       for d, v in c["last_layer"].items())
        ar = ", ".join(f"{v['n_agree']}/{v['n_seeds']}" if v.get("n_seeds") else "-"
                       for v in c["arms"].values())
        md.append(f"| {c['label']} | {gap} | {ll} | {ar} |")
    if any("per_seed" in c for c in cells):
        short = {"holds": "holds", "does not hold": "no", "not enough data": "?"}
        md += ["", "| cell | " + " | ".join(f"{k}: seed 0 / seed 1 / both" for k in
                                           GRID_CLAIMS) + " |", "|---" * 5 + "|"]
        for c in cells:
            ps = c.get("per_seed", {})
            row = [" / ".join(short[v] for v in (ps.get("0", {}).get(k, "not enough data"),
                                                 ps.get("1", {}).get(k, "not enough data"),
                                                 c["verdicts"].get(k, "not enough data")))
                   for k in GRID_CLAIMS]
            md.append(f"| {c['label']} | " + " | ".join(row) + " |")
    return "\n".join(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", action="append", required=True, help="LABEL=DB[:SWEEP]")
    ap.add_argument("--reports", default="reports", help="where the reports are written")
    ap.add_argument("--json", help="write the cells' facts here")
    ap.add_argument("--keep", help="an earlier ladder file: its cells not named by --cell are "
                    "carried over unchanged (with the rules version they were decided under)")
    ap.add_argument("--per-seed", help="directory for the per-grid-seed database copies and "
                    "reports (adds the grid claims' verdicts per seed)")
    a = ap.parse_args()
    cells = []
    for spec in a.cell:
        label, _, rest = spec.partition("=")
        db, _, sweep = rest.partition(":")
        print(f"cell {label}: {db} {sweep or 'ladder-' + label}", file=sys.stderr)
        sweep = sweep or f"ladder-{label}"
        cells.append(cell_facts(label, db, sweep, Path(a.reports)))
        if a.per_seed:
            cells[-1]["per_seed"] = per_seed_verdicts(label, db, sweep, Path(a.per_seed))
    if a.keep:
        have = {c["label"] for c in cells}
        kept = [dict(c, rules_version=c.get("rules_version", 1))
                for c in json.loads(Path(a.keep).read_text()) if c["label"] not in have]
        print(f"kept {len(kept)} cell(s) of {a.keep}: "
              f"{', '.join(c['label'] for c in kept) or 'none'}", file=sys.stderr)
        cells = cells + kept
    if a.json:
        Path(a.json).write_text(json.dumps(cells, indent=1) + "\n")
    print(markdown(cells))


if __name__ == "__main__":
    main()
