"""Predicted waits: whether a task finishes sooner by waiting for a busy site than by running
now on the best site that can take it.

A site short only of free room (every other filter passes) is not written off. What runs
there ends by its committed estimate (start + run time), so the time until the task fits
there, on devices as fast as those its estimate assumes, is found by releasing what each
task there holds, on trial and in the predicted order. Every other task already waiting for
the site takes what frees first. The site's own forecast (a Slurm site's ``squeue --start``,
``QueueState.estimated_wait_s``) bounds the wait from below, and stands alone for what the
coordinator does not see (a Slurm partition's local users' jobs). The simulator plays the
same rule (``federation.sim.engine``), where it was measured against never waiting.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.placement.estimates import class_speed, estimate, once_free
from federation.placement.plugins.capacity_fit import (
    EPSILON,
    fit_replicas,
    matching_classes,
    node_label_mask,
)
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot

F64 = npt.NDArray[np.float64]

WAIT_GAIN = 0.9
"""A task waits for a busy site only if it would finish there by this share of the time it
would finish on the best site that can take it now: an estimate's error should not make it
wait for nothing."""
OVERRUN_LEFT = 0.1
"""A task past its estimated end is expected to need this share of its estimate more."""
MAX_AHEAD = 16
"""A site more tasks than this already wait for is not waited for: each task weighed plays
out the whole line ahead of it (so a flood of waiters would cost its square), and a wait
that far ahead rests on too many estimates to be worth it."""
MAX_SITES_WEIGHED = 4
"""Busy sites played out per task: those that could finish it soonest by a lower bound (the
first end there, then its run), as playing one out costs about a millisecond."""


@dataclass(frozen=True, slots=True)
class Occupant:
    """What one task at a site holds (per replica, on ``nodes``) and when it should end."""

    end: float
    """Unix time; infinite for a task with no run-time estimate."""
    nodes: tuple[str, ...]
    cpu: float
    memory_mib: float
    devices: int
    """Whole devices per replica (shares and partitions are not counted)."""
    model: str


@dataclass(frozen=True, slots=True)
class Waiter:
    """A task waiting for a site: what it needs there, and how long it then runs."""

    request: Request
    speed: float
    """It waits for devices at least this fast (those its estimate at the site assumes)."""
    run_s: float


@dataclass(frozen=True, slots=True)
class Wait:
    """The busy site a task waits for, when room should free there, and when it would finish."""

    site: str
    wait_s: float
    finish_s: float
    """From now: wait, moving its input, and its run there."""
    waiter: Waiter


def occupants(jobs: Iterable[jobs_pb2.Job], now: float) -> dict[str, list[Occupant]]:
    """Per site, what its delegated and running tasks hold and when they should end, the
    soonest first."""
    out: dict[str, list[Occupant]] = {}
    for job in jobs:
        specs: dict[str, jobs_pb2.TaskSpec] | None = None
        for task in job.tasks:
            if task.state not in job_state.AT_SITE or not task.site:
                continue
            if specs is None:
                specs = {t.name: t for t in job.spec.tasks}
            out.setdefault(task.site, []).append(_holding(task, specs[task.name], now))
    for held in out.values():
        held.sort(key=lambda h: h.end)
    return out


def _holding(task: jobs_pb2.TaskStatus, spec: jobs_pb2.TaskSpec, now: float) -> Occupant:
    started = task.started_at.ToNanoseconds() / 1e9 if task.HasField("started_at") else None
    acc = spec.resources.accelerator
    return Occupant(
        end=expected_end(task.estimate.run_s, task.estimate.transfer_s, started, now),
        nodes=tuple(task.nodes),
        cpu=spec.resources.cpu,
        memory_mib=float(spec.resources.memory_mib),
        devices=acc.count,
        model=task.estimate.device_model,
    )


def expected_end(run_s: float, transfer_s: float, started: float | None, now: float) -> float:
    """When a task at a site should end (Unix time): its start plus its estimated run, or,
    not started yet, now plus its input's transfer and its run; infinite with no run-time
    estimate, and never sooner than ``OVERRUN_LEFT`` of its run from now."""
    if run_s <= 0:
        end = math.inf
    elif started is not None:
        end = started + run_s
    else:
        end = now + transfer_s + run_s
    return max(end, now + OVERRUN_LEFT * run_s)


def predictable(req: Request) -> bool:
    """Whether a wait can be predicted for ``req``: whole devices or none, with a run-time
    estimate (shares, partitions and interconnect groups are not played out on trial). A
    service near a region is ranked by RTT, not by when it finishes: it never waits for a
    site that would finish it sooner."""
    return (
        req.duration_s > 0
        and not req.fraction
        and not req.partition
        and not req.same_interconnect
        and not req.near_region
    )


def sooner_by_waiting(
    req: Request,
    snap: Snapshot,
    busy: Sequence[int],
    now_s: float,
    holding: Mapping[str, Sequence[Occupant]],
    waiting: Mapping[str, Sequence[Waiter]],
    now: float,
    gain: float = WAIT_GAIN,
    *,
    transfer: bool = True,
) -> Wait | None:
    """The busy site where ``req`` would finish soonest once room frees there, if by ``gain``
    of ``now_s`` (when it would finish on the best site that can take it now); else None.
    ``holding`` lists each site's tasks soonest end first (``occupants``). Without
    ``transfer`` (a simulated policy blind to bandwidth) moving its input counts for
    nothing, in ``now_s`` too.

    Each site's wait is played out only as far as a wait could still win."""
    within_s = gain * now_s
    if not predictable(req) or not len(busy):
        return None
    run_s, _ = once_free(req, snap)
    after_s = _moving_s(req, snap, transfer) + run_s
    bounds = []
    for site in busy:
        name = snap.site_ids[site]
        if len(waiting.get(name, ())) > MAX_AHEAD:
            continue
        held = holding.get(name, ())
        forecast = float(snap.queue_wait_s[site])
        first = max(held[0].end - now, forecast) if held else (forecast or math.inf)
        if first + after_s[site] < within_s:
            bounds.append((first + float(after_s[site]), site))
    chosen: Wait | None = None
    for bound, site in sorted(bounds)[:MAX_SITES_WEIGHED]:
        if bound >= within_s:
            break
        found = wait_at(req, snap, site, holding, waiting, now, within_s, transfer=transfer)
        if found is not None:
            chosen, within_s = found, found.finish_s
    return chosen


def wait_at(
    req: Request,
    snap: Snapshot,
    site: int,
    holding: Mapping[str, Sequence[Occupant]],
    waiting: Mapping[str, Sequence[Waiter]],
    now: float,
    within_s: float = math.inf,
    *,
    transfer: bool = True,
) -> Wait | None:
    """When ``req`` would start and finish at busy ``site``, if it would finish within
    ``within_s``; None if not, or if nothing there is due to end."""
    run_s, speed = once_free(req, snap)
    after_s = float(_moving_s(req, snap, transfer)[site] + run_s[site])
    if after_s >= within_s:
        return None
    name = snap.site_ids[site]
    ahead = waiting.get(name, ())
    if len(ahead) > MAX_AHEAD:
        return None
    waiter = Waiter(req, float(speed[site]), float(run_s[site]))
    trial = _Trial(snap, site)
    found = frees_in(waiter, trial, holding.get(name, ()), ahead, now, within_s - after_s)
    forecast = float(snap.queue_wait_s[site])
    if found is None and 0 < forecast < within_s - after_s:
        found = forecast  # what the site sees and the coordinator does not
    if found is None or max(found, forecast) + after_s >= within_s:
        return None
    wait_s = max(found, forecast)
    return Wait(name, wait_s, wait_s + after_s, waiter)


def _moving_s(req: Request, snap: Snapshot, transfer: bool) -> F64:
    """Per site, the seconds to move ``req``'s input there (none without ``transfer``)."""
    return estimate(req, snap).transfer_s if transfer else np.zeros(snap.n_sites)


def frees_in(
    waiter: Waiter,
    trial: _Trial,
    holding: Iterable[Occupant],
    ahead: Sequence[Waiter],
    now: float,
    within_s: float,
) -> float | None:
    """Seconds until ``waiter`` fits on ``trial``'s site, by the predicted ends of what holds
    room there, once every task in ``ahead`` has taken what frees first; None if not within
    ``within_s``.

    Every other waiter counts, not only those that came earlier: what frees does not go
    strictly in arrival order (tasks that come while the site has room take it too), and in
    the simulator counting only the earlier ones waited for nothing often enough to make mean
    completion time worse than never waiting."""
    order = itertools.count()
    ends = [(h.end, next(order), h) for h in holding if h.end - now < within_s]
    heapq.heapify(ends)
    line = list(ahead)
    while ends:
        end, _, held = heapq.heappop(ends)
        if end - now >= within_s:
            return None
        trial.release(held)
        while line and trial.fits(line[0]):  # the first in line take what freed
            first = line.pop(0)
            taken = trial.take(first, end + first.run_s)
            heapq.heappush(ends, (taken.end, next(order), taken))
        if trial.fits(waiter):
            return max(0.0, end - now)
    return None


class _Trial:
    """One site's free CPU, memory and whole devices per node, released and taken on trial."""

    def __init__(self, snap: Snapshot, site: int) -> None:
        lo, hi = (int(i) for i in np.searchsorted(snap.node_site, [site, site + 1]))
        first, last = (int(i) for i in np.searchsorted(snap.pair_node, [lo, hi]))
        self._snap = snap
        self._lo, self._hi = lo, hi
        self._cpu = snap.node_cpu_free[lo:hi].copy()
        self._memory = snap.node_memory_free_mib[lo:hi].copy()
        self._pair_node = snap.pair_node[first:last] - lo
        self._pair_class = snap.pair_class[first:last]
        self._free = snap.pair_free[first:last].copy()
        self._nodes = {name: i for i, name in enumerate(snap.node_names[lo:hi])}
        self._usable: dict[
            tuple[Request, float], tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]
        ] = {}

    def release(self, held: Occupant) -> None:
        for name in held.nodes:
            node = self._nodes.get(name)
            if node is None:
                continue  # gone from the view: nothing to give back
            self._cpu[node] += held.cpu
            self._memory[node] += held.memory_mib
            if held.devices:
                # Back to its model's pair on the node (the first pair, if none is named).
                pairs = np.flatnonzero(self._pair_node == node).tolist()
                classes = self._snap.classes
                same = [p for p in pairs if classes[self._pair_class[p]].model == held.model]
                if same or pairs:
                    self._free[(same or pairs)[0]] += held.devices

    def _masks(self, waiter: Waiter) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.bool_]]:
        """Per pair, devices ``waiter`` takes (matching, and as fast as it waits for); per
        node, whether it may go there (schedulable, with its labels)."""
        key = (waiter.request, waiter.speed)
        if key not in self._usable:
            req, snap = waiter.request, self._snap
            classes = matching_classes(req, snap) & (
                class_speed(req, snap) >= waiter.speed - EPSILON
            )
            nodes = snap.node_schedulable & node_label_mask(req, snap)
            self._usable[key] = (classes[self._pair_class], nodes[self._lo : self._hi])
        return self._usable[key]

    def _room(self, waiter: Waiter) -> F64:
        """Replicas of ``waiter`` each node of the site holds on trial."""
        req = waiter.request
        fast, usable = self._masks(waiter)
        devices = np.full(len(self._cpu), np.inf)
        if req.accelerator_count:
            free = np.bincount(self._pair_node, weights=self._free * fast, minlength=len(devices))
            devices = np.floor(free / req.accelerator_count + EPSILON)
        return fit_replicas(req, self._cpu, self._memory, devices, usable)

    def fits(self, waiter: Waiter) -> bool:
        return bool(self._room(waiter).sum() >= waiter.request.replicas)

    def take(self, waiter: Waiter, end: float) -> Occupant:
        """Place ``waiter``'s replicas, fullest-fitting nodes first, and hold them until
        ``end``."""
        req = waiter.request
        room = self._room(waiter)
        names = list(self._nodes)
        nodes: list[str] = []
        model = ""
        fast, _ = self._masks(waiter)
        for node in np.argsort(-room, kind="stable").tolist():
            while len(nodes) < req.replicas and room[node] >= 1:
                room[node] -= 1
                nodes.append(names[node])
                self._cpu[node] -= req.cpu
                self._memory[node] -= req.memory_mib
                need = float(req.accelerator_count)
                for pair in np.flatnonzero((self._pair_node == node) & fast).tolist():
                    got = min(need, self._free[pair])
                    self._free[pair] -= got
                    need -= got
                    if got:
                        model = self._snap.classes[self._pair_class[pair]].model
        return Occupant(end, tuple(nodes), req.cpu, req.memory_mib, req.accelerator_count, model)
