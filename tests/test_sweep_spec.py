"""The sweep spec (qkgeom.sweep): presets, spec files, --set, validation, pairing. No Ray."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qkgeom.config import TrialConfig
from qkgeom.sweep import SpecError, build_plan, fill_baseline_pr, plan_from, trial_key


def test_presets_expand_to_the_study():
    smoke = plan_from("smoke")
    assert len(smoke.trials) == 9
    paper = plan_from("paper")
    grid = [t for t in paper.trials if t.baseline_key is None]
    arms = [t for t in paper.trials if t.baseline_key is not None]
    assert len(grid) == 36 + 1  # 36 geometry runs + the depth-6 gaussian baseline of seed 4
    assert len(arms) == 10 and {t.arm for t in arms} == {"hold", "shrink"}
    cpu = plan_from("cpu")
    assert len(cpu.trials) == 18 + 1 + 6
    # every trial of a preset trains for that preset's steps (qkgeom/config.py PRESETS),
    # written out here so a changed preset or a preset that is not applied fails
    expected = {"smoke": (40, 20), "cpu": (1500, 100), "paper": (5000, 250)}
    for name, plan in (("smoke", smoke), ("cpu", cpu), ("paper", paper)):
        got = {(t.config["max_steps"], t.config["probe_every"]) for t in plan.trials}
        assert got == {expected[name]}, name
    assert TrialConfig().max_steps == 5000  # the dataclass default is the paper's


def test_keys_are_deterministic_and_baselines_shared():
    a, b = plan_from("smoke"), plan_from("smoke")
    assert [t.key for t in a.trials] == [t.key for t in b.trials]
    keys = [t.key for t in a.trials]
    assert len(keys) == len(set(keys))  # the shared baseline is not run twice
    assert trial_key(4, "gaussian", "none", 0) == "d4-gaussian-none-s0"
    for t in a.trials:
        if t.arm != "none":
            base = a.by_key()[t.baseline_key]
            assert (base.depth, base.init, base.seed, base.arm) == (t.depth, t.init, t.seed,
                                                                      "none")
            # paired by seed: same config apart from the arm
            diff = {k for k in t.config if t.config[k] != base.config[k]}
            assert diff == {"arm"}


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


def test_sweep_module_and_help_do_not_import_ray():
    code = ("import sys, qkgeom.sweep, qkgeom.cli; "
            "assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_relative_data_path_becomes_absolute_for_ray_workers(tmp_path, monkeypatch):
    from qkgeom.sweep import plan_from

    (tmp_path / "corpus.txt").write_text("abc" * 100)
    monkeypatch.chdir(tmp_path)
    plan = plan_from("smoke", data="corpus.txt")
    assert {t.config["dataset"] for t in plan.trials} == {str(tmp_path / "corpus.txt")}
    # names that are not local paths (a hub dataset) pass through unchanged
    plan = plan_from("smoke", data="wikitext-2")
    assert {t.config["dataset"] for t in plan.trials} == {"wikitext-2"}
