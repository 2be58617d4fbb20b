"""Arms and the baselines their targets come from (no Ray, no torch).

An arm with ``target_mode: baseline_fraction`` (shrink, shrink_act) follows a fraction of
its paired baseline's trajectory (:func:`qkgeom.plan.spec.fill_baseline_pr`), so it is only
meaningful against the baseline run it was filled from. This module decides, from the
database, which arms may run:

* an arm runs only once its baseline is ``terminated``; until then it stays ``pending``
  with the reason ("waiting for baseline d2-gaussian-none-s0 (error)") in its ``error``
  column, which ``qkgeom status`` and the live page show;
* when it is filled, the arm records where its target came from in ``trials.baseline_ref``:
  the baseline's key and attempt, the metric, a digest of the target trajectory and the
  Tune experiment it runs in;
* an arm that ran (or started) against a trajectory other than the baseline's stored one
  (the baseline was retrained after its arms ran, or an arm of an older qkgeom filled from
  a partial baseline) is *stale*: the next sweep or resume resets it and runs it afresh, and
  until then :func:`inconsistent_pairs` makes the report refuse to pair it.

The digest is computed from the filled ``baseline_pr`` itself, so an arm stored before
``baseline_ref`` existed is checked the same way (its config holds the trajectory it used).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from qkgeom.errors import QkgeomError
from qkgeom.plan.spec import TrialSpec, baseline_metric, fill_baseline_pr, trial_key

if TYPE_CHECKING:
    from qkgeom.store import Store

FINISHED = "terminated"


def baseline_rows(store: Store, trial_id: int, metric: str
                  ) -> list[tuple[int, int, float | None]]:
    """The layer-level ``(step, layer, value)`` rows of ``metric`` of trial ``trial_id``
    (:func:`qkgeom.store.queries.layer_values`), ordered by step and layer; a NaN value
    (stored NULL) is None. What an arm's target is filled from."""
    from qkgeom.store.queries import layer_values

    df = layer_values(store, [trial_id], [metric]).select("step", "layer", "value")
    return sorted((int(s), int(la), None if math.isnan(v) else v) for s, la, v in df.iter_rows())


def target_digest(baseline_pr: Any) -> str:
    """A short digest of a filled ``baseline_pr`` trajectory ([[step, [pr per layer]], ...]);
    equal trajectories (bit for bit) give equal digests."""
    text = json.dumps(baseline_pr, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def needs_baseline(config: dict[str, Any]) -> bool:
    return config.get("target_mode") == "baseline_fraction" and config.get("arm") != "none"


@dataclass
class ArmPlan:
    """What the arm phase does with each arm that needs a baseline."""

    run: list[TrialSpec] = field(default_factory=list)  # filled; not finished in the db
    refs: dict[str, dict] = field(default_factory=dict)  # key -> baseline_ref (run only)
    waiting: dict[str, str] = field(default_factory=dict)  # key -> reason
    stale: dict[str, str] = field(default_factory=dict)  # key -> reason (reset, run afresh)
    done: list[str] = field(default_factory=list)  # finished against the stored baseline
    experiments: dict[str, str | None] = field(default_factory=dict)  # run key -> recorded


def _rows_by_key(store: Store, sweep: str) -> dict[str, dict[str, Any]]:
    df = store.trials(sweep)
    out = {}
    for r in df.iter_rows(named=True):
        r = dict(r)
        r["config"] = json.loads(r["config"]) if r["config"] else {}
        r["baseline_ref"] = json.loads(r["baseline_ref"]) if r.get("baseline_ref") else None
        out[r["trial_key"]] = r
    return out


def _used_digest(row: dict[str, Any] | None) -> str | None:
    """The digest of the target an arm was filled with, if it ever was."""
    if row is None:
        return None
    ref = row.get("baseline_ref")
    if ref and ref.get("digest"):
        return str(ref["digest"])
    traj = row["config"].get("baseline_pr")
    return target_digest(traj) if traj else None


def _started(row: dict[str, Any] | None) -> bool:
    return row is not None and (row["status"] != "pending" or (row["attempts"] or 0) > 0)


def arrange_arms(store: Store, sweep: str, arms: list[TrialSpec]) -> ArmPlan:
    """Sort the baseline-relative ``arms`` of ``sweep`` into run / waiting / stale / done
    from the database (nothing is written; :func:`record_plan` does that)."""
    rows = _rows_by_key(store, sweep)
    plan = ArmPlan()
    need = {}
    for t in arms:
        b = t.baseline_key or ""
        brow = rows.get(b)
        if brow is None or brow["status"] != FINISHED:
            if (rows.get(t.key) or {}).get("status") == FINISHED:
                plan.done.append(t.key)  # cannot be checked now; the report checks it
            else:
                plan.waiting[t.key] = (f"waiting for baseline {b} "
                                       f"({brow['status'] if brow else 'not in the database'})")
            continue
        need.setdefault((b, baseline_metric(t.config)), []).append(t)
    for (b, metric), ts in need.items():
        brow = rows[b]
        prs = baseline_rows(store, brow["id"], metric)
        for t in ts:
            cfg = fill_baseline_pr(t.config, prs)
            ref = {"trial": b, "attempt": int(brow["attempts"] or 0), "metric": metric,
                   "digest": target_digest(cfg["baseline_pr"])}
            arow = rows.get(t.key)
            used = _used_digest(arow)
            spec = TrialSpec.from_dict(dict(t.to_dict(), config=cfg))
            if _started(arow) and used is not None and used != ref["digest"]:
                plan.stale[t.key] = (f"stale: trained against another trajectory of baseline "
                                     f"{b} (target {used}, the stored baseline gives "
                                     f"{ref['digest']}); run afresh")
            elif arow is not None and arow["status"] == FINISHED:
                plan.done.append(t.key)
                continue
            else:
                old = (arow or {}).get("baseline_ref") or {}
                plan.experiments[t.key] = old.get("experiment")
            plan.run.append(spec)
            plan.refs[t.key] = ref
    return plan


def record_plan(store: Store, sweep: str, plan: ArmPlan, arms: list[TrialSpec],
                threads: int) -> None:
    """Write ``plan``: the filled configs and references of the arms to run (stale ones
    reset to ``pending``, their rows deleted), the waiting arms' reason."""
    sid = store.require_sweep(sweep)
    by_key = {t.key: t for t in arms}
    for t in plan.run:
        tid = store.ensure_trial(sid, t.key, dict(t.config, threads=threads), depth=t.depth,
                                 init=t.init, arm=t.arm, seed=t.seed, cell=t.cell,
                                 reset=t.key in plan.stale)
        if t.key in plan.stale:
            store.set_trial_status(tid, "pending", error=plan.stale[t.key])
    for key, why in plan.waiting.items():
        t = by_key[key]
        tid = store.ensure_trial(sid, key, dict(t.config, threads=threads), depth=t.depth,
                                 init=t.init, arm=t.arm, seed=t.seed, cell=t.cell)
        store.set_trial_status(tid, "pending", error=why)


def set_experiment(store: Store, sweep: str, plan: ArmPlan, keys: list[str],
                   experiment: str) -> None:
    """Record the Tune experiment the arms ``keys`` run in, with their baseline_ref."""
    sid = store.require_sweep(sweep)
    for k in keys:
        tid = store.trial_id(sid, k)
        if tid is not None:
            store.set_baseline_ref(tid, dict(plan.refs[k], experiment=experiment))


def inconsistent_pairs(store: Store, sweep: str, arm_ids: list[int] | None = None
                       ) -> list[str]:
    """One line per finished baseline-relative arm of ``sweep`` (or of ``arm_ids``) whose
    target does not come from its baseline's stored, finished trajectory."""
    rows = _rows_by_key(store, sweep)
    by_id = {r["id"]: r for r in rows.values()}
    ids = arm_ids if arm_ids is not None else [r["id"] for r in rows.values()]
    out = []
    cache: dict[tuple[str, str], list] = {}
    for i in ids:
        r = by_id.get(i)
        if r is None or r["status"] != FINISHED or not needs_baseline(r["config"]):
            continue
        ref = r.get("baseline_ref") or {}
        b = ref.get("trial") or trial_key(r["depth"], r["init"], "none", r["seed"])
        brow = rows.get(b)
        if brow is None or brow["status"] != FINISHED:
            out.append(f"{r['trial_key']} was trained against baseline {b}, which is "
                       f"{brow['status'] if brow else 'not in the database'}")
            continue
        metric = baseline_metric(r["config"])
        if (b, metric) not in cache:
            cache[(b, metric)] = baseline_rows(store, brow["id"], metric)
        try:
            want = target_digest(fill_baseline_pr(r["config"], cache[(b, metric)])
                                 ["baseline_pr"])
        except QkgeomError as e:  # no usable baseline rows
            out.append(f"{r['trial_key']}: its baseline {b} has no usable trajectory ({e})")
            continue
        used = _used_digest(r)
        if used != want:
            out.append(f"{r['trial_key']} was trained against another trajectory of "
                       f"baseline {b} (target {used}, the stored baseline gives {want})")
    return out
