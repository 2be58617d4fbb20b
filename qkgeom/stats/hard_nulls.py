"""The hardest realistic nulls (issue 41): studies with the structure real ones have and
still no effect in the sense of the claim, for every claim the report decides, and the
rules' power at planted effects under the same structure. :func:`hard_rows` adds their
rows to :func:`qkgeom.stats.calibration.calibrate`.

The design is the ``cpu`` preset's (qkgeom/config.py and its sweep): depths 2, 3, 4 x
three inits x 2 grid seeds (18 trials), the intervention cell (depth 4, one init) with 5
paired seeds, so 3 more baseline trials (seeds 2-4) and 15 arm trials, 36 in all; 16 probes
(step 0 and every 100 of 1,500); three pretrained families (6, 12 and 24 layers: Pythia
70M / 160M / 410M). No stored study was on the machine, so sizes are the preset's.

Structures planted (each named in its row's scenario):

* a **seed effect** shared by every layer, depth and init of a seed (claim 2: an offset of
  PR_Q - PR_K, a drift of PR_Q; claim 3: per metric, independent between metrics);
* a **network drift**: a PR_Q slope shared by the layers of one trial, with PR_K really
  falling (claim 2-slopes: one half true, the other null plus the drift);
* **training speed**: per trial, a log-normal (sd 0.6) factor on the time scale of the
  collapse, shared by PR_Q, PR_K, the interaction rank and entropy;
* **fixed layer profiles** per model in each metric, not coupled (claim 5's link);
* **serial dependence** over probes or checkpoints: AR(1) with phi 0.9, a random walk;
* **models that are not independent**: checkpoint series or layer profiles sharing a
  component across models (claim 5's "several").

Rules "(retired: ...)" are the rules these nulls replaced, run for comparison.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from qkgeom.stats import rules as R

PROGRESS = np.arange(16) / 15
DEPTHS, INITS, GRID_SEEDS, ARM_SEEDS, ARM_CELL = (2, 3, 4), 3, 2, 5, (4, 0)
MODEL_LAYERS = (6, 12, 24)  # Pythia 70M, 160M, 410M


def design(grid_seeds: int = GRID_SEEDS, arm_seeds: int = ARM_SEEDS) -> np.ndarray:
    """One row per baseline (trial, layer): trial, depth, init, seed, layer."""
    trials = [(d, i, s) for d in DEPTHS for i in range(INITS) for s in range(grid_seeds)]
    trials += [(*ARM_CELL, s) for s in range(grid_seeds, arm_seeds)]
    return np.array([(t, d, i, s, la) for t, (d, i, s) in enumerate(trials)
                     for la in range(d)])


UNITS = design()
TRIAL, SEED = UNITS[:, 0], UNITS[:, 3]
_, TRAJ = np.unique(UNITS[:, [1, 2, 4]], axis=0, return_inverse=True)


def noise(rng: np.random.Generator, shape: tuple[int, ...], kind: str = "ar1",
          phi: float = 0.6, sd: float = 0.4) -> np.ndarray:
    """Series along the last axis: ``ar1`` (stationary, sd ``sd``), ``walk`` (increments
    sd ``sd``) or ``iid``."""
    if kind == "iid":
        return rng.normal(0, sd, shape)
    if kind == "walk":
        return np.cumsum(rng.normal(0, sd, shape), axis=-1)
    e = rng.normal(0, sd * math.sqrt(1 - phi * phi), shape)
    out = np.empty(shape)
    out[..., 0] = rng.normal(0, sd, shape[:-1])
    for j in range(1, shape[-1]):
        out[..., j] = phi * out[..., j - 1] + e[..., j]
    return out


# --------------------------------------------------------------------------- claim 2


def runs(rng: np.random.Generator, *, q_slope: float = 0.0, k_slope: float = 0.0,
         offset: float = 0.0, seed_offset: float = 0.0, net_offset: float = 0.0,
         seed_drift: float = 0.0, net_drift: float = 0.0, unit_drift: float = 0.0,
         speed: float = 0.0, phi: float = 0.6) -> tuple[np.ndarray, np.ndarray]:
    """PR_Q and PR_K per baseline (trial, layer) x probe: both fall from 17 to a floor
    (uniform 2-5) with time constant 0.03 / speed, then AR(1) noise (sd 0.4). Planted:
    slopes, an offset of PR_Q after the collapse, per-seed / per-trial offsets and PR_Q
    drifts (sd given), a per-unit drift shared by PR_Q and PR_K, a log-sd of speed."""
    n_u, n_t, n_s = len(UNITS), TRIAL.max() + 1, SEED.max() + 1
    v = np.exp(speed * rng.normal(size=n_t))[TRIAL][:, None]
    collapse = np.exp(-PROGRESS[None, :] * v / 0.03)
    after = 1 - collapse

    def one() -> np.ndarray:
        floor = rng.uniform(2, 5, (n_u, 1))
        return floor + (17 - floor) * collapse + noise(rng, (n_u, PROGRESS.size), phi=phi)

    q, k = one(), one()
    off = (offset + rng.normal(0, seed_offset, n_s)[SEED]
           + rng.normal(0, net_offset, n_t)[TRIAL])[:, None]
    dq = (q_slope + rng.normal(0, seed_drift, n_s)[SEED]
          + rng.normal(0, net_drift, n_t)[TRIAL])[:, None]
    shared = rng.normal(0, 1, (n_u, 1)) * unit_drift * PROGRESS
    return q + off * after + dq * PROGRESS + shared, k - k_slope * PROGRESS + shared


def _slopes(a: np.ndarray, start: int) -> np.ndarray:
    x = PROGRESS[start:] - PROGRESS[start:].mean()
    y = a[:, start:]
    return (y - y.mean(axis=1, keepdims=True)) @ x / (x @ x)


def claim2_verdicts(q: np.ndarray, k: np.ndarray) -> dict[str, str]:
    """The claim-2 rules on one study: the seed-level rules and the retired trajectory
    rules (the seeds' mean per (depth, init, layer), as the report averages them)."""
    n = TRAJ.max() + 1
    cnt = np.bincount(TRAJ, minlength=n)
    tq = np.stack([np.bincount(TRAJ, q[:, j], n) for j in range(q.shape[1])], 1) / cnt[:, None]
    tk = np.stack([np.bincount(TRAJ, k[:, j], n) for j in range(k.shape[1])], 1) / cnt[:, None]
    tgap = tq[:, -1] - tk[:, -1]
    out = {"2-gap": R.seed_gap_rule(tgap, R.seed_means(q[:, -1] - k[:, -1], SEED)),
           "2-gap (retired: trajectories)": R.gap_rule(tgap)}
    late = int(np.searchsorted(PROGRESS, R.LATE_FROM - 1e-12))
    for name, st in (("2-slopes", 0), ("2-slopes-late", late)):
        out[name] = R.seed_slopes_rule(R.seed_means(_slopes(q, st), SEED),
                                       R.seed_means(_slopes(k, st), SEED))
        out[f"{name} (retired: trajectories)"] = R.slopes_rule(_slopes(tq, st),
                                                                _slopes(tk, st))
    return out


GAP_NULLS = {"collapse-flat": {}, "collapse-shared-drift": {"unit_drift": 1.0},
             "seed offset sd 0.8 (2x a trajectory's sd)": {"seed_offset": 0.8},
             "seed offset sd 2 (the seed dominates)": {"seed_offset": 2.0},
             "network offset sd 0.8": {"net_offset": 0.8},
             "training speed log-sd 0.6": {"speed": 0.6},
             "AR(1) phi 0.9 over probes": {"phi": 0.9}}
SLOPE_NULLS = {"collapse-flat": {}, "collapse-shared-drift": {"unit_drift": 1.0},
               "PR_K falls 1/run; PR_Q flat + network drift sd 1":
                   {"k_slope": 1.0, "net_drift": 1.0},
               "PR_K falls 1/run; PR_Q flat + seed drift sd 1":
                   {"k_slope": 1.0, "seed_drift": 1.0},
               "PR_K falls 1/run; PR_Q flat, speed log-sd 0.6":
                   {"k_slope": 1.0, "speed": 0.6},
               "PR_K falls 1/run; PR_Q flat, AR(1) phi 0.9": {"k_slope": 1.0, "phi": 0.9}}
GAP_POWER = {"PR_Q 3 above PR_K": ("offset 3 (7.5 noise sd)", {"offset": 3.0}),
             "PR_Q 1 above PR_K + seed offset sd 0.8":
                 ("offset 1, seed sd 0.8", {"offset": 1.0, "seed_offset": 0.8})}
SLOPE_POWER = {"slopes +-1": ("slope 1 per run (2.5 sd)", {"q_slope": 1.0, "k_slope": 1.0}),
               "slopes +-1 + network drift sd 1": ("slope 1, network drift sd 1",
                                                   {"q_slope": 1.0, "k_slope": 1.0,
                                                    "net_drift": 1.0})}


# --------------------------------------------------------------------------- claim 3

GROUPS = ((2, 6), (3, 6), (4, 9))  # depth, baseline trials (grid + the arms' extra seeds)
STEPS = 15  # probes after step 0


def claim3_groups(rng: np.random.Generator, rho: float = 0.0, rho2: float | None = None, *,
                  speed: float = 0.0, seed_sd: float = 0.0, phi: float = 0.6,
                  loss_sd: float = 0.02) -> tuple[list[np.ndarray], ...]:
    """PR_K, interaction rank, entropy and validation loss per depth group. The metrics
    are (trials, steps, layers): a training-time trend exp(-step v / 3) with the trial's
    speed v (log-sd ``speed``) shared by the three metrics, a layer profile, trial effects
    correlated ``rho`` (rank) and ``rho2`` (entropy) with PR_K's, per-metric seed effects
    (sd ``seed_sd``, shared by a seed's trials in every depth and init), AR(1) noise over
    steps. The loss is (trials, steps): 1.5 + 2 exp(-step v / 5) with the same speed (a
    different time course from the metrics', so they are not linear in it) and AR(1) noise
    of sd ``loss_sd``."""
    steps = np.arange(1, STEPS + 1)[None, :, None]
    seeds = {d: [s for s in range(GRID_SEEDS) for _ in range(INITS)] for d, _ in GROUPS}
    seeds[ARM_CELL[0]] += list(range(GRID_SEEDS, ARM_SEEDS))
    seed_fx = rng.normal(0, seed_sd, (3, ARM_SEEDS))
    out: list[list[np.ndarray]] = [[], [], [], []]
    for depth, n in GROUPS:
        v = np.exp(speed * rng.normal(size=(n, 1, 1)))
        trend = 3 * np.exp(-steps * v / 3.0)
        u = rng.normal(0, 1, (n, 1, 1))
        w = [u] + [r * u + math.sqrt(1 - r * r) * rng.normal(0, 1, (n, 1, 1))
                   for r in (rho, rho if rho2 is None else rho2)]
        sd = np.array(seeds[depth])
        for m in range(3):
            e = np.moveaxis(noise(rng, (n, depth, STEPS), phi=phi, sd=0.5), 1, 2)
            layer = rng.normal(0, 1, (1, 1, depth))
            out[m].append(trend + layer + 0.7 * w[m] + seed_fx[m, sd][:, None, None] + e)
        out[3].append(1.5 + 2 * np.exp(-steps[..., 0] * v[..., 0] / 5.0)
                      + noise(rng, (n, STEPS), sd=loss_sd))
    return out[0], out[1], out[2], out[3]


def claim3_verdict(rng: np.random.Generator, rho: float = 0.0, rho2: float | None = None, *,
                   n_perm: int = 999, align: bool = True, **kw: Any) -> str:
    """Claim 3's rule on one simulated study: both correlations across trials at the same
    training progress (``align``; False: at the same step, the rule it replaced)."""
    xs, ys, zs, ls = claim3_groups(rng, rho, rho2, **kw)
    ps = []
    for other in (ys, zs):
        gx, gy = [], []
        for x, y, loss in zip(xs, other, ls):
            al = R.align_by_loss(x, y, loss) if align else (
                x.reshape(x.shape[0], -1), y.reshape(y.shape[0], -1))
            if al is not None:
                gx.append(al[0])
                gy.append(al[1])
        ps.append(R.trial_permutation_p(gx, gy, rng=rng, n_perm=n_perm).p_value)
    return R.both_rule(ps)


CLAIM3_NULLS = {"training speed log-sd 0.6 shared by the metrics": {"speed": 0.6},
                "seed effects sd 1 per metric, shared across depths and inits":
                    {"seed_sd": 1.0},
                "AR(1) phi 0.9 over probes": {"phi": 0.9},
                "only the rank linked (rho 0.9) + speed log-sd 0.6":
                    {"rho": 0.9, "rho2": 0.0, "speed": 0.6},
                "only entropy linked (rho 0.9) + speed log-sd 0.6":
                    {"rho": 0.0, "rho2": 0.9, "speed": 0.6},
                "only the rank linked + speed log-sd 1.0, loss noise sd 0.05":
                    {"rho": 0.9, "rho2": 0.0, "speed": 1.0, "loss_sd": 0.05}}


# --------------------------------------------------------------------------- claim 4


def speed_deltas(rng: np.random.Generator, n: int, arms: int = 3, seed_sd: float = 2.0
                 ) -> list[np.ndarray]:
    """Per-seed arm - baseline deltas when each trial's end value is a skewed function of
    its own training speed (exp(0.6 z)) plus a seed effect shared by the seed's arm and
    baseline trials; the arms share one baseline."""
    seed = rng.normal(0, seed_sd, n)
    base = np.exp(0.6 * rng.normal(size=n)) + seed
    return [np.exp(0.6 * rng.normal(size=n)) + seed - base for _ in range(arms)]


# --------------------------------------------------------------------------- claim 5


def trend_series(rng: np.random.Generator, n: int, kind: str = "iid", *,
                 models: int = 3, amplitude: float = 0.0, shared: float = 0.0
                 ) -> np.ndarray:
    """Per model (rows) a series of n checkpoints: ``iid`` N(0, 1), ``ar1`` (phi 0.9,
    sd 1) or ``walk`` (increments sd 1); ``shared``: that share of the variance common to
    every model; planted: a tent peaking at 0.4 of the series with height ``amplitude``."""
    e = noise(rng, (models, n), kind, phi=0.9, sd=1.0)
    if shared:
        e = math.sqrt(1 - shared) * e + math.sqrt(shared) * noise(rng, (1, n), kind, 0.9, 1.0)
    x = np.arange(n) / max(n - 1, 1)
    return e + amplitude * np.where(x <= 0.4, x / 0.4, (1 - x) / 0.6)


def trend_verdicts(rng: np.random.Generator, v: np.ndarray, n_perm: int = 999,
                   old: bool = False) -> dict[str, Any]:
    """Per model the new p (increments permuted) and the retired one (values permuted)."""
    sp = [R.split_trend(np.arange(v.shape[1]), row, rng=rng, n_perm=n_perm,
                        exchangeable=old) for row in v]
    old = [s.rho_early > 0 and s.rho_late < 0 and s.p_exchangeable < R.ALPHA for s in sp]
    return {"p": [R.trend_p(s) for s in sp], "old": old}


def link_data(rng: np.random.Generator, n: int, layers: int = 12, *, rho: float = 0.0,
              profile: float = 0.0, kind: str = "iid", shared: tuple[Any, Any] | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """x (interaction rank) and y (entropy) as (checkpoint, layer): a training trend and
    checkpoint effects shared by the layers, fixed layer profiles (sd ``profile``, one per
    metric, not coupled; ``shared``: profiles common to several models, over relative
    depth), noise per layer over checkpoints (``kind``), correlated ``rho`` between x and y."""
    trend = np.linspace(3, 0, n)[:, None]
    px, py = rng.normal(0, profile, (2, 1, layers))
    if shared is not None:
        at = np.linspace(0, shared[0].size - 1, layers).round().astype(int)
        px, py = px + shared[0][at], py + shared[1][at]
    e1 = noise(rng, (layers, n), kind, phi=0.9, sd=1.0).T
    e2 = rho * e1 + math.sqrt(1 - rho * rho) * noise(rng, (layers, n), kind, 0.9, 1.0).T
    return (trend + rng.normal(0, 1, (n, 1)) + px + e1,
            trend + rng.normal(0, 1, (n, 1)) + py + e2)


def link_verdict(rng: np.random.Generator, x: np.ndarray, y: np.ndarray, n_perm: int = 999
                 ) -> tuple[float, bool]:
    """The new p (whole layers permuted) and the retired verdict (sign-flip over
    checkpoints, at least 6 checkpoints)."""
    n, la = x.shape
    r = R.stratified_link(x.ravel(), y.ravel(), np.repeat(np.arange(n), la),
                          np.tile(np.arange(la), n), rng=rng, n_boot=20, n_perm=n_perm)
    return r.p_value, bool(n >= 6 and r.p_checkpoints < R.ALPHA)


def old_several(k: int, m: int) -> bool:
    """The retired "several": at least two models at alpha and P(Bin(m, alpha) >= k) <
    alpha (valid only for independent models)."""
    return m >= 2 and k >= 2 and R.binom_tail(k, m, R.ALPHA) < R.ALPHA


def claim5_verdicts(rng: np.random.Generator, n: int, *, trend: dict[str, Any],
                    link: dict[str, Any], n_perm: int = 999) -> dict[str, bool]:
    """The whole claim 5 on three models (6, 12, 24 layers): several rise then decay and
    several show the link, new rules and retired ones."""
    tv = trend_verdicts(rng, trend_series(rng, n, **trend), n_perm, old=True)
    link = dict(link)
    sh = link.pop("shared_sd", 0.0)
    shared = tuple(rng.normal(0, sh, (2, 24))) if sh else None
    lk = [link_verdict(rng, *link_data(rng, n, la, shared=shared, **link), n_perm=n_perm)
          for la in MODEL_LAYERS]
    m = len(MODEL_LAYERS)
    new_t, new_l = R.several_rule(tv["p"]), R.several_rule([p for p, _ in lk])
    return {"5": new_t == R.HOLDS and new_l == R.HOLDS,
            "5-trend (several of 3)": new_t == R.HOLDS,
            "5-link (several of 3)": new_l == R.HOLDS,
            "5 (retired: values permuted, checkpoint sign-flip)":
                old_several(sum(tv["old"]), m) and old_several(sum(o for _, o in lk), m)}


TREND_NULLS = {"iid": {"kind": "iid"}, "AR(1) phi 0.9": {"kind": "ar1"},
               "random walk": {"kind": "walk"},
               "AR(1) phi 0.9, half the variance shared by the models":
                   {"kind": "ar1", "shared": 0.5},
               "random walk shared by the models (0.8)": {"kind": "walk", "shared": 0.8}}
LINK_NULLS = {"shared trend": {},
              "fixed layer profiles sd 1, uncoupled": {"profile": 1.0},
              "layer profiles + AR(1) phi 0.9 over checkpoints":
                  {"profile": 1.0, "kind": "ar1"},
              "layer profiles + random walk over checkpoints": {"profile": 1.0,
                                                                "kind": "walk"}}


# --------------------------------------------------------------------------- the rows


def hard_rows(add: Callable[..., None], reps: int, retired: bool = True) -> None:
    """Add every hard-null and power row: ``add(rule, scenario, kind, effect, reps, draw)``
    with ``draw(rng) -> bool`` ("holds")."""
    slow = max(reps // 2, 50)
    c2 = [("2-gap", GAP_NULLS, GAP_POWER), ("2-slopes", SLOPE_NULLS, SLOPE_POWER),
          ("2-slopes-late", SLOPE_NULLS, SLOPE_POWER)]
    for rule, nulls, power in c2:
        for name in [rule] + ([f"{rule} (retired: trajectories)"] if retired else []):
            for scen, kw in nulls.items():
                add(name, scen, "null", "-", reps, lambda g, kw=kw, name=name:
                    claim2_verdicts(*runs(g, **kw))[name] == R.HOLDS)
            for scen, (eff, kw) in power.items():
                add(name, scen, "power", eff, reps, lambda g, kw=kw, name=name:
                    claim2_verdicts(*runs(g, **kw))[name] == R.HOLDS)
    for scen, kw in CLAIM3_NULLS.items():
        add("3", scen, "null", "-", slow, lambda g, kw=kw: claim3_verdict(g, **kw) == R.HOLDS)
        if retired and kw.get("speed"):
            add("3 (retired: same step)", scen, "null", "-", slow, lambda g, kw=kw:
                claim3_verdict(g, align=False, **kw) == R.HOLDS)
    add("3", "trial effects rho 0.6 + speed log-sd 0.6", "power", "rho 0.6", slow,
        lambda g: claim3_verdict(g, 0.6, speed=0.6) == R.HOLDS)
    signs = [-1, 1, -1]
    for n in (5, 6):
        add("4 (any arm)", f"speed-skewed ends, seed effect sd 2, {n} seeds", "null", "-",
            reps, lambda g, n=n: any(v["verdict"] == R.HOLDS for v in R.arm_family_rule(
                dict(zip("abc", speed_deltas(g, n))), dict(zip("abc", signs)),
                primary="a").values()))
        add("reality-check", f"speed-skewed ends, seed effect sd 2, {n} seeds", "null", "-",
            reps, lambda g, n=n: R.all_lower_rule(speed_deltas(g, n, 1)[0]) == R.HOLDS)
    _claim5_rows(add, slow, retired)


def _claim5_rows(add: Callable[..., None], slow: int, retired: bool) -> None:
    for n in (8, 15, 30):
        for scen, kw in TREND_NULLS.items():
            add("5-trend (one model)", f"{scen}, {n} checkpoints", "null", "-", 2 * slow,
                lambda g, n=n, kw=kw: R.trend_p(R.split_trend(
                    np.arange(n), trend_series(g, n, models=1, **kw)[0], rng=g,
                    n_perm=999, exchangeable=False)) < R.ALPHA)
            add("5-trend (several of 3)", f"{scen}, {n} checkpoints", "null", "-", slow,
                lambda g, n=n, kw=kw: R.several_rule(trend_verdicts(
                    g, trend_series(g, n, **kw))["p"]) == R.HOLDS)
            if retired and kw.get("kind") != "iid":
                add("5-trend (retired: values permuted, one model)",
                    f"{scen}, {n} checkpoints", "null", "-", slow,
                    lambda g, n=n, kw=kw: trend_verdicts(
                        g, trend_series(g, n, models=1, **kw), old=True)["old"][0])
        for amp in (3.0, 6.0):
            add("5-trend (several of 3)", f"tent {amp:g} sd, iid noise, {n} checkpoints",
                "power", f"{amp:g} sd", slow, lambda g, n=n, amp=amp: R.several_rule(
                    trend_verdicts(g, trend_series(g, n, amplitude=amp))["p"]) == R.HOLDS)
    for n in (8, 30):
        for scen, kw in LINK_NULLS.items():
            add("5-link (one model)", f"{scen}, {n} checkpoints, 12 layers", "null", "-",
                2 * slow, lambda g, n=n, kw=kw: link_verdict(g, *link_data(g, n, **kw))[0]
                < R.ALPHA)
            if retired and kw:
                add("5-link (retired: checkpoint sign-flip)",
                    f"{scen}, {n} checkpoints, 12 layers", "null", "-", slow,
                    lambda g, n=n, kw=kw: link_verdict(g, *link_data(g, n, **kw))[1])
        for prof in (0.0, 1.0):
            add("5-link (one model)", f"rho 0.3, layer profiles sd {prof:g}, {n} "
                "checkpoints, 12 layers", "power", "rho 0.3", slow,
                lambda g, n=n, prof=prof: link_verdict(g, *link_data(
                    g, n, rho=0.3, profile=prof))[0] < R.ALPHA)
    whole = {
        "trend true (tent 6 sd), link null: layer profiles sd 1":
            ({"amplitude": 6.0}, {"profile": 1.0}),
        "trend true, link null: profiles shared by the models (sd 1)":
            ({"amplitude": 6.0}, {"profile": 0.5, "shared_sd": 1.0}),
        "link true (rho 0.5), trend null: AR(1) phi 0.9":
            ({"kind": "ar1"}, {"rho": 0.5, "profile": 1.0}),
        "link true (rho 0.5), trend null: random walk":
            ({"kind": "walk"}, {"rho": 0.5, "profile": 1.0}),
        "link true, trend null: AR(1) shared by the models (0.5)":
            ({"kind": "ar1", "shared": 0.5}, {"rho": 0.5}),
    }
    power = {"tent 6 sd and link rho 0.5": ({"amplitude": 6.0}, {"rho": 0.5, "profile": 1.0})}
    names = ["5"] + (["5 (retired: values permuted, checkpoint sign-flip)"] if retired else [])
    for n in (10,):
        for name in names:
            for kind, table in (("null", whole), ("power", power)):
                for scen, (t, lk) in table.items():
                    add(name, f"{scen}, {n} checkpoints", kind,
                        "-" if kind == "null" else "tent 6 sd, rho 0.5", slow,
                        lambda g, n=n, t=t, lk=lk, name=name: claim5_verdicts(
                            g, n, trend=t, link=lk)[name])
