"""The paper's claims, each beside its measured verdict: computed once, for the report
(:mod:`qkgeom.report` renders them), ``qkgeom serve`` and :meth:`qkgeom.study.Study.claims`.

Each claim function returns what it produces (a :class:`ClaimSet`: claims, report
sections and the frames it read, which later claims and the figures reuse); nothing is
appended to an argument. Verdicts are ``holds``, ``does not hold`` or ``not enough data``
by the rules in :data:`RULES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qkgeom import analysis as A
from qkgeom.errors import QkgeomError

if TYPE_CHECKING:
    from qkgeom.store import Store

HOLDS, FAILS, NO_DATA = "holds", "does not hold", "not enough data"
ALPHA = 0.05  # one-sided significance level for sign tests and CI-based verdicts
HIGH_CONFIDENCE = 0.95  # "high directional confidence"
# The paper's causal test uses five seeds; with fewer, every bootstrap mean of two or three
# same-signed deltas has that sign, so a confidence of 1.0 would mean nothing.
MIN_SEEDS = 5

RULES = [
    f"Sign tests are one-sided exact binomial tests; 'holds' needs p < {ALPHA}.",
    "Claim 2 (gap): holds if PR_Q - PR_K > 0 at the final probe in every trajectory "
    f"(the paper's 'all 54') with p < {ALPHA}; does not hold if any trajectory is <= 0.",
    "Claim 2 (slopes): holds if PR_Q slopes are positive and PR_K slopes negative in a "
    f"significant majority (sign test p < {ALPHA} each). '2-slopes' fits each trajectory "
    "from step 0; '2-slopes-collapse' fits it from the end of its initial collapse (the "
    "probe with the lowest PR_Q + PR_K in the first half of training), same rule.",
    "Claim 3: holds if the Spearman correlations of PR_K with the interaction rank and "
    "with attention entropy are both positive with a 95% bootstrap CI above 0.",
    f"Claim 4: holds if the directional confidence of the predicted sign is >= "
    f"{HIGH_CONFIDENCE}; does not hold if below; not enough data with fewer than "
    f"{MIN_SEEDS} paired seeds (the paper's design).",
    "Reality check: a contracting arm did its job if, at the site it acts on, its "
    "end-of-training value is below the paired baseline's in every seed: W_K weight PR for "
    "'shrink' (reality-check), key-activation PR_K for 'shrink_act' (reality-check-act, "
    "when the sweep has that arm); the other measure is shown beside it.",
    "Claim 5: per model, 'rises then decays' = Spearman of PR_Q - PR_K (mean over layers) "
    "vs step > 0 up to the peak and < 0 after it (>= 3 checkpoints each side of the peak, "
    "counted with it); holds if at least one model with >= 5 checkpoints rises then decays.",
]


@dataclass
class Claim:
    key: str
    paper: str
    measured: str
    verdict: str
    numbers: dict[str, Any] = field(default_factory=dict)


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
    paper = ("PR_Q - PR_K > 0 in all 54 (depth, init, layer) trajectories; one-sided sign "
             "test p = 2^-54")
    try:
        # read PR_Q/PR_K once for every summary and level
        t = A.trials(store, sweep)
        vals = A.layer_values(store, t.filter(t["arm"] == A.BASELINE_ARM)["trial_id"].to_list(),
                              ["pr_q", "pr_k"])
        units = A.pr_gap_units(store, sweep, finished_only=fin, values=vals)
        run_units = A.pr_gap_units(store, sweep, level="run", finished_only=fin, values=vals)
        reps = {s: A.sign_test(store, sweep, summary=s, finished_only=fin, units=units)
                for s in A.SUMMARIES}
        run = A.sign_test(store, sweep, summary="final", level="run", units=run_units)
        after = {s: A.sign_test(store, sweep, summary=s, finished_only=fin, units=units,
                                window="collapse") for s in ("all", "mean")}
    except QkgeomError as e:
        return ClaimSet([Claim("2-gap", paper, str(e), NO_DATA)])
    r = reps["final"].result
    all_pos = r.n > 0 and r.n_positive == r.n and r.n_zero == 0
    if r.n == 0:
        verdict = NO_DATA
    elif not all_pos:
        verdict = FAILS
    else:
        verdict = HOLDS if r.p_value < ALPHA else NO_DATA
    a, m = reps["all"].result, reps["mean"].result
    measured = (f"{r.n_positive} of {r.n} trajectories positive at the final probe, "
                f"p = {A.fmt(r.p_value)}; every probe after step 0 positive in "
                f"{a.n_positive} of {a.n}; mean over probes positive in {m.n_positive} of "
                f"{m.n}; run level (final): {run.result.n_positive} of {run.result.n} "
                f"(trial, layer) units, p = {A.fmt(run.result.p_value)}; from the end of the "
                f"initial collapse: every probe positive in {after['all'].result.n_positive} "
                f"of {after['all'].result.n}, mean positive in "
                f"{after['mean'].result.n_positive} of {after['mean'].result.n}")
    section = Section("PR_Q - PR_K sign test by depth and init (final probe, trajectories)",
                      tables=[("", reps["final"].by_cell.to_dicts())])
    neg = reps["final"].units.filter(reps["final"].units["value"] <= 0)
    if neg.height:
        section.tables.append(("trajectories with PR_Q - PR_K <= 0", neg.to_dicts()))
    claim = Claim("2-gap", paper, measured, verdict, {
        s: reps[s].result.to_dict() for s in A.SUMMARIES} | {"run_final": run.result.to_dict()}
        | {f"collapse_{s}": after[s].result.to_dict() for s in after}
        | {"collapse_points": after["all"].collapse})
    return ClaimSet([claim], [section], {"units": units, "gap_by_trend_window": {
        "start": reps, "collapse": after}})


def slope_claim(store: Store, sweep: str, fin: bool, *, units: Any = None,
                window: str = "start") -> ClaimSet:
    """Claim 2 (slopes) over one trend window. ``units``: trajectory units already read.
    Frames: ``slopes`` ({window: report})."""
    from qkgeom import stats

    key = "2-slopes" if window == "start" else f"2-slopes-{window}"
    paper = ("PR_Q expands and PR_K shrinks over training: slopes about +0.14 and -0.04 per "
             "unit of training progress (unit unknown)")
    try:
        rep = A.slopes(store, sweep, finished_only=fin, units=units, window=window)
    except QkgeomError as e:
        return ClaimSet([Claim(key, paper, str(e), NO_DATA)])
    q = stats.sign_test(rep.pr_q.slopes)
    k = stats.sign_test(rep.pr_k.slopes, predicted_sign=-1)
    if q.n == 0:
        verdict = NO_DATA
    elif q.p_value < ALPHA and k.p_value < ALPHA:
        verdict = HOLDS
    elif q.n < 5:
        verdict = NO_DATA
    else:
        verdict = FAILS
    measured = (f"PR_Q slope mean {A.fmt(rep.pr_q.mean)} (median {A.fmt(rep.pr_q.median)}), "
                f"positive in {q.n_positive} of {q.n} (p = {A.fmt(q.p_value)}); PR_K slope "
                f"mean {A.fmt(rep.pr_k.mean)} (median {A.fmt(rep.pr_k.median)}), negative in "
                f"{k.n_positive} of {k.n} (p = {A.fmt(k.p_value)}); per unit of progress = "
                f"step / max_steps; {A.window_label(window)}")
    title = "Slopes against training progress, by depth and init"
    section = Section(title if window == "start" else
                      f"{title}, from the end of the initial collapse",
                      tables=[("", rep.by_cell.to_dicts())])
    d = rep.to_dict()
    claim = Claim(key, paper, measured, verdict,
                  {"pr_q": d["pr_q"], "pr_k": d["pr_k"], "sign_pr_q_up": q.to_dict(),
                   "sign_pr_k_down": k.to_dict(), "window": window,
                   "collapse_points": d["collapse"]})
    return ClaimSet([claim], [section], {"slopes": {window: rep}})


def trend_windows_section(gap_by_window: dict[str, Any] | None,
                          slopes_by_window: dict[str, Any]) -> Section | None:
    """Claims 2-gap and 2-slopes from step 0 and from the end of the initial collapse,
    side by side with the paper's figures."""
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

    start, coll = (gw or {}).get("start", {}), (gw or {}).get("collapse", {})
    s0, s1 = sl.get("start"), sl.get("collapse")
    rows = [
        {"statistic": "PR_Q - PR_K > 0 at the final probe (trajectories)",
         "paper": "all 54", "from step 0": pos(start.get("final")),
         "from the collapse": pos(start.get("final")) + " (same probe)"},
        {"statistic": "PR_Q - PR_K > 0 at every probe in the window (after step 0)",
         "paper": "-", "from step 0": pos(start.get("all")),
         "from the collapse": pos(coll.get("all"))},
        {"statistic": "mean of PR_Q - PR_K over the window > 0",
         "paper": "-", "from step 0": pos(start.get("mean")),
         "from the collapse": pos(coll.get("mean"))},
        {"statistic": "PR_Q slope per unit of progress", "paper": "about +0.14 (expands)",
         "from step 0": slope(s0, "pr_q", 1), "from the collapse": slope(s1, "pr_q", 1)},
        {"statistic": "PR_K slope per unit of progress", "paper": "about -0.04 (shrinks)",
         "from step 0": slope(s0, "pr_k", -1), "from the collapse": slope(s1, "pr_k", -1)},
    ]
    c = (coll.get("all").collapse if coll.get("all") is not None else None) or (
        s1.collapse if s1 is not None else None)
    text = ("The collapse point of a trajectory is the probe with the lowest PR_Q + PR_K "
            "at training progress <= 0.5 (both PRs fall from their random-init values within "
            "the first probes; see `qkgeom stats slopes --from collapse`).")
    if c and c.get("n"):
        text += (f" Here it lies between step {c['step_min']} and {c['step_max']} (median "
                 f"{A.fmt(c['step_median'], 1)}) over {c['n']} trajectories.")
    return Section("Trends from step 0 and from the end of the initial collapse", text=text,
                   tables=[("", rows)])


def correlation_claim(store: Store, sweep: str, fin: bool, seed: int) -> ClaimSet:
    """Claim 3: Spearman of PR_K with the interaction rank and with entropy. Frames:
    ``points`` (the metric points read once)."""
    paper = ("Shrinking keys goes with a narrower QK^T interaction spectrum and more peaked "
             "(lower-entropy) attention")
    pairs = [("pr_k", "qk_erank"), ("pr_k", "entropy"), ("qk_erank", "entropy"),
             ("logit_erank", "entropy")]
    res: dict[str, Any] = {}
    rows = []
    try:  # one read for all four metrics
        pts = A.metric_points(store, sweep, ["pr_k", "qk_erank", "entropy", "logit_erank"],
                              finished_only=fin)
    except QkgeomError as e:
        return ClaimSet([Claim("3", paper, str(e), NO_DATA)])
    for x, y in pairs:
        try:
            xy = A.correlation_points(store, sweep, x=x, y=y, points=pts)
            r = A.correlate(store, sweep, x=x, y=y, n_boot=1000, seed=seed, points=xy)
        except QkgeomError as e:
            res[f"{y}~{x}"] = {"error": str(e)}
            continue
        res[f"{y}~{x}"] = r.to_dict()
        o = r.overall
        for depth, part in [("all", o.to_dict())] + [(str(b["depth"]), b) for b in r.by_depth]:
            rows.append({"x": x, "y": y, "depth": depth, "trials": part["n_clusters"],
                         "n": part["n"], "rho": part["rho"], "ci_low": part["ci_low"],
                         "ci_high": part["ci_high"]})
    main = [res.get("qk_erank~pr_k", {}), res.get("entropy~pr_k", {})]
    if any("error" in m or not m for m in main):
        verdict = NO_DATA
        measured = "; ".join(m.get("error", "missing") for m in main if "error" in m or not m)
    else:
        few = [m for m in main if m["n_clusters"] < 3]  # rho, but too few trials for a CI
        ok = all(m["ci_low"] is not None and m["ci_low"] > 0 for m in main)
        verdict = NO_DATA if few else HOLDS if ok else FAILS
        measured = "; ".join(f"Spearman({y}, {x}) = {A.fmt(res[f'{y}~{x}']['rho'])} "
                             f"[{A.fmt(res[f'{y}~{x}']['ci_low'])}, "
                             f"{A.fmt(res[f'{y}~{x}']['ci_high'])}]"
                             for x, y in pairs if "rho" in res.get(f"{y}~{x}", {}))
        measured += (" (one point per trial, probe and layer; CI from a cluster bootstrap "
                     f"over {main[0]['n_clusters']} trials"
                     + ("; fewer than 3 trials give no CI" if few else "") + ")")
    section = Section("Correlations across probes and runs (Spearman, 95% cluster-bootstrap "
                      "CI over trials)", tables=[("", rows)], figure="correlation",
                      caption="attention entropy against key-activation PR_K")
    return ClaimSet([Claim("3", paper, measured, verdict, res)], [section], {"points": pts})


# arm -> (claim key, the paper's claim, site, how its target is defined)
ARM_CLAIMS = {
    "shrink": ("4-shrink", "Shrink arm sharpens attention (lower entropy than the baseline) "
               "with high directional confidence", "W_K weights"),
    "shrink_act": ("4-shrink_act", "Shrinking the keys as attention sees them (activation "
                   "site) sharpens attention (lower entropy than the baseline)",
                   "key activations"),
    "hold": ("4-hold", "Hold arm makes attention softer (higher entropy) than the "
             "unconstrained baseline", "W_K weights"),
}


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


def _lower(v: dict[str, Any] | None) -> str:
    if not v or "error" in v:
        return "-" if not v else "missing"
    return (f"{A.fmt(v['arm_mean'], 3)} vs {A.fmt(v['baseline_mean'], 3)}, lower in "
            f"{v['n_lower']} of {v['n_seeds']}")


def intervention_claims(store: Store, sweep: str, fin: bool, seed: int, n_boot: int
                        ) -> ClaimSet:
    """Claim 4 per arm (entropy, directional confidence) and the reality checks."""
    present = set(A.trials(store, sweep)["arm"].to_list())
    arms = ["shrink", "hold"] + (["shrink_act"] if "shrink_act" in present else [])
    claims = []
    sections = []
    keys: dict[str, Any] = {}
    rows, job = [], []
    for arm in arms:
        key, paper, site = ARM_CLAIMS[arm]
        try:
            rep = A.directional(store, sweep, arm=arm, n_boot=n_boot, seed=seed,
                                finished_only=fin)
        except QkgeomError as e:
            claims.append(Claim(key, paper, str(e), NO_DATA))
            continue
        r = rep.result
        if r.n_seeds < MIN_SEEDS:
            verdict = NO_DATA
        else:
            verdict = HOLDS if r.directional_confidence >= HIGH_CONFIDENCE else FAILS
        sign = "lower" if r.predicted_sign < 0 else "higher"
        kc = rep.key_check or {}
        measured = (f"mean entropy delta {A.fmt(r.mean_delta)} nats over {r.n_seeds} paired "
                    f"seeds, 95% BCa CI [{A.fmt(r.ci_low)}, {A.fmt(r.ci_high)}]; directional "
                    f"confidence {A.fmt(r.directional_confidence)} ({sign}); {r.n_agree} of "
                    f"{r.n_seeds} seeds {sign}, sign test p = {A.fmt(r.sign_test_p)}"
                    + (f" (fewer than {MIN_SEEDS} seeds)" if r.n_seeds < MIN_SEEDS else "")
                    + f"; achieved: W_K PR {_lower(kc.get('pr_wk'))}, key PR_K "
                    f"{_lower(kc.get('pr_k'))} (arm vs baseline)")
        claims.append(Claim(key, paper, measured, verdict, rep.to_dict()))
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
    where = ("its key activations (PR_K)" if arm == "shrink_act" else
             "its W_K weight spectrum (PR)")
    why = ("holding W_K's spectrum did not stop the collapse of the key-activation PR_K, so "
           "the weight site alone may not move the keys attention sees" if arm == "shrink_act"
           else "the paper's small run found a 0.5 x step-0 target is a weaker 'hold', not a "
           "contraction")
    paper = f"'{arm}' should contract {where} relative to the unconstrained baseline ({why})"
    kc = keys.get(arm)
    if not kc:
        return Claim(key, paper, f"no paired {arm}/baseline runs", NO_DATA)
    parts, ok, missing = [], True, False
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
            ok &= v["n_lower"] == v["n_seeds"] and v["n_seeds"] > 0
    hold = keys.get("hold") or {}
    if arm == "shrink" and "pr_wk" in hold and "error" not in hold["pr_wk"]:
        v = hold["pr_wk"]
        parts.append(f"(hold: W_K weight PR {A.fmt(v['arm_mean'])} vs baseline "
                     f"{A.fmt(v['baseline_mean'])})")
    verdict = NO_DATA if missing else (HOLDS if ok else FAILS)
    return Claim(key, paper, "; ".join(parts), verdict, {arm: kc, "hold": keys.get("hold")})


def pretrained_claim(store: Store) -> ClaimSet:
    """Claim 5: the PR_Q - PR_K trend over pretrained checkpoints."""
    paper = ("In pretrained families (Pythia checkpoints, GPT-2, SmolLM2) the monotonic "
             "PR_Q - PR_K trend is not universal: it appears early and decays over a full "
             "pretraining run; the interaction-rank/entropy link stays visible in several")
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
    trend = [r for r in res.values() if "error" not in r and r["n_checkpoints"] >= 5]
    if not trend:
        verdict, measured = NO_DATA, "no model has at least 5 checkpoints with a known step"
    else:
        n_rd = sum(r["rises_then_decays"] for r in trend)
        verdict = HOLDS if n_rd > 0 else FAILS
        measured = (f"{n_rd} of {len(trend)} models with >= 5 checkpoints rise then decay; "
                    + "; ".join(f"{m}: rho {A.fmt(r['rho'])}, peak at step {r['peak_step']}"
                                for m, r in res.items() if "error" not in r))
        links = [(m, r["rank_entropy_link"]) for m, r in res.items()
                 if "error" not in r and r.get("rank_entropy_link")]
        if links:
            measured += "; rank-entropy link (Spearman qk_erank vs entropy): " + ", ".join(
                f"{m} {A.fmt(lk['rho'])} [{A.fmt(lk['ci_low'])}, {A.fmt(lk['ci_high'])}]"
                for m, lk in links)
    return ClaimSet([Claim("5", paper, measured, verdict, res)],
                    [Section("Pretrained checkpoints: PR_Q - PR_K trend", tables=[("", rows)])])


def compute_claims(store: Store, sweep: str, *, seed: int = 0, n_boot: int = 10_000,
                   finished_only: bool = True) -> ClaimSet:
    """Every claim's verdict for ``sweep`` on the data stored now, in the report's order,
    with the report's sections (the trend-windows table first) and the frames read."""
    fin = finished_only
    gap = gap_claims(store, sweep, fin)
    units = gap.frames.get("units")
    by_window = [slope_claim(store, sweep, fin, units=units, window=w)
                 for w in ("start", "collapse")]
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
    return out
