"""Which running tasks to stop so that an urgent task fits: a pure choice over candidates.

Only tasks of lower priority whose class is preemptible, that have run at least the minimum
time (so work does not thrash), are candidates. At each site, victims are taken lowest
priority first, then least work lost since their last checkpoint, until the site's free room
plus theirs holds the urgent task; the site needing the fewest victims (then the least lost
work) wins. A task is stopped whole with all its replicas, never part of a gang.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from federation.coordinator.policy.resources import Demand
from federation.placement.snapshot import Snapshot
from federation.resources import CPU, KINDS, MEMORY

EPSILON = 1e-9
_KIND_NAMES: dict[int, str] = {int(kind): name for kind, name in KINDS.items()}


@dataclass(frozen=True, slots=True)
class Candidate:
    """A task running (or delegated) at a site, as preemption sees it."""

    job_id: str
    task: str
    site: str
    epoch: int
    priority: int
    demand: Mapping[str, float]
    lost_s: float
    """Work it would lose: seconds since its last checkpoint (or since it started)."""


def may_stop(priority: int, queue: str, urgent_priority: int, lenders: Collection[str]) -> bool:
    """Whether a preemptible task of ``priority`` in ``queue`` may be stopped for a waiting
    task: one of the ``lenders`` when its queue takes back what it lent (whatever the
    priority), else one of lower priority than ``urgent_priority``."""
    return queue in lenders if lenders else priority < urgent_priority


def choose_victims(
    need: Demand, free: Mapping[str, Mapping[str, float]], candidates: Iterable[Candidate]
) -> tuple[str, list[Candidate]] | None:
    """The site and the tasks to stop there so that ``need`` fits, or None if none can."""
    by_site: dict[str, list[Candidate]] = {}
    for candidate in candidates:
        if candidate.site in free:
            by_site.setdefault(candidate.site, []).append(candidate)
    best: tuple[tuple[int, float, str], list[Candidate]] | None = None
    for site, pool in by_site.items():
        have = dict(free[site])
        chosen: list[Candidate] = []
        for candidate in sorted(pool, key=lambda c: (c.priority, c.lost_s, c.job_id, c.task)):
            if fits(need, have):
                break
            chosen.append(candidate)
            for resource, amount in candidate.demand.items():
                have[resource] = have.get(resource, 0.0) + amount
        if not chosen or not fits(need, have):
            continue
        cost = (len(chosen), sum(c.lost_s for c in chosen), site)
        if best is None or cost < best[0]:
            best = (cost, chosen)
    return (best[0][2], best[1]) if best is not None else None


def fits(need: Demand, have: Mapping[str, float]) -> bool:
    """Whether ``have`` holds ``need`` of every resource."""
    return all(have.get(resource, 0.0) + EPSILON >= amount for resource, amount in need.items())


def free_room(snapshot: Snapshot, sites: Iterable[str]) -> dict[str, dict[str, float]]:
    """What ``sites`` have free now, by resource as quotas count it: cores, memory, and
    whole devices by kind and by kind/model (the room a placement could use, summed per
    site: a coarse view, so the site still has the final say when the task is offered)."""
    wanted = set(sites)
    out: dict[str, dict[str, float]] = {site: {} for site in wanted}
    site_of_node = [snapshot.site_ids[i] for i in snapshot.node_site]
    for node, site in enumerate(site_of_node):
        if site in wanted and snapshot.node_schedulable[node]:
            room = out[site]
            room[CPU] = room.get(CPU, 0.0) + float(snapshot.node_cpu_free[node])
            room[MEMORY] = room.get(MEMORY, 0.0) + float(snapshot.node_memory_free_mib[node])
    for device in np.flatnonzero(snapshot.device_available):
        node = snapshot.device_node[device]
        if not snapshot.node_schedulable[node]:
            continue
        site = site_of_node[node]
        kind = _KIND_NAMES.get(int(snapshot.device_kind[device]))
        if site in wanted and kind is not None:
            room = out[site]
            room[kind] = room.get(kind, 0.0) + 1
            model = f"{kind}/{snapshot.device_model[device]}"
            room[model] = room.get(model, 0.0) + 1
    return out
