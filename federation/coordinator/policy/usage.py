"""What each queue's tasks hold now, kept as jobs change, never by walking every job."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet

from federation.api.v1 import jobs_pb2
from federation.coordinator import job_state
from federation.coordinator.policy.resources import demand


class QueueUsage:
    """Per queue, the resources of its jobs' tasks that are placed or running, or whose
    offers are out (so a negotiation in flight already counts: no over-admission)."""

    def __init__(self) -> None:
        self._jobs: dict[str, tuple[str, dict[str, float]]] = {}
        self._queues: dict[str, dict[str, float]] = {}

    def update(self, job: jobs_pb2.Job, negotiating: AbstractSet[tuple[str, str]]) -> None:
        """``job`` changed (or its tasks' negotiations began or ended)."""
        holds: dict[str, float] = {}
        for spec, status in zip(job.spec.tasks, job.tasks, strict=False):
            if status.state in job_state.AT_SITE or (job.id, status.name) in negotiating:
                for resource, amount in demand(spec).items():
                    holds[resource] = holds.get(resource, 0.0) + amount
        self.remove(job.id)
        if holds:
            self._jobs[job.id] = (job.spec.queue, holds)
            self._add(job.spec.queue, holds, 1.0)

    def remove(self, job_id: str) -> None:
        """``job_id`` ended: what it held is free."""
        old = self._jobs.pop(job_id, None)
        if old is not None:
            self._add(old[0], old[1], -1.0)

    def of(self, queue: str) -> Mapping[str, float]:
        """What ``queue``'s own jobs hold ("" for jobs in no queue)."""
        return self._queues.get(queue, {})

    def _add(self, queue: str, holds: Mapping[str, float], sign: float) -> None:
        totals = self._queues.setdefault(queue, {})
        for resource, amount in holds.items():
            left = totals.get(resource, 0.0) + sign * amount
            if abs(left) < 1e-9:
                totals.pop(resource, None)
            else:
                totals[resource] = left
        if not totals:
            self._queues.pop(queue, None)
