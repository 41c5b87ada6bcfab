"""Services that follow their load: the coordinator sets an autoscaled service's replicas
from the load its replicas report (``ServicePolicy.autoscale``), as Kubernetes'
HorizontalPodAutoscaler does on a per-replica target.

Each second, per running autoscaled task: the load of the replicas that are not draining,
summed, over the target load of one replica gives the replicas wanted (within min and max; a
load within 10 % of the target changes nothing). More replicas are asked for at once; fewer
only after ``scale_down_after_s`` in which no higher number was wanted (the highest wanted in
that window is taken), and never twice within that time. A change goes through
``Serving``: its site makes it in place, within the job's queue, and takes a replica away by
draining it (``federation.agent.embedded_core``). A change refused (quota, no room at the
site) is said once in the job's events, and tried again each second.
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
from federation.coordinator.jobs.records import Change, find_task
from federation.coordinator.jobs.repository import JobRepository
from federation.errors import FederationError

log = structlog.get_logger()

AUTOSCALE_EVERY_S = 1.0
DEFAULT_SCALE_DOWN_AFTER_S = 30.0
TOLERANCE = 0.1
"""A load within this share of the target changes nothing (no flapping around a boundary)."""

Scale = Callable[[str, str, int, str], Awaitable[object]]
"""Sets the replicas of a job's task, for the reason given (``Serving.autoscale``)."""


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


class Autoscaler:
    """Scales the autoscaled services this term's jobs hold."""

    def __init__(
        self, jobs: JobRepository, scale: Scale, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._jobs = jobs
        self._scale = scale
        self._clock = clock
        self._seen: dict[tuple[str, str], _Seen] = {}

    async def run(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(AUTOSCALE_EVERY_S)

    async def step(self) -> None:
        now = self._clock()
        looked: set[tuple[str, str]] = set()
        for job_id, spec, status in self._autoscaled():
            key = (job_id, spec.name)
            looked.add(key)
            try:
                await self._consider(key, spec, status, now)
            except Exception:  # one service's trouble does not stop the others'
                log.exception("autoscale_failed", job=job_id, task=spec.name)
        for key in self._seen.keys() - looked:
            del self._seen[key]

    def _autoscaled(self) -> list[tuple[str, jobs_pb2.TaskSpec, jobs_pb2.TaskStatus]]:
        found = []
        for job in self._jobs.at_site():
            for spec in job.spec.tasks:
                if not spec.service.HasField("autoscale"):  # services only (checked at submit)
                    continue
                status = find_task(job, spec.name)
                if status.state == job_state.RUNNING:
                    found.append((job.id, spec, status))
        return found

    async def _consider(
        self,
        key: tuple[str, str],
        spec: jobs_pb2.TaskSpec,
        status: jobs_pb2.TaskStatus,
        now: float,
    ) -> None:
        scale = spec.service.autoscale
        running = spec.replicas or 1
        serving = [e for e in status.endpoints if not e.draining]
        if len(serving) != running:
            return  # a change is under way at the site: judge the replicas once it is made
        want = wanted_replicas(scale, running, [e.load for e in serving])
        seen = self._seen.setdefault(key, _Seen())
        window = scale.scale_down_after_s or DEFAULT_SCALE_DOWN_AFTER_S
        seen.wanted.append((now, want))
        while seen.wanted and seen.wanted[0][0] < now - window:
            seen.wanted.popleft()
        total = sum(e.load for e in serving)
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
            await self._scale(key[0], key[1], target, why)
        except FederationError as exc:
            if str(exc) != seen.refused:
                seen.refused = str(exc)
                log.info("autoscale_refused", job=key[0], task=key[1], want=target, why=str(exc))
                await self._say(key, f"autoscale wants {target} replicas: {exc}")
            return
        seen.refused = ""
        if target < running:
            seen.last_down = now
        log.info("autoscaled", job=key[0], task=key[1], replicas=target, load=total)

    async def _say(self, key: tuple[str, str], reason: str) -> None:
        """An event on the task, its state unchanged."""

        def note(job: jobs_pb2.Job) -> list[Change]:
            task = find_task(job, key[1])
            return [Change(key[1], task.state, reason, task.site)]

        await self._jobs.update(key[0], note)
