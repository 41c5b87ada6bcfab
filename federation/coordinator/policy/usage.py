"""What each queue's tasks hold now, kept as jobs change, never by walking every job."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.coordinator.policy.resources import Demand, at, demand
from federation.resources import add


class QueueUsage:
    """Per queue, the resources of its jobs' tasks that are placed or running, or whose
    offers are out (so a negotiation in flight already counts: no over-admission).

    A placed task counts at its site and in its domain too, with the models of the devices
    it was given; a negotiation counts what it was admitted with (``Scheduler``: at every
    site it may be offered to, with every model it may be given there)."""

    def __init__(self, domain_of: Callable[[str], str] = lambda site: "") -> None:
        self._domain_of = domain_of
        self._jobs: dict[str, tuple[str, dict[str, float]]] = {}
        self._queues: dict[str, dict[str, float]] = {}
        self.version = 0
        """Counts the changes of what queues hold: unchanged, so is what depends on it."""

    def update(self, job: jobs_pb2.Job, negotiating: Mapping[tuple[str, str], Demand]) -> None:
        """``job`` changed (or its tasks' negotiations began or ended)."""
        holds: dict[str, float] = {}
        job_id = job.id
        for spec, status in zip(job.spec.tasks, job.tasks, strict=False):
            admitted = negotiating.get((job_id, status.name))
            if admitted is not None:
                add(holds, admitted.items())
            elif status.state in job_state.AT_SITE:
                held = placed(spec, status)
                add(holds, at(held, status.site, self._domain_of(status.site)).items())
        queue = job.spec.queue
        if (old := self._jobs.get(job_id)) is not None and old == (queue, holds):
            return  # most changes of a job change none of what it holds
        self.remove(job_id)
        if holds:
            self._jobs[job_id] = (queue, holds)
            self._add(queue, holds, 1.0)

    def remove(self, job_id: str) -> None:
        """``job_id`` ended: what it held is free."""
        old = self._jobs.pop(job_id, None)
        if old is not None:
            self._add(old[0], old[1], -1.0)

    def of(self, queue: str) -> Mapping[str, float]:
        """What ``queue``'s own jobs hold ("" for jobs in no queue)."""
        return self._queues.get(queue, {})

    def totals(self) -> Mapping[str, Mapping[str, float]]:
        """Per queue, what its own jobs hold now (read it, never change it)."""
        return self._queues

    def copy(self) -> dict[str, dict[str, float]]:
        """Per queue, what its own jobs hold now."""
        return {queue: dict(totals) for queue, totals in self._queues.items()}

    def _add(self, queue: str, holds: Mapping[str, float], sign: float) -> None:
        self.version += 1
        totals = self._queues.setdefault(queue, {})
        for resource, amount in holds.items():
            left = totals.get(resource, 0.0) + sign * amount
            if abs(left) < 1e-9:
                totals.pop(resource, None)
            else:
                totals[resource] = left
        if not totals:
            self._queues.pop(queue, None)


def placed(spec: jobs_pb2.TaskSpec, status: jobs_pb2.TaskStatus) -> Demand:
    """What a task placed at a site holds against its queue (before ``at`` that site)."""
    return demand(spec, _models(spec, status))


def _models(spec: jobs_pb2.TaskSpec, status: jobs_pb2.TaskStatus) -> list[str]:
    """The model of each device the task holds: as its site reported them, or until it has,
    the model its site accepted the offer with (one per device, or per share)."""
    if status.models or not status.estimate.device_model:
        return list(status.models)
    acc = spec.resources.accelerator
    entries = (acc.count or 1) * (spec.replicas or 1)
    return [status.estimate.device_model] * entries
