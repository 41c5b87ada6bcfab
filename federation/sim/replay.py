"""Replay one trace over one topology under several policies, and collect the results."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from federation.placement.registry import build_framework
from federation.sim.engine import Outcome, SimConfig, Simulation
from federation.sim.metrics import (
    against_default,
    as_number,
    mean_job_bound,
    summarize,
    task_bounds,
)
from federation.sim.policies import DEFAULT_POLICY, Profile, profile
from federation.sim.queues import resolve
from federation.sim.state import SiteState
from federation.sim.topology import Topology
from federation.sim.trace import TraceTask, check_against

# (policy, tasks finished, tasks in the trace)
PolicyProgress = Callable[[str, int, int], None]


@dataclass(slots=True)
class ReplayResult:
    """What ``replay`` found: figures for JSON, and each policy's raw outcome for plots."""

    summary: dict[str, Any]
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    wall_s: dict[str, float] = field(default_factory=dict)
    """Seconds of real time each policy's replay took (kept out of ``summary``)."""
    bounds: np.ndarray = field(default_factory=lambda: np.zeros(0))


def estimated_durations(tasks: Sequence[TraceTask], sigma: float, seed: int) -> list[float]:
    """What the scheduler is told: each duration times a log-normal error (exact at 0)."""
    if sigma <= 0:
        return [t.duration_s for t in tasks]
    noise = np.random.default_rng([seed, 1]).lognormal(0.0, sigma, len(tasks))
    return [t.duration_s * float(n) for t, n in zip(tasks, noise, strict=True)]


def replay(
    topology: Topology,
    tasks: Sequence[TraceTask],
    policies: Sequence[str],
    *,
    seed: int = 0,
    estimate_error: float = 0.0,
    config: SimConfig | None = None,
    trace_source: str = "<trace>",
    progress: PolicyProgress | None = None,
    profiles: Mapping[str, Profile] | None = None,
) -> ReplayResult:
    """Replay ``tasks`` under each policy from an idle federation; deterministic per seed.
    ``profiles``: policies of their own (a coordinator config's, ``configured_profile``)."""
    profiles = profiles or {}
    frameworks = {name: build_framework(p.filters, p.scorers) for name, p in profiles.items()}
    for name in policies:
        if name not in profiles:
            profile(name)  # unknown names fail before any work
    check_against(tasks, topology, trace_source)
    tasks = resolve(tasks, topology, trace_source)
    config = config or SimConfig(seed=seed)
    base = SiteState(topology)
    bounds = task_bounds(base, tasks)
    estimates = estimated_durations(tasks, estimate_error, seed)
    result = ReplayResult(summary={}, bounds=bounds)
    per_policy: dict[str, Any] = {}
    for name in policies:
        started = time.perf_counter()
        own = profiles.get(name)
        sim = Simulation(
            name,
            base.fresh(),
            tasks,
            config,
            estimates,
            framework=frameworks.get(name),
            waits=own.waits if own is not None else None,
        )
        report = None if progress is None else functools.partial(progress, name)
        outcome = sim.run(report)
        result.wall_s[name] = time.perf_counter() - started
        result.outcomes[name] = outcome
        per_policy[name] = summarize(outcome, bounds)
    against_default(per_policy, DEFAULT_POLICY)
    job_ids = {t.job_id for t in tasks}
    bound_mean = mean_job_bound(tasks, bounds)
    devices: dict[str, int] = {}
    for site in topology.sites:
        for node in site.nodes:
            for device in node.devices:
                devices[device.model] = devices.get(device.model, 0) + node.count * device.count
    result.summary = {
        "topology": {
            "source": topology.source,
            "sites": len(topology.sites),
            "nodes": topology.n_nodes,
            "devices": dict(sorted(devices.items())),
            **({"launchable_nodes": topology.n_launchable} if topology.n_launchable else {}),
        },
        "trace": {"source": trace_source, "jobs": len(job_ids), "tasks": len(tasks)},
        "seed": seed,
        "estimate_error": estimate_error,
        "learn": config.learn,
        "idle_power_share": config.idle_power_share,
        "default_policy": DEFAULT_POLICY,
        "lower_bound_mean_jct_s": as_number(bound_mean),
        "policies": per_policy,
    }
    return result
