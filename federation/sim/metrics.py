"""Figures for one replay, and the lower bound that every policy is measured against.

A job's completion time (JCT) runs from its first task's submission to its last task's end.
The lower bound of a job has each of its tasks alone in the federation, on the fastest device
that can hold it, with its data already there: the best any policy could do.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from federation.common import job_state
from federation.placement.estimates import class_speed, estimate
from federation.placement.plugins.capacity_fit import matching_devices, replicas_per_device
from federation.placement.registry import DEFAULT_FILTERS, build_framework
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot
from federation.sim.elastic import LaunchTally
from federation.sim.engine import MAX_RECLAIMS, Outcome
from federation.sim.policies import feasibility_key
from federation.sim.queues import jain_index
from federation.sim.runs import TaskRun
from federation.sim.state import SiteState
from federation.sim.trace import TraceTask

F64 = npt.NDArray[np.float64]
SLOWDOWN_FLOOR_S = 10.0
"""Bounded slowdown: JCT over max(bound, this), so that seconds-long jobs do not dominate."""


def task_bounds(state: SiteState, tasks: Sequence[TraceTask]) -> F64:
    """Per task: its run time alone on its best device (NaN when no site could ever hold it),
    at the devices' true speeds (the topology's speed factors included)."""
    framework = build_framework(DEFAULT_FILTERS, {})
    empty = state.fresh().snap
    factors = state.speed_factor if np.any(state.speed_factor != 1.0) else None
    per_unit: dict[object, float] = {}
    out = np.full(len(tasks), math.nan)
    for i, task in enumerate(tasks):
        req = dataclasses.replace(task.request(0), inputs=(), duration_s=1.0)
        key = (feasibility_key(DEFAULT_FILTERS, req), req.workload_class, req.speed)
        if key not in per_unit:
            ranked = framework.place(req, empty).ranked
            sites = [empty.site_ids.index(name) for name in ranked]
            run_s = (
                estimate(req, empty).run_s if factors is None else _true_run_s(req, empty, factors)
            )
            per_unit[key] = float(run_s[sites].min()) if sites else math.nan
        out[i] = task.duration_s * per_unit[key]
    return out


def _true_run_s(req: Request, empty: Snapshot, factors: F64) -> F64:
    """Per site: ``req``'s run time on the truly fastest device that could hold it there."""
    if not req.wants_accelerator or not len(empty.classes):
        return np.full(empty.n_sites, req.duration_s)
    usable = matching_devices(req, empty) & empty.device_available
    if not req.accelerator_count:
        usable &= replicas_per_device(req, empty) > 0
    speed = class_speed(req, empty)[empty.device_class] * factors
    best = np.zeros(empty.n_sites)
    np.maximum.at(best, empty.device_site, np.where(usable, speed, 0.0))
    return np.where(best > 0, req.duration_s / np.where(best > 0, best, 1.0), req.duration_s)


def as_number(value: float) -> float | None:
    """JSON has no NaN: missing figures are null."""
    return float(f"{float(value):.10g}") if math.isfinite(value) else None


def _spread(values: F64) -> dict[str, float | None]:
    if not len(values):
        return {"mean": None, "p50": None, "p95": None, "p99": None}
    p50, p95, p99 = np.percentile(values, [50, 95, 99])
    return {
        "mean": as_number(values.mean()),
        "p50": as_number(p50),
        "p95": as_number(p95),
        "p99": as_number(p99),
    }


def _members(tasks: Sequence[TraceTask]) -> dict[str, list[int]]:
    """Job id -> indices of its tasks, jobs in order of first appearance."""
    members: dict[str, list[int]] = defaultdict(list)
    for i, task in enumerate(tasks):
        members[task.job_id].append(i)
    return members


def mean_job_bound(tasks: Sequence[TraceTask], bounds: F64) -> float:
    """The lower bound on mean JCT over the jobs that fit somewhere (NaN when none does)."""
    per_job = [
        max(tasks[i].submit_s + bounds[i] for i in members)
        - min(tasks[i].submit_s for i in members)
        for members in _members(tasks).values()
    ]
    finite = [b for b in per_job if math.isfinite(b)]
    return float(np.mean(finite)) if finite else math.nan


def job_table(tasks: Sequence[TaskRun], bounds: F64) -> dict[str, Any]:
    """Per job (in order of first appearance): submit, JCT, bound, priority, whether done."""
    members = _members([run.trace for run in tasks])
    ids = list(members)
    submit = np.array([min(tasks[i].trace.submit_s for i in members[j]) for j in ids])
    end = np.array([max(tasks[i].finished_s for i in members[j]) for j in ids])
    done = np.array(
        [
            job_state.job_state(tasks[i].state for i in members[j]) == job_state.SUCCEEDED
            for j in ids
        ],
        dtype=bool,
    )
    bound = np.array([max(tasks[i].trace.submit_s + bounds[i] for i in members[j]) for j in ids])
    priority = np.array([max(tasks[i].trace.priority for i in members[j]) for j in ids])
    return {
        "ids": ids,
        "submit": submit,
        "jct": np.where(done, end - submit, math.nan),
        "bound": bound - submit,
        "done": done,
        "priority": priority,
    }


def _shares(used: F64, capacity: F64, models: Sequence[str]) -> dict[str, float | None]:
    """``used / capacity`` overall (``all``), per kind (``GPU``) and per model (``GPU/T4``)."""
    out: dict[str, float | None] = {
        "all": as_number(used.sum() / capacity.sum()) if capacity.sum() else None
    }
    kinds = np.array([m.split("/")[0] for m in models])
    for kind in sorted(set(kinds.tolist())):
        mine = kinds == kind
        out[kind] = as_number(used[mine].sum() / capacity[mine].sum())
    out.update({m: as_number(used[i] / capacity[i]) for i, m in enumerate(models)})
    return out


def summarize(outcome: Outcome, bounds: F64) -> dict[str, Any]:
    """The figures of one replay, ready for JSON."""
    runs = outcome.tasks
    jobs = job_table(runs, bounds)
    done = jobs["done"]
    jct: F64 = jobs["jct"][done]
    bound: F64 = jobs["bound"][done]
    placed = [r for r in runs if math.isfinite(r.placed_s)]
    finished = [r for r in runs if r.state == job_state.SUCCEEDED]
    first = min((r.trace.submit_s for r in runs), default=0.0)
    last = max((r.finished_s for r in finished), default=first)
    window = max(last - first, 1e-9)
    capacity = outcome.capacity * window
    arriving = max((r.trace.submit_s for r in runs), default=first) - first
    busy, held = outcome.busy_device_s, outcome.held_device_s
    total_devices = float(outcome.capacity.sum())
    wan = sum(r.wan_bytes for r in runs)
    in_system = sum(r.finished_s - r.trace.submit_s for r in finished)
    compute = sum(r.compute_usd for r in finished)
    egress = sum(r.egress_usd for r in placed)
    elastic = 0.0 if outcome.elastic is None else outcome.elastic.usd
    promised = [r for r in placed if r.assumed_speed > 0]
    busy_kwh = sum(r.energy_kwh for r in finished)
    idle_kwh = outcome.idle_energy_j / 3.6e6
    slower = [r for r in promised if r.speed < r.assumed_speed * (1 - 1e-9)]
    deadline = [r for r in runs if r.trace.deadline_s > 0]
    missed = [
        r
        for r in deadline
        if not (r.finished_s - r.trace.submit_s <= r.trace.deadline_s)  # unfinished: missed
    ]
    by_priority: dict[str, dict[str, Any]] = {}
    for p in sorted(set(jobs["priority"].tolist())):
        mine = jobs["priority"] == p
        by_priority[str(p)] = {
            "jobs": int(mine.sum()),
            "completed": int((mine & done).sum()),
            "mean_jct_s": as_number(jobs["jct"][mine & done].mean())
            if (mine & done).any()
            else None,
        }
    return {
        "jobs": len(jobs["ids"]),
        "jobs_completed": int(done.sum()),
        "tasks_never_placed": sum(1 for r in runs if not math.isfinite(r.placed_s)),
        "tasks_that_fit_nowhere": sum(1 for r in runs if r.never_fits),
        "jct_s": _spread(jct),
        "lower_bound_mean_jct_s": as_number(bound.mean()) if len(bound) else None,
        "jct_over_bound": as_number(jct.mean() / bound.mean())
        if len(bound) and bound.mean()
        else None,
        "queueing_delay_s": _spread(np.array([r.placed_s - r.trace.submit_s for r in placed])),
        "makespan_s": as_number(last - first),
        "slowdown": _spread(jct / np.maximum(bound, SLOWDOWN_FLOOR_S)),
        "utilisation": _shares(busy, capacity, outcome.models),
        "utilisation_while_arriving": as_number(
            outcome.busy_until_last_arrival.sum() / (total_devices * arriving)
        )
        if total_devices and arriving > 0 and len(outcome.busy_until_last_arrival)
        else None,
        "allocation": _shares(held, capacity, outcome.models),
        "fragmentation": {
            "waiting_hours": as_number(outcome.waiting_s / 3600.0),
            "idle_device_hours_while_waiting": as_number(
                outcome.idle_while_waiting_device_s / 3600.0
            ),
            "idle_share_while_waiting": as_number(
                outcome.idle_while_waiting_device_s / (outcome.waiting_s * total_devices)
            )
            if outcome.waiting_s and total_devices
            else 0.0,
        },
        "wan_bytes": int(wan),
        "transfer_share_of_jct": as_number(sum(r.transfer_s for r in finished) / in_system)
        if in_system
        else 0.0,
        "cost_usd": {
            "compute": as_number(compute),
            "egress": as_number(egress),
            **({} if outcome.elastic is None else {"elastic": as_number(elastic)}),
            "total": as_number(compute + egress + elastic),
        },
        **({} if outcome.elastic is None else launch_figures(outcome.elastic, runs)),
        "energy_kwh": as_number(busy_kwh),
        "energy_idle_kwh": as_number(idle_kwh),
        "energy_total_kwh": as_number(busy_kwh + idle_kwh),
        "powered_node_hours": as_number(outcome.powered_node_s / 3600.0),
        "deadlines": {"tasks_with_deadline": len(deadline), "missed": len(missed)},
        "by_priority": by_priority,
        "slower_than_estimate": {
            "tasks_with_devices": len(promised),
            "on_slower_devices": len(slower),
            "share": len(slower) / len(promised) if promised else 0.0,
        },
        "run_time_over_estimate": _spread(
            np.array([r.run_s / r.estimated_run_s for r in placed if r.estimated_run_s > 0])
        ),
        **(
            {}
            if outcome.learned_speeds is None
            else {
                "learned_speeds": {
                    wc: {model: as_number(v) for model, v in speeds.items()}
                    for wc, speeds in outcome.learned_speeds.items()
                }
            }
        ),
        "offers": outcome.offers,
        "declines": outcome.declines,
        **({} if outcome.sharing is None else {"sharing": sharing_figures(outcome, jobs)}),
        **(
            {}
            if not outcome.straddles
            else {
                "gangs_straddling": {
                    level: {"gangs": n, "straddled": k, "share": k / n}
                    for level, (n, k) in sorted(outcome.straddles.items())
                }
            }
        ),
    }


def launch_figures(tally: LaunchTally, runs: Sequence[TaskRun]) -> dict[str, Any]:
    """Nodes launched (``launches``), how long tasks placed on launching nodes waited for them
    to run (``launch_wait_s``, over those placements) and the node-hours from launch to
    release (``launched_node_hours``); their cost is ``cost_usd.elastic``. With spot node
    types: the spot nodes taken back (``spot_reclaims``), the tasks stopped on them
    (``spot_interruptions``) and the device-hours of run those lost since their last
    checkpoints (``spot_device_hours_lost``, as ``sharing``'s ``device_hours_lost``), and the
    tasks given up after ``MAX_RECLAIMS`` reclaims (``spot_tasks_given_up``)."""
    waits = _spread(np.array(tally.waits))
    spot = {
        "spot_reclaims": tally.reclaims,
        "spot_interruptions": sum(r.reclaims for r in runs),
        "spot_device_hours_lost": as_number(sum(r.reclaim_lost_device_s for r in runs) / 3600.0),
        "spot_tasks_given_up": sum(r.reclaims >= MAX_RECLAIMS for r in runs),
    }
    return {
        "launches": tally.launches,
        "launch_wait_s": {k: waits[k] for k in ("mean", "p50", "p95")},
        "launched_node_hours": as_number(tally.node_s / 3600.0),
        **(spot if tally.spot else {}),
    }


def sharing_figures(outcome: Outcome, jobs: dict[str, Any]) -> dict[str, Any]:
    """Per tenant: jobs, JCT, its mean dominant share while every tenant had a task waiting,
    the preemptions its tasks suffered and the device-hours of run they lost; and Jain's
    index over the tenants' mean shares divided by their weights."""
    tally = outcome.sharing
    assert tally is not None
    tenant_of_job: dict[str, int] = {}
    for run, tenant in zip(outcome.tasks, tally.tenant_of, strict=True):
        tenant_of_job.setdefault(run.trace.job_id, tenant)
    job_tenant = np.array([tenant_of_job[j] for j in jobs["ids"]], dtype=np.int64)
    contended = tally.contended_s > 0
    mean = tally.share_s / tally.contended_s if contended else np.full(len(tally.tenants), np.nan)
    tenants: dict[str, Any] = {}
    for t, name in enumerate(tally.tenants):
        mine = job_tenant == t
        done = mine & jobs["done"]
        runs = [r for r, k in zip(outcome.tasks, tally.tenant_of, strict=True) if k == t]
        tenants[name] = {
            "weight": as_number(tally.weights[t]) if tally.fair[t] else None,
            "jobs": int(mine.sum()),
            "jobs_completed": int(done.sum()),
            "jct_s": _spread(jobs["jct"][done]),
            "mean_share": as_number(mean[t]),
            "preemptions": sum(r.preemptions for r in runs),
            "device_hours_lost": as_number(sum(r.lost_device_s for r in runs) / 3600.0),
        }
    jain = jain_index(mean[tally.fair] / tally.weights[tally.fair]) if contended else None
    return {
        "contended_hours": as_number(tally.contended_s / 3600.0),
        "jain_index": None if jain is None else as_number(jain),
        "tenants": tenants,
    }


def against_default(per_policy: dict[str, dict[str, Any]], default: str) -> None:
    """Add to each policy's figures its energy saved and JCT change against ``default``'s
    (None for every policy when ``default`` was not replayed).

    ``energy_saved_kwh_vs_default``: the default's total energy minus this policy's (positive:
    saved); ``energy_saved_share_vs_default``: that over the default's total;
    ``jct_change_vs_default``: mean JCT over the default's, minus 1 (positive: JCT lost).
    """
    base = per_policy.get(default)
    for figures in per_policy.values():
        saved = share = change = None
        if base is not None:
            base_kwh, kwh = base["energy_total_kwh"], figures["energy_total_kwh"]
            if base_kwh is not None and kwh is not None:
                saved = as_number(base_kwh - kwh)
                share = as_number((base_kwh - kwh) / base_kwh) if base_kwh else None
            base_jct, jct = base["jct_s"]["mean"], figures["jct_s"]["mean"]
            if base_jct and jct is not None:
                change = as_number(jct / base_jct - 1.0)
        figures["energy_saved_kwh_vs_default"] = saved
        figures["energy_saved_share_vs_default"] = share
        figures["jct_change_vs_default"] = change
