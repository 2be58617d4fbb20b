"""Sweep names and filters (issue 40, item 6): names are checked where a sweep is created
(a spec or --name, `qkgeom train --name`, `qkgeom db merge --rename`), names already stored
keep working and are escaped in report.md, and a config key named like a trial column is
reached without ambiguity (``--where config.KEY=VALUE``, the page's ``f.config.KEY``)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from helpers import invoke, run
from stats_fixtures import write_trials

from qkgeom.records import ProbeRecord

# the words of the rule every refusal quotes (qkgeom.names.NAME_RULE)
NAME_RULE = "1 to 100 characters: letters, digits, '-', '_' and '.', starting with a letter"

GOOD = ["smoke", "cpu-grid_2.v1", "ladder-e128-lr1e-3", "A", "9lives", "x" * 100, "ünï"]
BAD = ["", "-x", ".hidden", "..", "a..b", "a/b", "a\\b", "a\x00b", "a\nb", "a\tb", " x",
       "x ", "a b", "x" * 101, "<script>alert(1)</script>", "q?x", "h#x", "p%41", "a:b",
       "a\u202eb", "_x"]


def test_the_name_rule() -> None:
    from qkgeom.names import NAME_RULE as RULE
    from qkgeom.names import SweepNameError, check_sweep_name

    assert NAME_RULE in RULE
    for n in GOOD:
        assert check_sweep_name(n) == n
    for n in BAD:
        with pytest.raises(SweepNameError) as e:
            check_sweep_name(n, what="--name")
        msg = str(e.value)
        assert msg.startswith("--name ") and NAME_RULE in msg and "\n" not in msg, n


@pytest.mark.parametrize("name", [".hidden", "-dash", "a..b", "x" * 101, "_x"])
def test_sweep_refuses_a_bad_name_before_it_starts(name: str) -> None:
    r = invoke("sweep", "--preset", "smoke", f"--name={name}", "--dry-run")
    assert r.exit_code != 0
    assert NAME_RULE in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_a_spec_name_is_checked_too(tmp_path: Path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text("name: .x\ngrid: {depths: [2], inits: [gaussian], seeds: [0]}\n")
    r = invoke("sweep", "--spec", str(spec), "--dry-run")
    assert r.exit_code != 0 and NAME_RULE in r.output, r.output


def test_train_refuses_a_bad_name_before_anything_runs(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    out = tmp_path / "run"
    for name in ("../escape", ".x", "a/b"):
        r = invoke("train", "--db", str(db), "--name", name, "--out", str(out),
                   "--data", str(tmp_path / "no-data"), "--quiet")
        assert r.exit_code != 0
        assert NAME_RULE in r.output, r.output
    assert not db.exists() and not out.exists()


def _digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_merge_refuses_a_bad_new_name(tmp_path: Path) -> None:
    src, dst = tmp_path / "src.db", tmp_path / "dst.db"
    write_trials("sqlite:///" + str(src), "plain", [
        {"depth": 2, "init": "gaussian", "arm": "none", "seed": 0,
         "values": lambda s, layer: {"pr_q": 2.0, "pr_k": 1.0}}], steps=[0, 10], max_steps=10)
    for new in ("../x", ".x", "a/b"):
        r = invoke("db", "merge", "--from", str(src), "--db", str(dst), "--rename",
                   f"plain={new}")
        assert r.exit_code != 0 and NAME_RULE in r.output, r.output
    assert not dst.exists()
    # a name stored before the rule (an old database) is copied as it is
    write_trials("sqlite:///" + str(src), "old name/with slash", [
        {"depth": 2, "init": "gaussian", "arm": "none", "seed": 0,
         "values": lambda s, layer: {"pr_q": 2.0, "pr_k": 1.0}}], steps=[0, 10], max_steps=10)
    r = invoke("db", "merge", "--from", str(src), "--db", str(dst), "--sweep",
               "old name/with slash")
    assert r.exit_code == 0, r.output


# --------------------------------------------------------------------------- report.md


HOSTILE = "<script>alert(1)</script>"
LINK = "[x](javascript:alert(1))"


@pytest.mark.parametrize("name", [HOSTILE, LINK, "**bold** _it_ `code` | pipe"])
def test_report_md_escapes_a_stored_name(tmp_path: Path, name: str) -> None:
    url = "sqlite:///" + str(tmp_path / "r.db")
    write_trials(url, name, [
        {"depth": 2, "init": i, "arm": "none", "seed": s,
         "values": lambda st, layer: {"pr_q": 5.0 + st / 10, "pr_k": 4.0}}
        for i in ("gaussian", "tied") for s in (0, 1, 2)], steps=[0, 10], max_steps=10)
    out = tmp_path / "rep"
    r = invoke("report", "--db", url, "--sweep", name, "--out", str(out), "--boot", "200")
    assert r.exit_code == 0, r.output
    md = (out / "report.md").read_text(encoding="utf-8")
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "<script" not in md.lower() and "<script" not in html.lower()
    # no inline link but the report's own figures (an escaped \]( is text)
    assert not re.search(r"(?<!\\)\]\((?!fig-)", md)
    assert not re.search(r"<[A-Za-z/!?]", md)  # no raw HTML tag anywhere in report.md
    heading = md.splitlines()[0]
    if name == HOSTILE:
        assert heading == "# qkgeom study report: &lt;script&gt;alert(1)&lt;/script&gt;"
        assert "Sweep **&lt;script&gt;alert(1)&lt;/script&gt;**" in md
    if name.startswith("**"):
        assert heading == (r"# qkgeom study report: \*\*bold\*\* \_it\_ \`code\` \| pipe")
    # the report's own links and tables still work
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md):
        assert (out / link).exists()


# --------------------------------------------------------------------------- filters

STEPS = [0, 50, 100]
# a 2 x 2 design over config keys named like trial columns, "status" and "device"; PR_Q >
# PR_K planted in the cells with status s48
CELLS = {f"{st}-{dev}": {"status": st, "device": dev} for st in ("s48", "s64")
         for dev in ("cpu", "cuda")}


@pytest.fixture(scope="module")
def clash(tmp_path_factory: pytest.TempPathFactory) -> str:
    from qkgeom.store import open_store

    url = "sqlite:///" + str(tmp_path_factory.mktemp("clash") / "clash.db")
    with open_store(url) as store:
        sid = store.ensure_sweep("clash", {"synthetic": True}, "synthetic")
        for cell, factors in CELLS.items():
            for init in ("gaussian", "tied", "orthogonal"):
                for seed in (0, 1, 2):
                    cfg = {**factors, "max_steps": 100, "n_layer": 2, "init": init,
                           "seed": seed}
                    tid = store.ensure_trial(sid, f"{cell}.d2-{init}-none-s{seed}", cfg,
                                             depth=2, init=init, arm="none", seed=seed,
                                             cell=cell)
                    gap = 1.0 if factors["status"] == "s48" else -1.0
                    store.write_probes(tid, [ProbeRecord(
                        step=s, progress=s / 100, tokens=s, train_loss=float("nan"),
                        val_loss=1.0, lr=1e-3, tokens_per_s=0.0,
                        metrics=[m for layer in range(2) for m in (
                            (layer, None, "pr_q", 5.0 + gap + 0.01 * seed),
                            (layer, None, "pr_k", 5.0))]) for s in STEPS])
                    store.set_trial_status(tid, "terminated")
    return url


def sign(url: str, *extra: str) -> tuple[int, str]:
    return run("stats", "sign-test", "--db", url, "--sweep", "clash", *extra,
               "--format", "json")


def test_where_refuses_a_name_that_is_both_a_column_and_a_config_key(clash) -> None:
    code, out = sign(clash, "--where", "status=s48")
    assert code != 0 and len(out.strip().splitlines()) == 1, out
    assert "both the trial column 'status'" in out
    assert "--where config.status=s48" in out and "--where trial.status=" in out


def test_where_config_key_always_means_the_config_key(clash) -> None:
    code, out = sign(clash, "--where", "config.status=s48", "--where", "config.device=cpu")
    assert code == 0, out
    d = json.loads(out)
    assert d["where"] == {"config.status": ["s48"], "config.device": ["cpu"]}
    assert d["n_positive"] == d["n"] == 6  # one cell: 3 inits x 2 layers, all positive
    code, out = sign(clash, "--where", "config.device=cuda", "--where", "config.status=s64")
    assert code == 0 and json.loads(out)["n_positive"] == 0, out
    code, out = sign(clash, "--where", "trial.status=terminated", "--where", "cell=s64-cpu")
    assert code == 0 and json.loads(out)["n_positive"] == 0, out
    # names that mean the same in both places stay plain (seed: the trial's own)
    code, out = sign(clash, "--where", "cell=s48-cuda", "--where", "seed=0,1")
    assert code == 0 and json.loads(out)["n_positive"] == 6, out
    code, out = sign(clash, "--where", "config.nope=1")
    assert code != 0 and "no config key 'nope'" in out, out


def test_the_page_keeps_a_factor_named_like_a_trial_column(clash) -> None:
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from qkgeom.web.serve import create_app

    with TestClient(create_app(clash, n_boot=200, wait_s=0, update_every_s=0),
                    base_url="http://127.0.0.1") as c:
        page = c.get("/sweeps/clash?refresh=0").text
        assert "name='f.config.status'" in page and "name='f.config.device'" in page
        assert "<option value='config.status'" in page
        r = c.get("/sweeps/clash?refresh=0&f.config.status=s64&group=config.device")
        assert r.status_code == 200, r.text[-400:]
        rows = re.findall(r"<tr>(.*?)</tr>", r.text.split("<table id='trials'>")[1]
                          .split("<tbody>")[1].split("</tbody>")[0])
        assert len(rows) == 18 and all("<td>s64-" in row for row in rows)
        assert all("terminated" in row for row in rows)  # the trial column, as it is
        csv = c.get("/sweeps/clash/trials.csv").text.splitlines()
        head = csv[0].split(",")
        assert "config.status" in head and "status" in head and "config.device" in head
        i, j = head.index("config.status"), head.index("status")
        assert {ln.split(",")[i] for ln in csv[1:]} == {"s48", "s64"}
        assert {ln.split(",")[j] for ln in csv[1:]} == {"terminated"}
        r = c.get("/sweeps/clash/trajectories.csv?f.config.device=cuda&view=trial")
        assert r.status_code == 200 and len(r.text.splitlines()) > 1


def test_resume_of_a_stored_name_that_breaks_the_rule_is_refused(tmp_path: Path) -> None:
    """A sweep stored under "a/b" (an old database) is not resumed: its storage
    directories would be made again under that name; refused before Ray starts."""
    from qkgeom.plan.spec import plan_from
    from qkgeom.store import open_store

    url = "sqlite:///" + str(tmp_path / "old.db")
    spec = {**plan_from("smoke").spec, "name": "a/b"}
    with open_store(url) as store:
        store.ensure_sweep("a/b", spec, "old")
    before = _digest(tmp_path / "old.db")
    r = invoke("sweep", "--resume", "--name", "a/b", "--db", url)
    assert r.exit_code != 0 and NAME_RULE in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1
    assert _digest(tmp_path / "old.db") == before
