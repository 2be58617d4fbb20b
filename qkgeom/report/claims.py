"""The paper's claims, each beside its measured verdict: computed once, for the report
(:mod:`qkgeom.report.render` renders them), ``qkgeom serve`` and :meth:`qkgeom.report.study.Study.claims`.

Each claim function returns what it produces (a :class:`ClaimSet`: claims, report
sections and the frames it read, which later claims and the figures reuse); nothing is
appended to an argument. Verdicts are ``holds``, ``not shown`` (with the power the design
had), ``contradicted`` or ``not enough data`` by the rules in :data:`RULES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qkgeom import analysis as A
from qkgeom.errors import QkgeomError
from qkgeom.report.claim_rules import RULES, calibration_header  # noqa: F401 (RULES re-exported)
from qkgeom.stats import calibration
from qkgeom.stats import rules as R
from qkgeom.stats.effects import sign_test, t_interval
from qkgeom.stats.registry import ARM_SITES, PRIMARY_ARM, at_design, spec

if TYPE_CHECKING:
    from qkgeom.store import Store

HOLDS, NOT_SHOWN, CONTRADICTED, NO_DATA = R.HOLDS, R.NOT_SHOWN, R.CONTRADICTED, R.NO_DATA
ALPHA = R.ALPHA  # the error rate every rule is calibrated to (docs/statistics.md)
HIGH_CONFIDENCE = 0.95  # the paper's "high directional confidence" (reported, not a rule)
# Reality checks need every seed in the predicted direction to be unlikely by chance
# (2^-n < ALPHA, stats.rules.all_lower_rule); claim 4's family needs
# stats.rules.min_seeds(arms) seeds.
MIN_SEEDS = R.min_seeds(1)

@dataclass
class Claim:
    key: str
    paper: str
    measured: str
    verdict: str
    numbers: dict[str, Any] = field(default_factory=dict)
    rule_error: str = ""  # the rule's measured false-holds rate and power (calibration)
    size: str = ""  # the rule's false-holds rate at this study's design
    power: str = ""  # its power at this design, at a stated effect

    def verdict_text(self) -> str:
        """The verdict, with the power the design had when it is "not shown"."""
        return (f"{self.verdict} (power {self.power})" if self.verdict == NOT_SHOWN
                and self.power else self.verdict)


@dataclass
class Section:
    title: str
    text: str = ""
    tables: list[tuple[str, list[dict[str, Any]]]] = field(default_factory=list)
    figure: str | None = None  # figure stem
    caption: str = ""


@dataclass
class ClaimSet:
    """What a claim computation produces: its claims, the report sections that show them
    and the frames it read (``units``, ``points``, ...) for later claims and figures."""

    claims: list[Claim] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)
    frames: dict[str, Any] = field(default_factory=dict)

    def add(self, other: ClaimSet) -> None:
        self.claims += other.claims
        self.sections += other.sections
        self.frames |= other.frames


# --------------------------------------------------------------------------- claims


def gap_claims(store: Store, sweep: str, fin: bool) -> ClaimSet:
    """Claim 2 (gap): the sign test of PR_Q - PR_K, final probe and over trend windows.
    Frames: ``units`` (trajectory units), ``gap_by_trend_window`` (sign-test reports by
    window and summary)."""
    paper = spec("2-gap").paper
    try:
        # read PR_Q/PR_K once for every summary and level
        t = A.sweep_trials(store, sweep)
        vals = A.layer_values(store, t.filter(t["arm"] == A.BASELINE_ARM)["trial_id"].to_list(),
                              ["pr_q", "pr_k"])
        units = A.pr_gap_units(store, sweep, finished_only=fin, values=vals)
        run_units = A.pr_gap_units(store, sweep, level="run", finished_only=fin, values=vals)
        reps = {s: A.sign_test(store, sweep, summary=s, finished_only=fin, units=units)
                for s in A.SUMMARIES}
        run = A.sign_test(store, sweep, summary="final", level="run", units=run_units)
        after = {s: A.sign_test(store, sweep, summary=s, finished_only=fin, units=units,
                                window="late") for s in ("all", "mean")}
    except QkgeomError as e:
        return ClaimSet([Claim("2-gap", paper, str(e), NO_DATA)])
    r = reps["final"].result
    rf = A.summarise_gap(run_units, summary="final", level="run")
    seed_gaps = R.seed_means(rf["value"].to_numpy(), rf["seed"].to_numpy())
    by_seed = sign_test(seed_gaps)
    verdict = R.seed_gap_rule(reps["final"].units["value"].to_numpy(), seed_gaps)
    a, m = reps["all"].result, reps["mean"].result
    measured = (f"{r.n_positive} of {r.n} trajectories positive at the final probe, "
                f"p = {A.fmt(r.p_value)} (the paper's statistic); the verdict's unit, the "
                f"seed: mean final gap positive in {by_seed.n_positive} of {by_seed.n} "
                f"seeds, sign test p = {A.fmt(by_seed.p_value)}; every probe after step 0 positive in "
                f"{a.n_positive} of {a.n}; mean over probes positive in {m.n_positive} of "
                f"{m.n}; run level (final): {run.result.n_positive} of {run.result.n} "
                f"(trial, layer) units, p = {A.fmt(run.result.p_value)}; from progress "
                f"{R.LATE_FROM:g}: every probe positive in {after['all'].result.n_positive} "
                f"of {after['all'].result.n}, mean positive in "
                f"{after['mean'].result.n_positive} of {after['mean'].result.n}")
    section = Section("PR_Q - PR_K sign test by depth and init (final probe, trajectories)",
                      tables=[("", reps["final"].by_cell.to_dicts())])
    neg = reps["final"].units.filter(reps["final"].units["value"] <= 0)
    if neg.height:
        section.tables.append(("trajectories with PR_Q - PR_K <= 0", neg.to_dicts()))
    claim = Claim("2-gap", paper, measured, verdict, {
        s: reps[s].result.to_dict() for s in A.SUMMARIES} | {"run_final": run.result.to_dict()}
        | {f"late_{s}": after[s].result.to_dict() for s in after}
        | {"by_seed": by_seed.to_dict() | {"seed_means": seed_gaps.tolist()}})
    return ClaimSet([claim], [section], {"units": units, "run_units": run_units,
                                         "gap_by_trend_window": {"start": reps, "late": after}})


def slope_claim(store: Store, sweep: str, fin: bool, *, units: Any = None,
                window: str = "start", run_units: Any = None) -> ClaimSet:
    """Claim 2 (slopes) over one trend window, decided over seeds (each seed's mean slope
    over its (trial, layer) units). ``units`` / ``run_units``: trajectory and run units
    already read. Frames: ``slopes`` ({window: report})."""
    from qkgeom import stats

    key = "2-slopes" if window == "start" else f"2-slopes-{window}"  # 2-slopes-late
    paper = spec(key).paper
    try:
        rep = A.slopes(store, sweep, finished_only=fin, units=units, window=window)
        run = A.slopes(store, sweep, level="run", finished_only=fin, units=run_units,
                       window=window).table
    except QkgeomError as e:
        return ClaimSet([Claim(key, paper, str(e), NO_DATA)])
    q = stats.sign_test(rep.pr_q.slopes)
    k = stats.sign_test(rep.pr_k.slopes, predicted_sign=-1)
    sq, sk = (R.seed_means(run[c].to_numpy(), run["seed"].to_numpy())
              for c in ("slope_pr_q", "slope_pr_k"))
    q_s, k_s = stats.sign_test(sq), stats.sign_test(sk, predicted_sign=-1)
    verdict = R.seed_slopes_rule(sq, sk)
    measured = (f"PR_Q slope mean {A.fmt(rep.pr_q.mean)} (median {A.fmt(rep.pr_q.median)}), "
                f"positive in {q.n_positive} of {q.n} (p = {A.fmt(q.p_value)}); PR_K slope "
                f"mean {A.fmt(rep.pr_k.mean)} (median {A.fmt(rep.pr_k.median)}), negative in "
                f"{k.n_positive} of {k.n} (p = {A.fmt(k.p_value)}) trajectories; the "
                f"verdict's unit, the seed: mean PR_Q slope positive in {q_s.n_positive} of "
                f"{q_s.n} seeds (p = {A.fmt(q_s.p_value)}), mean PR_K slope negative in "
                f"{k_s.n_positive} of {k_s.n} (p = {A.fmt(k_s.p_value)}); per unit of "
                f"progress = step / max_steps; {A.window_label(window)}")
    title = "Slopes against training progress, by depth and init"
    section = Section(title if window == "start" else f"{title}, {A.window_label(window)}",
                      tables=[("", rep.by_cell.to_dicts())])
    d = rep.to_dict()
    claim = Claim(key, paper, measured, verdict,
                  {"pr_q": d["pr_q"], "pr_k": d["pr_k"], "sign_pr_q_up": q.to_dict(),
                   "sign_pr_k_down": k.to_dict(), "window": window,
                   "by_seed": {"pr_q_up": q_s.to_dict(), "pr_k_down": k_s.to_dict(),
                               "pr_q_seed_means": sq.tolist(), "pr_k_seed_means": sk.tolist()}})
    return ClaimSet([claim], [section], {"slopes": {window: rep}})


def trend_windows_section(gap_by_window: dict[str, Any] | None,
                          slopes_by_window: dict[str, Any]) -> Section | None:
    """Claims 2-gap and 2-slopes from step 0 and from the pre-specified late window, side
    by side with the paper's figures."""
    gw, sl = gap_by_window, slopes_by_window
    if not gw and not sl:
        return None

    def pos(r: Any) -> str:
        return f"{r.result.n_positive} of {r.result.n}" if r is not None else "-"

    def slope(rep: Any, m: str, sign: int) -> str:
        if rep is None:
            return "-"
        r = getattr(rep, m)
        arr = [v for v in r.slopes if v == v]
        n_ok = sum(1 for v in arr if v * sign > 0)
        word = "positive" if sign > 0 else "negative"
        return f"mean {A.fmt(r.mean)}, {word} in {n_ok} of {r.n}"

    start, coll = (gw or {}).get("start", {}), (gw or {}).get("late", {})
    s0, s1 = sl.get("start"), sl.get("late")
    late = f"from progress {R.LATE_FROM:g}"
    rows = [
        {"statistic": "PR_Q - PR_K > 0 at the final probe (trajectories)",
         "paper": "all 54", "from step 0": pos(start.get("final")),
         late: pos(start.get("final")) + " (same probe)"},
        {"statistic": "PR_Q - PR_K > 0 at every probe in the window (after step 0)",
         "paper": "-", "from step 0": pos(start.get("all")),
         late: pos(coll.get("all"))},
        {"statistic": "mean of PR_Q - PR_K over the window > 0",
         "paper": "-", "from step 0": pos(start.get("mean")),
         late: pos(coll.get("mean"))},
        {"statistic": "PR_Q slope per unit of progress", "paper": "about +0.14 (expands)",
         "from step 0": slope(s0, "pr_q", 1), late: slope(s1, "pr_q", 1)},
        {"statistic": "PR_K slope per unit of progress", "paper": "about -0.04 (shrinks)",
         "from step 0": slope(s0, "pr_k", -1), late: slope(s1, "pr_k", -1)},
    ]
    text = (f"The late window starts at training progress {R.LATE_FROM:g} in every "
            "trajectory, fixed before the data are seen (after the warm-up and the paper's "
            "initial collapse). It replaces a window that began at each trajectory's own "
            "minimum of PR_Q + PR_K, which biases every later slope upward on flat noise "
            "(docs/statistics.md, 'Calibration'); `qkgeom stats slopes --from collapse` still "
            "shows that one, descriptively.")
    return Section(f"Trends from step 0 and from progress {R.LATE_FROM:g}", text=text,
                   tables=[("", rows)])


CORRELATION_PAIRS = [("pr_k", "qk_erank"), ("pr_k", "entropy"), ("qk_erank", "entropy"),
                     ("token_erank", "entropy")]


def _correlation_rows(pts: Any, x: str, y: str, seed: int) -> tuple[dict[str, Any],
                                                                     list[dict[str, Any]]]:
    """One pair: the verdict's within-stratum correlation on the baseline after step 0, the
    pooled Spearman beside it, and each intervention arm on its own."""
    import polars as pl

    after = pts.filter(pl.col("step") > 0)
    base = after.filter(pl.col("arm") == A.BASELINE_ARM)
    w = A.matched_progress_correlation(base, x=x, y=y, seed=seed)
    res: dict[str, Any] = {"within": w.to_dict()}
    rows = [{"x": x, "y": y, "trials": f"{A.BASELINE_ARM} (the verdict)",
             "how": "across trials at the same progress (loss reached), depth and layer", "n_trials": w.n_trials,
             "rho": w.rho, "p (one-sided)": w.p_value, "ci_low": None, "ci_high": None}]
    try:
        xy = base.drop_nulls([x, y])
        if xy.height < 3:
            raise QkgeomError(f"fewer than 3 baseline points with {x} and {y}")
        pooled = A.correlate(None, "", x=x, y=y, n_boot=1000, seed=seed,  # type: ignore
                             points=xy, depth_ci=False).overall
        res["pooled"] = pooled.to_dict()
        rows.append({"x": x, "y": y, "trials": A.BASELINE_ARM,
                     "how": "pooled over steps > 0 and layers (descriptive)",
                     "n_trials": pooled.n_clusters, "rho": pooled.rho, "p (one-sided)": None,
                     "ci_low": pooled.ci_low, "ci_high": pooled.ci_high})
    except QkgeomError as e:
        res["pooled"] = {"error": str(e)}
    for arm in sorted(set(after["arm"].to_list()) - {A.BASELINE_ARM}):
        r = A.matched_progress_correlation(after.filter(pl.col("arm") == arm), x=x, y=y, seed=seed)
        res[f"arm {arm}"] = r.to_dict()
        rows.append({"x": x, "y": y, "trials": arm, "how": "across seeds at the same progress "
                     "(loss reached) and layer", "n_trials": r.n_trials, "rho": r.rho,
                     "p (one-sided)": r.p_value, "ci_low": None, "ci_high": None})
    return res, rows


def correlation_claim(store: Store, sweep: str, fin: bool, seed: int) -> ClaimSet:
    """Claim 3: PR_K with the interaction rank and with entropy, across baseline trials at
    the same point of training (stats.rules.trial_permutation_p). Frames: ``points``."""
    paper = spec("3").paper
    known = set(A.known_metrics(store))
    metrics = [m for m in ("pr_k", "qk_erank", "entropy", "token_erank") if m in known]
    try:  # one read for all the metrics
        pts = A.metric_points(store, sweep, metrics, finished_only=fin)
    except QkgeomError as e:
        return ClaimSet([Claim("3", paper, str(e), NO_DATA)])
    res: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for x, y in CORRELATION_PAIRS:
        if x not in pts.columns or y not in pts.columns:
            continue
        try:
            res[f"{y}~{x}"], part = _correlation_rows(pts, x, y, seed)
        except QkgeomError as e:
            res[f"{y}~{x}"] = {"error": str(e)}
            continue
        rows += part
    main = [res.get("qk_erank~pr_k", {}).get("within"), res.get("entropy~pr_k", {}).get("within")]
    if any(m is None or m["min_p"] >= ALPHA for m in main):
        verdict = NO_DATA
        measured = ("too few baseline trials with PR_K, the interaction rank and entropy "
                    f"after step 0 for a permutation p below {ALPHA} (4 in one depth, or 3 "
                    "in each of two)")
    elif any(m["rho"] != m["rho"] for m in main):  # NaN: nothing varies across trials
        verdict = NO_DATA
        measured = ("PR_K, the interaction rank or entropy does not vary across baseline "
                    "trials at the same progress, depth and layer: no correlation to test")
    else:
        verdict = R.both_rule([m["p_value"] for m in main],
                              p_opposite=[m.get("p_opposite", 1.0) for m in main])
        measured = "; ".join(
            f"matched-progress Spearman({y}, {x}) = {A.fmt(res[f'{y}~{x}']['within']['rho'])}, "
            f"p = {A.fmt(res[f'{y}~{x}']['within']['p_value'])}"
            + (f" (pooled {A.fmt(res[f'{y}~{x}']['pooled']['rho'])})"
               if "rho" in res[f"{y}~{x}"].get("pooled", {}) else "")
            for x, y in CORRELATION_PAIRS[:2])
        measured += (f" (baseline arm, steps > 0, {main[0]['n_trials']} trials, "
                     f"{main[0]['n_strata']} (progress level, depth, layer) strata; p from "
                     f"{main[0]['n_perm']} permutations of trials within depth)")
    section = Section("Correlations: across trials at the same training progress (validation loss "
                      "reached), depth and layer (the "
                      "verdict), pooled (descriptive), and each arm on its own",
                      tables=[("", rows)], figure="correlation",
                      caption="attention entropy against key-activation PR_K")
    return ClaimSet([Claim("3", paper, measured, verdict, res)], [section], {"points": pts})


# arm -> (claim key, the paper's claim, the site it acts on), from the registry
ARM_CLAIMS = {arm: (f"4-{arm}", spec(f"4-{arm}").paper, site)
              for arm, site in ARM_SITES.items()}


def _arm_target(store: Store, sweep: str, arm: str) -> str:
    """How the arm's target was defined, from its trials' configs."""
    cfgs = [r["config"] for r in A.trial_rows(store, sweep) if r["arm"] == arm]
    if not cfgs:
        return "-"
    c = cfgs[0]
    if arm == "hold":
        return "the layer's step-0 PR"
    mode, f = c.get("target_mode"), c.get("shrink_to")
    what = "key PR_K" if c.get("site") == "activation" else "W_K PR"
    sched = c.get("shrink_schedule", "linear")
    if mode == "baseline_fraction":
        return f"{A.fmt(f, 2)} x the paired baseline's {what} at the same step ({sched})"
    if mode == "absolute":
        return f"step-0 PR -> {A.fmt(f, 2)} ({sched})"
    return f"{A.fmt(f, 2)} x the step-0 PR ({sched})"


def _adjusted(fam: dict[str, Any]) -> str:
    """How an arm's p was adjusted: alone (the primary), Holm over the secondaries, or
    Holm over the whole family."""
    if fam["role"] == "primary":
        return "tested alone (the primary arm)"
    over = (f"the {fam['family'] - 1} secondary arms" if fam["role"] == "secondary"
            else f"{fam['family']} arms")
    return f"Holm-adjusted over {over} p = {A.fmt(fam['p_holm'])}"


def _lower(v: dict[str, Any] | None) -> str:
    if not v or "error" in v:
        return "-" if not v else "missing"
    return (f"{A.fmt(v['arm_mean'], 3)} vs {A.fmt(v['baseline_mean'], 3)}, lower in "
            f"{v['n_lower']} of {v['n_seeds']}")


def intervention_claims(store: Store, sweep: str, fin: bool, seed: int, n_boot: int
                        ) -> ClaimSet:
    """Claim 4 per arm (entropy, directional confidence) and the reality checks."""
    present = set(A.sweep_trials(store, sweep)["arm"].to_list())
    arms = ["shrink", "hold"] + (["shrink_act"] if "shrink_act" in present else [])
    claims = []
    sections = []
    keys: dict[str, Any] = {}
    rows, job = [], []
    found: dict[str, Any] = {}
    for arm in arms:
        key, paper, _ = ARM_CLAIMS[arm]
        try:
            found[arm] = A.directional(store, sweep, arm=arm, n_boot=n_boot, seed=seed,
                                       finished_only=fin)
        except QkgeomError as e:
            claims.append(Claim(key, paper, str(e), NO_DATA))
    family = R.arm_family_rule({a: rep.deltas.table["delta"].to_numpy()
                                for a, rep in found.items()},
                               {a: rep.result.predicted_sign for a, rep in found.items()},
                               primary=PRIMARY_ARM)
    for arm, rep in found.items():
        key, paper, site = ARM_CLAIMS[arm]
        r, fam = rep.result, family[arm]
        verdict = fam["verdict"]
        sign = "lower" if r.predicted_sign < 0 else "higher"
        kc = rep.key_check or {}
        role = {"primary": "the primary arm", "secondary": "a secondary arm"}.get(
            fam["role"], f"a family of {fam['family']} arms")
        few = (f" ({role} needs >= {fam['min_seeds']} paired seeds to reach alpha)"
               if fam["n_seeds"] < fam["min_seeds"] else
               " (a secondary arm: not tested, the primary did not hold)"
               if fam["role"] == "secondary" and not fam["gate_open"] else "")
        t_lo, t_hi = t_interval(rep.deltas.table["delta"].to_numpy())
        measured = (f"mean entropy delta {A.fmt(r.mean_delta)} nats over {r.n_seeds} paired "
                    f"seeds, 95% t interval [{A.fmt(t_lo)}, {A.fmt(t_hi)}] (bootstrap BCa "
                    f"[{A.fmt(r.ci_low)}, {A.fmt(r.ci_high)}]); {r.n_agree} of "
                    f"{r.n_seeds} seeds {sign}; sign-flip p = {A.fmt(fam['p'])}, "
                    f"{_adjusted(fam)}{few}; directional "
                    f"confidence {A.fmt(r.directional_confidence)} ({sign}; the paper's "
                    f"figure); achieved: W_K PR {_lower(kc.get('pr_wk'))}, key PR_K "
                    f"{_lower(kc.get('pr_k'))} (arm vs baseline)")
        rep_d = rep.to_dict() | {"family_test": fam, "t_ci": [t_lo, t_hi]}
        claims.append(Claim(key, paper, measured, verdict, rep_d))
        keys[arm] = rep.key_check
        for p in rep.deltas.table.to_dicts():
            rows.append({"arm": arm, **{k: p[k] for k in ("depth", "init", "seed", "arm_value",
                                                          "baseline_value", "delta")}})
        tl = [x for x in A.test_loss_pairs(store, sweep, arm=arm)
              if x["arm_test_loss"] is not None and x["baseline_test_loss"] is not None]
        job.append({"arm": arm, "site": site, "target": _arm_target(store, sweep, arm),
                    "entropy verdict": f"{verdict} ({sign} in {r.n_agree} of {r.n_seeds})",
                    "W_K PR: arm vs baseline": _lower(kc.get("pr_wk")),
                    "key PR_K: arm vs baseline": _lower(kc.get("pr_k")),
                    "test loss: arm vs baseline": (
                        f"{A.fmt(sum(x['arm_test_loss'] for x in tl) / len(tl), 3)} vs "
                        f"{A.fmt(sum(x['baseline_test_loss'] for x in tl) / len(tl), 3)} "
                        f"({len(tl)} seeds)" if tl else "-")})
    if job:
        sections.append(Section(
            "Did each arm do its job? Achieved key geometry beside the entropy verdict",
            text="End of training (mean over the last probes and layers), arm vs its paired "
                 "baseline of the same seed; 'lower in k of n' counts seeds.",
            tables=[("", job)]))
    if rows:
        sections.append(Section("Intervention: end-of-training entropy per seed (paired)",
                                tables=[("", rows)], figure="intervention",
                                caption="each arm over training: entropy, achieved W_K "
                                "weight PR and key-activation PR_K (band: min-max over seeds)"))
    claims.append(_reality_check(keys, "shrink"))
    if "shrink_act" in arms:
        claims.append(_reality_check(keys, "shrink_act"))
    return ClaimSet(claims, sections)


def _reality_check(keys: dict[str, Any], arm: str = "shrink") -> Claim:
    """Did the contracting arm lower, in every seed, the measure at the site it acts on?"""
    site_metric = "pr_k" if arm == "shrink_act" else "pr_wk"
    key = "reality-check-act" if arm == "shrink_act" else "reality-check"
    paper = spec(key).paper
    kc = keys.get(arm)
    if not kc:
        return Claim(key, paper, f"no paired {arm}/baseline runs", NO_DATA)
    parts, site, missing = [], NO_DATA, False
    for m, label in (("pr_wk", "W_K weight PR"), ("pr_k", "key-activation PR_K")):
        v = kc.get(m, {})
        if "error" in v or not v:
            missing |= m == site_metric
            parts.append(f"{label}: {v.get('error', 'missing')}")
            continue
        parts.append(f"{label}: {arm} {A.fmt(v['arm_mean'])} vs baseline "
                     f"{A.fmt(v['baseline_mean'])} (delta {A.fmt(v['mean_delta'])}, "
                     f"{A.fmt(100 * v['relative_delta'], 3)}%), lower in {v['n_lower']} of "
                     f"{v['n_seeds']} seeds" + (" [the site it acts on]"
                                                 if m == site_metric else ""))
        if m == site_metric:
            site = R.all_lower_rule(v.get("deltas", []))
    hold = keys.get("hold") or {}
    if arm == "shrink" and "pr_wk" in hold and "error" not in hold["pr_wk"]:
        v = hold["pr_wk"]
        parts.append(f"(hold: W_K weight PR {A.fmt(v['arm_mean'])} vs baseline "
                     f"{A.fmt(v['baseline_mean'])})")
    verdict = NO_DATA if missing else site
    return Claim(key, paper, "; ".join(parts), verdict, {arm: kc, "hold": keys.get("hold")})


def pretrained_claim(store: Store) -> ClaimSet:
    """Claim 5: the PR_Q - PR_K trend over pretrained checkpoints."""
    paper = spec("5").paper
    try:
        models = A.pretrained_models(store)["model"].to_list()
    except Exception:  # no pretrained tables/views in this database
        models = []
    if not models:
        return ClaimSet([Claim("5", paper, "no pretrained models measured in this database",
                               NO_DATA)])
    rows, res = [], {}
    for m in models:
        try:
            rep = A.checkpoint_trend(store, m)
        except QkgeomError as e:
            res[m] = {"error": str(e)}
            rows.append({"model": m, "note": str(e)})
            continue
        o = rep.overall
        res[m] = rep.to_dict()
        link = rep.link or {}
        rows.append({"model": m, "checkpoints": o.n_checkpoints, "rho": o.rho,
                     "peak_step": o.peak_step, "rho_early": o.rho_early, "rho_late": o.rho_late,
                     "rises_then_decays": o.rises_then_decays,
                     "layers_rise_decay": f"{sum(r['rises_then_decays'] for r in rep.by_layer)}"
                                          f"/{rep.n_layers}",
                     "rank_entropy_rho": link.get("rho")})
    trend = {m: r for m, r in res.items() if "error" not in r
             and r["n_checkpoints"] >= R.MIN_CHECKPOINTS}
    if not trend:
        verdict, measured = NO_DATA, (f"no model has at least {R.MIN_CHECKPOINTS} checkpoints "
                                      "with a known step")
    else:
        m = len(trend)
        level = R.several_level(m)
        p_rd = [R.trend_p(r.get("split_trend")) for r in trend.values()]
        p_link = [(r.get("stratified_link") or {}).get("p_value", 1.0) for r in trend.values()]
        n_rd, n_link = sum(p < level for p in p_rd), sum(p < level for p in p_link)
        v_trend, v_link = R.several_rule(p_rd), R.several_rule(p_link)
        verdict = (NO_DATA if NO_DATA in (v_trend, v_link) else
                   HOLDS if v_trend == v_link == HOLDS else NOT_SHOWN)
        measured = (f"{n_rd} of {m} models with >= {R.MIN_CHECKPOINTS} checkpoints rise then "
                    f"decay (first vs second half, p < {A.fmt(level)} against series rebuilt "
                    f"from their own increments) and {n_link} of {m} show the rank-entropy "
                    f"link (within-checkpoint Spearman, whole layers permuted, p < "
                    f"{A.fmt(level)}); 'several' needs >= 2, each model at 2 x {ALPHA} / {m}; "
                    + "; ".join(
                        f"{name}: rho early {A.fmt(r['split_trend']['rho_early'])}, late "
                        f"{A.fmt(r['split_trend']['rho_late'])}, p = "
                        f"{A.fmt(r['split_trend']['p_value'])}; link "
                        + (f"{A.fmt(r['stratified_link']['rho'])} [{A.fmt(r['stratified_link']['ci_low'])}, "
                           f"{A.fmt(r['stratified_link']['ci_high'])}], p = "
                           f"{A.fmt(r['stratified_link']['p_value'])}"
                           if r.get("stratified_link") else "-")
                        for name, r in trend.items()))
    for row in rows:
        r = res.get(row["model"], {})
        if "split_trend" in r:
            row["rises_then_decays"] = bool((r["split_trend"] or {}).get("rises_then_decays"))
            row["split_p"] = (r["split_trend"] or {}).get("p_value")
            row["link_within_rho"] = (r.get("stratified_link") or {}).get("rho")
            row["link_p"] = (r.get("stratified_link") or {}).get("p_value")
    return ClaimSet([Claim("5", paper, measured, verdict, res)],
                    [Section("Pretrained checkpoints: PR_Q - PR_K trend", tables=[("", rows)])])


def compute_claims(store: Store, sweep: str, *, seed: int = 0, n_boot: int = 10_000,
                   finished_only: bool = True) -> ClaimSet:
    """Every claim's verdict for ``sweep`` on the data stored now, in the report's order,
    with the report's sections (the trend-windows table first) and the frames read."""
    fin = finished_only
    gap = gap_claims(store, sweep, fin)
    units, run_units = gap.frames.get("units"), gap.frames.get("run_units")
    by_window = [slope_claim(store, sweep, fin, units=units, window=w, run_units=run_units)
                 for w in ("start", "late")]
    out = ClaimSet()
    for part in (gap, *by_window):
        out.add(part)
    slopes = {w: rep for part in by_window for w, rep in part.frames.get("slopes", {}).items()}
    out.frames["slopes"] = slopes
    trends = trend_windows_section(gap.frames.get("gap_by_trend_window"), slopes)
    if trends is not None:
        out.sections.insert(0, trends)
    for part in (correlation_claim(store, sweep, fin, seed),
                 intervention_claims(store, sweep, fin, seed, n_boot),
                 pretrained_claim(store)):
        out.add(part)
    record = calibration.load_record()
    for c in out.claims:
        c.rule_error = calibration.rule_error(spec(c.key).key, record, n_seeds=_seeds_of(c))
        d = at_design(c.key, c.numbers, record)
        c.size, c.power = d.size, d.power
    out.frames["calibration"] = calibration_header(record)
    return out


def grid_verdicts(store: Store, sweep: str, *, seed: int = 0,
                  finished_only: bool = True) -> dict[str, str]:
    """The verdicts of the claims the geometry grid decides alone (2-gap, the slopes,
    claim 3), without the arms, the pretrained checkpoints or any table: what a seed's
    trials say by themselves (:func:`qkgeom.report.compare.seed_stability`)."""
    gap = gap_claims(store, sweep, finished_only)
    units, run_units = gap.frames.get("units"), gap.frames.get("run_units")
    parts = [gap, *(slope_claim(store, sweep, finished_only, units=units, window=w,
                                run_units=run_units) for w in ("start", "late")),
             correlation_claim(store, sweep, finished_only, seed)]
    return {c.key: c.verdict for part in parts for c in part.claims}


def _seeds_of(c: Claim) -> int | None:
    """The paired seeds a seed-based verdict rests on (claim 4, reality checks)."""
    n = c.numbers.get("n_seeds")
    if n is not None:
        return int(n)
    for v in c.numbers.values():
        if isinstance(v, dict):
            site = v.get("pr_k" if c.key.endswith("-act") else "pr_wk")
            if isinstance(site, dict) and "n_seeds" in site:
                return int(site["n_seeds"])
    return None
