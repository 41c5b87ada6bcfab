"""Services that follow their load: the coordinator sets an autoscaled service's replicas
from the load its replicas report (``ServicePolicy.autoscale``), as Kubernetes'
HorizontalPodAutoscaler does on a per-replica target.

Each second, per running autoscaled task: the load of the replicas that are not draining,
summed, over the target load of one replica gives the replicas wanted (within min and max; a
load within 10 % of the target changes nothing). More replicas are asked for at once; fewer
only after ``scale_down_after_s`` in which no higher number was wanted (the highest wanted in
that window is taken), and never twice within that time. A change goes through
``Serving``: its site makes it in place, within the job's queue, and takes a replica away by
draining it (``federation.agent.embedded_core``). A change refused (quota) is said once in the
job's events, and tried again each second.

Past one site: when the task's site has no room for the replicas wanted, as many as it takes
are added there and the rest go elsewhere as another part of the service, a task
``NAME/N`` (``TaskStatus.part_of`` names the service task) with the service's spec and the
replicas left over, which the scheduling cycle places as any task (the same placement, the
same admission against the job's queue: a part it cannot place waits in line, said there).
Each part has its own endpoints, which ``Serving`` lists with the others. The service's
replicas are then the sum over its task and its parts (never below min nor above max in
total), and its load is that of all of them. A later scale-up fills the task first, then the
newest part, then adds a part. A scale-down takes from the newest part first: a part
whose replicas are all to go is stopped whole, its site draining each replica before it stops
it (``Serving.remove_part``); otherwise the part shrinks in place; the task shrinks only once
no part is left. A part not placed yet is dropped as soon as the load no longer needs it.
Why parts and not a new mechanism: the parts of divided tasks (``jobs.spread``) already go
through the scheduler, quota, endpoints, reports and fencing as tasks; an overflow part is one
such task, added while the job runs.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.coordinator.jobs.records import Change, find_spec, find_task
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.jobs.spread import part_number
from federation.errors import FederationError

log = structlog.get_logger()

AUTOSCALE_EVERY_S = 1.0
DEFAULT_SCALE_DOWN_AFTER_S = 30.0
TOLERANCE = 0.1
"""A load within this share of the target changes nothing (no flapping around a boundary)."""

Scale = Callable[[str, str, int, str], Awaitable[object]]
"""Sets the replicas of a job's task, for the reason given (``Serving.autoscale``)."""
AddPart = Callable[[str, str, int, str], Awaitable[str]]
"""Adds a part with the replicas given to a job's service task (``Serving.add_part``)."""
RemovePart = Callable[[str, str, str], Awaitable[None]]
"""Stops a part of a service, drained (``Serving.remove_part``)."""
NO_ROOM = "no room"
"""In a site's refusal of a change for want of room (``embedded_core.change``)."""


def wanted_replicas(scale: jobs_pb2.Autoscale, running: int, loads: list[float]) -> int:
    """The replicas the load asks for: ceil(total load / target), within min and max; the
    replicas that run when their average is within TOLERANCE of the target."""
    total = sum(loads)
    if running and abs(total / (running * scale.target_load) - 1) <= TOLERANCE:
        want = running
    else:
        want = math.ceil(total / scale.target_load)
    return max(scale.min_replicas, min(scale.max_replicas, want))


@dataclass
class _Seen:
    """What the autoscaler remembers of one task."""

    wanted: deque[tuple[float, int]] = field(default_factory=deque)
    """(when, replicas wanted) within the scale-down window."""
    last_down: float = -math.inf
    refused: str = ""
    """Why the last change was refused, said once in the job's events."""
    removing: set[str] = field(default_factory=set)
    """The parts being stopped (drained at their site), counted no more."""


Member = tuple[jobs_pb2.TaskSpec, jobs_pb2.TaskStatus]


class Autoscaler:
    """Scales the autoscaled services this term's jobs hold."""

    def __init__(
        self,
        jobs: JobRepository,
        scale: Scale,
        clock: Callable[[], float] = time.monotonic,
        add_part: AddPart | None = None,
        remove_part: RemovePart | None = None,
    ) -> None:
        """Without ``add_part`` and ``remove_part`` a service stays at its own site."""
        self._jobs = jobs
        self._scale = scale
        self._clock = clock
        self._add_part = add_part
        self._remove_part = remove_part
        self._seen: dict[tuple[str, str], _Seen] = {}

    async def run(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(AUTOSCALE_EVERY_S)

    async def step(self) -> None:
        now = self._clock()
        looked: set[tuple[str, str]] = set()
        for job_id, spec, status, parts in self._autoscaled():
            key = (job_id, spec.name)
            looked.add(key)
            try:
                await self._consider(key, spec, status, parts, now)
            except Exception:  # one service's trouble does not stop the others'
                log.exception("autoscale_failed", job=job_id, task=spec.name)
        for key in self._seen.keys() - looked:
            del self._seen[key]

    def _autoscaled(
        self,
    ) -> list[tuple[str, jobs_pb2.TaskSpec, jobs_pb2.TaskStatus, list[Member]]]:
        """Each running autoscaled service task, with its overflow parts that have not ended
        (oldest first); the parts are scaled with their task, never on their own."""
        found = []
        for job in self._jobs.at_site():
            for spec in job.spec.tasks:
                if not spec.service.HasField("autoscale"):  # services only (checked at submit)
                    continue
                status = find_task(job, spec.name)
                if status.part_of and not spec.HasField("spread"):
                    continue  # an overflow part: scaled with its service task
                if status.state == job_state.RUNNING:
                    parts = [
                        (find_spec(job, t.name), t)
                        for t in job.tasks
                        if t.part_of == spec.name and not job_state.is_terminal(t.state)
                    ]
                    parts.sort(key=lambda m: part_number(m[1].name))
                    found.append((job.id, spec, status, parts))
        return found

    async def _consider(
        self,
        key: tuple[str, str],
        spec: jobs_pb2.TaskSpec,
        status: jobs_pb2.TaskStatus,
        parts: list[Member],
        now: float,
    ) -> None:
        scale = spec.service.autoscale
        seen = self._seen.setdefault(key, _Seen())
        seen.removing &= {t.name for _, t in parts}
        parts = [m for m in parts if m[1].name not in seen.removing]
        placed = [m for m in parts if m[1].state == job_state.RUNNING]
        members = [(spec, status), *placed]
        running = sum(s.replicas or 1 for s, _ in members)
        serving = [e for _, t in members for e in t.endpoints if not e.draining]
        if len(serving) != running:
            return  # a change is under way at a site: judge the replicas once it is made
        want = wanted_replicas(scale, running, [e.load for e in serving])
        total = sum(e.load for e in serving)
        unplaced = [m for m in parts if m[1].state != job_state.RUNNING]
        if unplaced:
            # A part on its way: wait for it, unless the load no longer needs it.
            if want <= running and self._remove_part is not None:
                for _, task in unplaced:
                    if task.state == job_state.PENDING:
                        seen.removing.add(task.name)
                        why = f"autoscale no longer needs part {task.name}: load {total:g}"
                        await self._remove_part(key[0], task.name, why)
            return
        window = scale.scale_down_after_s or DEFAULT_SCALE_DOWN_AFTER_S
        seen.wanted.append((now, want))
        while seen.wanted and seen.wanted[0][0] < now - window:
            seen.wanted.popleft()
        if want > running:
            target = want
        elif want < running and now - seen.last_down >= window:
            # The highest wanted over the window, and only once the window is full of readings.
            target = max(w for _, w in seen.wanted)
            if seen.wanted[0][0] > now - window + AUTOSCALE_EVERY_S * 1.5 or target >= running:
                return
        else:
            return
        why = (
            f"autoscaled from {running} to {target} replicas: load {total:g} "
            f"for a target of {scale.target_load:g} a replica"
        )
        try:
            if target > running:
                await self._grow(key, members, target - running, why)
            elif (reached := await self._shrink(key, seen, members, running - target, why)) and (
                reached == target
            ):
                seen.last_down = now
        except FederationError as exc:
            if str(exc) != seen.refused:
                seen.refused = str(exc)
                log.info("autoscale_refused", job=key[0], task=key[1], want=target, why=str(exc))
                await self._say(key, f"autoscale wants {target} replicas: {exc}")
            return
        seen.refused = ""
        log.info("autoscaled", job=key[0], task=key[1], replicas=target, load=total)

    async def _grow(
        self, key: tuple[str, str], members: list[Member], extra: int, why: str
    ) -> None:
        """Adds ``extra`` replicas: as many as the task's site takes, then the newest part's,
        then a new part with the rest. Raises a refusal other than for room (quota, say)."""
        if self._add_part is None:
            spec = members[0][0]
            await self._scale(key[0], spec.name, (spec.replicas or 1) + extra, why)
            return
        for spec, _ in [members[0], *members[1:][-1:]]:
            for more in range(extra, 0, -1):
                try:
                    await self._scale(key[0], spec.name, (spec.replicas or 1) + more, why)
                except FederationError as exc:
                    if NO_ROOM not in str(exc):
                        raise
                    continue
                extra -= more
                break
            if not extra:
                return
        await self._add_part(key[0], key[1], extra, f"{why}; {extra} placed as another part")

    async def _shrink(
        self, key: tuple[str, str], seen: _Seen, members: list[Member], fewer: int, why: str
    ) -> int:
        """Takes ``fewer`` replicas away, from the newest part first: stopped whole (drained)
        when all of its replicas are to go, else shrunk in place; returns the replicas left."""
        running = sum(s.replicas or 1 for s, _ in members)
        spec, task = members[-1]
        have = spec.replicas or 1
        if len(members) > 1 and fewer >= have and self._remove_part is not None:
            seen.removing.add(task.name)
            note = f"{why}; part {task.name} ({have} at {task.site}) drained and stopped"
            await self._remove_part(key[0], task.name, note)
            return running - have
        take = min(fewer, have - 1)
        await self._scale(key[0], spec.name, have - take, why)
        return running - take

    async def _say(self, key: tuple[str, str], reason: str) -> None:
        """An event on the task, its state unchanged."""

        def note(job: jobs_pb2.Job) -> list[Change]:
            task = find_task(job, key[1])
            return [Change(key[1], task.state, reason, task.site)]

        await self._jobs.update(key[0], note)
