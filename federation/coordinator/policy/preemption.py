"""Which running tasks to stop so that an urgent task fits: a pure choice over candidates.

Only tasks of lower priority whose class is preemptible, that have run at least the minimum
time (so work does not thrash), are candidates. At each site, victims are taken lowest
priority first, then least work lost since their last checkpoint, until the site's free room
plus theirs holds the urgent task; the site needing the fewest victims (then the least lost
work) wins. A task is stopped whole with all its replicas, never part of a gang.

Borrowed quota is taken back the same way: tasks of the queues that borrow, lowest priority
first, then least work lost, until the task fits at a site and they gave back what is owed.
A candidate counts what it holds as its site granted it (the models of its devices, at its
site and in its domain), whatever its spec names.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from federation.coordinator.policy.quota import Debt
from federation.coordinator.policy.resources import Demand
from federation.placement.snapshot import Snapshot
from federation.resources import CPU, KINDS, MEMORY

EPSILON = 1e-9
_KIND_NAMES: dict[int, str] = {int(kind): name for kind, name in KINDS.items()}


class TaskAt(NamedTuple):
    """One delegation of a task: what stopping it names."""

    job_id: str
    task: str
    site: str
    epoch: int


@dataclass(frozen=True, slots=True)
class Candidate:
    """A task running (or delegated) at a site, as preemption sees it."""

    job_id: str
    task: str
    site: str
    epoch: int
    priority: int
    demand: Mapping[str, float]
    """What it holds: as its site granted it (``usage.placed``), at its site and domain."""
    lost_s: float
    """Work it would lose: seconds since its last checkpoint (or since it started)."""
    queues: tuple[str, ...] = ()
    """Its job's queue and the queues above it."""


def may_stop(priority: int, queue: str, urgent_priority: int, lenders: Collection[str]) -> bool:
    """Whether a preemptible task of ``priority`` in ``queue`` may be stopped for a waiting
    task: one of the ``lenders`` when its queue takes back what it lent (whatever the
    priority), else one of lower priority than ``urgent_priority``."""
    return queue in lenders if lenders else priority < urgent_priority


def ready_s(started_s: float | None, min_run_s: float, *, reclaim: bool) -> float:
    """From when a task that started at ``started_s`` may be stopped: once it has run
    ``min_run_s``. One delegated but not started yet (None) loses nothing, and may be stopped
    for priority at once; but it counts as having run nothing when its queue's borrowed quota
    is taken back, or what was lent would be taken back as soon as it was lent."""
    if started_s is None:
        return math.inf if reclaim and min_run_s > 0 else -math.inf
    return started_s + min_run_s


def choose_victims(
    need: Demand,
    free: Mapping[str, Mapping[str, float]],
    candidates: Iterable[Candidate],
    debts: Sequence[Debt] = (),
) -> tuple[str, list[Candidate]] | None:
    """The site and the tasks to stop so that ``need`` fits there, or None if none can. With
    ``debts`` (borrowed quota taken back), also tasks elsewhere until the queues that borrow
    have given back all of them."""
    ordered = sorted(candidates, key=lambda c: (c.priority, c.lost_s, c.job_id, c.task))
    by_site: dict[str, list[Candidate]] = {}
    for candidate in ordered:
        by_site.setdefault(candidate.site, []).append(candidate)
    best: tuple[tuple[int, float, str], list[Candidate]] | None = None
    for site in sorted(free if debts else by_site.keys() & free.keys()):
        have = dict(free[site])
        owed = _Owed(debts)
        chosen: list[Candidate] = []
        pool = by_site.get(site, [])
        # Room there first, from those that also pay what is owed first.
        for candidate in sorted(pool, key=lambda c: not owed.pays(c)) if debts else pool:
            if fits(need, have) and owed.paid():
                break
            if not fits(need, have) or owed.pays(candidate):
                chosen.append(candidate)
                owed.pay(candidate)
                for resource, amount in candidate.demand.items():
                    have[resource] = have.get(resource, 0.0) + amount
        if not fits(need, have):
            continue
        for candidate in ordered:  # then what is still owed, from anywhere
            if not owed.paid() and candidate.site != site and owed.pays(candidate):
                chosen.append(candidate)
                owed.pay(candidate)
        if not chosen or not owed.paid():
            continue
        cost = (len(chosen), sum(c.lost_s for c in chosen), site)
        if best is None or cost < best[0]:
            best = (cost, chosen)
    return (best[0][2], best[1]) if best is not None else None


class _Owed:
    """What the queues that borrow still owe of ``debts`` as victims are chosen."""

    def __init__(self, debts: Sequence[Debt]) -> None:
        self._debts = debts
        self._left = [debt.amount for debt in debts]
        self._over = [dict(debt.over) for debt in debts]

    def paid(self) -> bool:
        return all(left <= EPSILON for left in self._left)

    def pays(self, candidate: Candidate) -> bool:
        """Whether stopping ``candidate`` gives back some of what is still owed: one of its
        queues borrows a debt's resource, still over its nominal quota, and it holds some."""
        return bool(self._payments(candidate))

    def pay(self, candidate: Candidate) -> None:
        for n, lender, given in self._payments(candidate):
            self._left[n] -= given
            self._over[n][lender] -= given

    def _payments(self, candidate: Candidate) -> list[tuple[int, str, float]]:
        out = []
        for n, debt in enumerate(self._debts):
            over = self._over[n]
            lender = next((q for q in candidate.queues if q in over), None)
            given = candidate.demand.get(debt.key, 0.0)
            if self._left[n] > EPSILON and given > 0 and over.get(lender or "", 0.0) > EPSILON:
                out.append((n, lender or "", given))
        return out


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
