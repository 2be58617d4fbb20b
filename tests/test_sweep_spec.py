"""The sweep spec (qkgeom.plan.spec): presets, spec files, --set, validation, pairing. No Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qkgeom.config import TrialConfig
from qkgeom.plan.spec import (
    SpecError,
    baseline_metric,
    build_plan,
    fill_baseline_pr,
    plan_from,
    trial_key,
)


def test_presets_expand_to_the_study():
    smoke = plan_from("smoke")
    assert len(smoke.trials) == 4 + 1 + 3 * 2  # grid, the seed-1 baseline, 3 arms x 2 seeds
    paper = plan_from("paper")
    grid = [t for t in paper.trials if t.baseline_key is None]
    arms = [t for t in paper.trials if t.baseline_key is not None]
    # 36 geometry runs (seeds 0-3) + the depth-6 gaussian baselines of seeds 4-7
    assert len(grid) == 36 + 4
    assert len(arms) == 3 * 8 and {t.arm for t in arms} == {"hold", "shrink", "shrink_act"}
    cpu = plan_from("cpu")
    # 3 depths x 3 inits x 2 seeds, the depth-4 gaussian baselines of seeds 2-7, 3 arms x 8
    assert len(cpu.trials) == 18 + 6 + 24
    # every trial of a preset trains for that preset's steps (qkgeom/config.py PRESETS),
    # written out here so a changed preset or a preset that is not applied fails
    expected = {"smoke": (40, 20), "cpu": (1500, 100), "paper": (5000, 250)}
    for name, plan in (("smoke", smoke), ("cpu", cpu), ("paper", paper)):
        got = {(t.config["max_steps"], t.config["probe_every"]) for t in plan.trials}
        assert got == {expected[name]}, name
    assert TrialConfig().max_steps == 5000  # the dataclass default is the paper's


@pytest.mark.parametrize("preset", ["smoke", "cpu", "paper"])
def test_every_arm_trial_has_its_paired_baseline(preset):
    plan = plan_from(preset)
    by_key = plan.by_key()
    arm_trials = [t for t in plan.trials if t.arm != "none"]
    assert arm_trials
    for t in arm_trials:
        base = by_key[t.baseline_key]
        assert (base.arm, base.depth, base.init, base.seed) == ("none", t.depth, t.init, t.seed)
        # paired by seed: the same config apart from the arm and its own settings
        diff = {k for k in t.config if t.config[k] != base.config[k]}
        assert diff <= {"arm", "site", "target_mode", "shrink_to", "baseline_pr"}, (t.key, diff)
        assert base.config["seed"] == t.config["seed"] and base.config["lr"] == t.config["lr"]
    # every arm of the study presets runs eight paired seeds (sized by claim 4's power)
    if preset != "smoke":
        for arm in ("hold", "shrink", "shrink_act"):
            seeds = sorted(t.seed for t in arm_trials if t.arm == arm)
            assert seeds == list(range(8)), (arm, seeds)
            assert all(by_key[trial_key(t.depth, t.init, "none", s)]
                       for t in arm_trials for s in seeds)


@pytest.mark.parametrize("preset", ["smoke", "cpu", "paper"])
def test_study_arms_contract_relative_to_the_baseline(preset):
    plan = plan_from(preset)
    for t in plan.trials:
        c = t.config
        if t.arm in ("shrink", "shrink_act"):
            assert c["target_mode"] == "baseline_fraction" and t.needs_baseline
            assert c["site"] == ("activation" if t.arm == "shrink_act" else "weight")
            assert baseline_metric(c) == ("pr_k" if t.arm == "shrink_act" else "pr_wk")
        elif t.arm == "hold":  # keeps its definition: the step-0 W_K PR, weight site
            assert c["target_mode"] == "init_fraction" and c["site"] == "weight"
            assert not t.needs_baseline
    # hold needs nothing from its baseline and runs in the first phase
    assert any(t.arm == "hold" and not t.needs_baseline for t in plan.trials)


def test_cpu_preset_uses_the_paper_optimiser():
    from qkgeom.config import preset

    cpu, paper = preset("cpu"), preset("paper")
    for k in ("lr", "min_lr", "weight_decay", "beta1", "beta2", "warmup_frac"):
        assert getattr(cpu, k) == getattr(paper, k), k
    assert (cpu.lr, cpu.min_lr, cpu.weight_decay, cpu.beta1, cpu.beta2) == (
        1e-3, 1e-4, 0.1, 0.9, 0.99)
    assert paper.warmup == 200  # the paper preset's 200 of 5,000 steps ...
    assert cpu.warmup == 60  # ... is 4% of training: 60 of 1,500


def test_keys_are_deterministic_and_baselines_shared():
    a, b = plan_from("smoke"), plan_from("smoke")
    assert [t.key for t in a.trials] == [t.key for t in b.trials]
    keys = [t.key for t in a.trials]
    assert len(keys) == len(set(keys))  # the shared baseline is not run twice
    assert trial_key(4, "gaussian", "none", 0) == "d4-gaussian-none-s0"


def test_set_overrides_trial_and_spec_keys():
    p = plan_from("smoke", sets=["max_steps=10", "grid.seeds=2", "interventions.arms=[hold]"],
                  data="/some/dir", name="x")
    assert p.name == "x"
    assert all(t.config["max_steps"] == 10 for t in p.trials)
    assert all(t.config["dataset"] == "/some/dir" for t in p.trials)
    assert {t.arm for t in p.trials} == {"none", "hold"}
    assert len([t for t in p.trials if t.arm == "none"]) == 2 * 2 * 2 + 0


@pytest.mark.parametrize("sets, needle", [
    (["lrr=3"], "did you mean 'lr'"),
    (["grid.depth=[2]"], "did you mean 'depths'"),
    (["grid.depths=[a]"], "grid.depths"),
    (["grid.inits=[gauss]"], "grid.inits"),
    (["interventions.arms=[squeeze]"], "interventions.arms"),
    (["max_steps=0"], "max_steps"),
    (["n_embd=33"], "n_embd"),
    (["trial.overrides.n_layer=3"], "trial.overrides.n_layer"),
    (["grdi.depths=[1]"], "did you mean 'grid'"),
    (["noequals"], "key=value"),
])
def test_bad_specs_name_the_key(sets, needle):
    with pytest.raises(SpecError) as e:
        plan_from("smoke", sets=sets)
    assert needle in str(e.value)


def test_spec_files_yaml_and_toml(tmp_path):
    y = tmp_path / "s.yaml"
    y.write_text("name: mine\ntrial: {preset: smoke, overrides: {max_steps: 12}}\n"
                 "grid: {depths: [1], inits: [tied], seeds: 2}\n")
    p = plan_from(spec_file=y)
    assert p.name == "mine" and [t.key for t in p.trials] == ["d1-tied-none-s0",
                                                              "d1-tied-none-s1"]
    t = tmp_path / "s.toml"
    t.write_text('name = "t"\n[trial]\npreset = "smoke"\n[interventions]\ndepth = 2\n'
                 'init = "orthogonal"\narms = ["shrink"]\nseeds = [3]\n'
                 '[interventions.arm_overrides.shrink]\nshrink_to = 0.25\n')
    p = plan_from(spec_file=t)
    assert [x.key for x in p.trials] == ["d2-orthogonal-none-s3", "d2-orthogonal-shrink-s3"]
    assert p.trials[1].config["shrink_to"] == 0.25 and p.trials[0].config["shrink_to"] == 0.5
    bad = tmp_path / "b.yaml"
    bad.write_text("grid: {depths: [1], inits: [tied], seeds: 1}\nextra: 1\n")
    with pytest.raises(SpecError, match="unknown spec key 'extra'"):
        plan_from(spec_file=bad)
    with pytest.raises(SpecError, match="either --preset or --spec"):
        plan_from("smoke", spec_file=y)
    bad.write_text("grid: [1, 2\n")
    with pytest.raises(SpecError, match="cannot parse"):
        plan_from(spec_file=bad)


def test_baseline_fraction_arms_wait_for_their_baseline():
    spec = {"trial": {"preset": "smoke"},
            "interventions": {"depth": 2, "init": "gaussian", "arms": ["shrink"], "seeds": 1,
                              "arm_overrides": {"shrink": {"target_mode": "baseline_fraction"}}}}
    p = build_plan(spec)
    arm = p.by_key()["d2-gaussian-shrink-s0"]
    assert arm.needs_baseline and arm.baseline_key == "d2-gaussian-none-s0"
    cfg = fill_baseline_pr(arm.config, [(0, 0, 30.0), (0, 1, 31.0), (20, 0, 9.0), (20, 1, 8.0)])
    assert cfg["baseline_pr"] == [[0, [30.0, 31.0]], [20, [9.0, 8.0]]]
    with pytest.raises(SpecError, match="no layer-level pr_wk"):
        fill_baseline_pr(arm.config, [])
    # the activation-site arm follows the baseline's key-activation PR instead
    spec["interventions"]["arms"] = ["shrink_act"]
    spec["interventions"]["arm_overrides"] = {"shrink_act": {"target_mode": "baseline_fraction"}}
    act = build_plan(spec).by_key()["d2-gaussian-shrink_act-s0"]
    assert act.needs_baseline and act.config["site"] == "activation"
    with pytest.raises(SpecError, match="no layer-level pr_k rows"):
        fill_baseline_pr(act.config, [])


def test_sweep_module_and_help_do_not_import_ray():
    code = ("import sys, qkgeom.plan.spec, qkgeom.cli; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_relative_data_path_becomes_absolute_for_ray_workers(tmp_path, monkeypatch):
    from qkgeom.plan.spec import plan_from

    (tmp_path / "corpus.txt").write_text("abc" * 100)
    monkeypatch.chdir(tmp_path)
    plan = plan_from("smoke", data="corpus.txt")
    assert {t.config["dataset"] for t in plan.trials} == {str(tmp_path / "corpus.txt")}
    # names that are not local paths (a hub dataset) pass through unchanged
    plan = plan_from("smoke", data="wikitext-2")
    assert {t.config["dataset"] for t in plan.trials} == {"wikitext-2"}


STUDIES = sorted((Path(__file__).resolve().parents[1] / "studies").glob("*.yaml"))


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.name)
def test_every_study_file_validates(path):
    from click.testing import CliRunner

    from qkgeom.cli import main

    plan = plan_from(spec_file=path)
    assert plan.name == path.stem  # one sweep name per file: cells never collide in a database
    r = CliRunner().invoke(main, ["sweep", "--dry-run", "--spec", str(path)])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    grid_only = path.stem.endswith("-grid")
    assert d["n_trials"] == len(plan.trials)
    cells = len(plan.spec.get("cells") or {}) or 1  # studies/ladder.yaml: six cells
    # an -arms file: the arms and their baselines, as many waiting as in a full cell: the
    # two baseline-fraction arms (shrink, shrink_act) x 8 paired seeds wait for theirs
    assert d["n_after_baselines"] == (0 if grid_only else 16 * cells)
    assert set(d["power"]) >= ({"2-gap"} if grid_only else {"2-gap", "4-shrink"})


def test_ladder_varies_only_width_context_and_lr():
    ladder = [(p, plan_from(spec_file=p)) for p in STUDIES if p.name.startswith("ladder-")]
    cells, grid_cells, arm_cells = set(), set(), set()
    shapes = set()
    cpu = {t.key: t.config for t in plan_from("cpu").trials}
    cpu_grid = {k for k, c in cpu.items() if c["arm"] == "none"
                and not (c["n_layer"] == 4 and c["init"] == "gaussian" and c["seed"] > 1)}
    assert len(cpu_grid) == 18  # depths 2-4 x three inits x seeds 0, 1
    cpu_arms = {k for k, c in cpu.items() if c["n_layer"] == 4 and c["init"] == "gaussian"}
    assert len(cpu_arms) == 32  # none, hold, shrink, shrink_act x seeds 0-7
    for path, plan in ladder:
        c = plan.trials[0].config
        assert c["min_lr"] == pytest.approx(c["lr"] / 10)
        # everything but the factors is the cpu study's design (a -grid file: its grid)
        keys = {t.key for t in plan.trials}
        if path.stem.endswith("-grid"):
            grid_cells.add((c["n_embd"], c["block_size"], c["lr"]))
            assert keys == cpu_grid
        elif path.stem.endswith("-arms"):  # the cell's arms and their baselines, no grid
            arm_cells.add((c["n_embd"], c["block_size"], c["lr"]))
            assert keys == cpu_arms
        else:
            cells.add((c["n_embd"], c["block_size"], c["lr"]))
            assert keys == set(cpu)
            shapes.add(len(plan.trials))
        for t in plan.trials:
            diff = {k for k in t.config if t.config[k] != cpu[t.key][k]}
            assert diff <= {"n_embd", "block_size", "lr", "min_lr", "seed_stream"}, \
                (plan.name, t.key, diff)
    assert cells == {(e, e, lr) for e in (32, 48, 64, 96, 128) for lr in (1e-3, 3e-3)}
    assert grid_cells == {(96, 96, 1e-3), (96, 96, 3e-3), (128, 128, 1e-3)}
    assert arm_cells == {(96, 96, 1e-3), (128, 128, 1e-3)}
    assert shapes == {48}  # the cpu study: 18 grid + 6 extra baselines + 3 arms x 8
