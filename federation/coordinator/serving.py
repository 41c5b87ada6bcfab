"""Service jobs as clients see them: the endpoints of their replicas, now and as they change.

Endpoints live in each task's status, written from its site's reports without a job event
(a readiness flap is not history): watchers follow the job's writes (``EventHub.follow``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from federation.api.v1 import jobs_pb2
from federation.coordinator import job_state
from federation.coordinator.events import EventHub
from federation.coordinator.job_manager import JobManager
from federation.errors import UnimplementedError
from federation.security.identity import Identity


def endpoints_of(job: jobs_pb2.Job, ready_only: bool = False) -> list[jobs_pb2.Endpoint]:
    """Every replica of the job's service tasks, task by task, as their sites reported."""
    return [e for task in job.tasks for e in task.endpoints if e.ready or not ready_only]


class Serving:
    """Endpoints of service jobs, for the callers that may see the jobs."""

    def __init__(self, manager: JobManager, hub: EventHub) -> None:
        self._manager = manager
        self._hub = hub

    async def endpoints(self, caller: Identity, job_id: str) -> tuple[str, list[jobs_pb2.Endpoint]]:
        """The job's full id and its endpoints; NOT_FOUND for a job the caller may not see."""
        job = await self._manager.get(caller, job_id)
        return job.id, endpoints_of(job)

    async def watch(
        self, caller: Identity, job_id: str, ready_only: bool
    ) -> AsyncIterator[list[jobs_pb2.Endpoint]]:
        """The endpoints now, then each time they change; ends once the job has ended (with
        an empty list), or raises as the hub closes (the coordinator stepped down)."""
        job = await self._manager.get(caller, job_id)
        changed = self._hub.follow(job.id)
        try:
            sent: list[jobs_pb2.Endpoint] | None = None
            while True:
                now = endpoints_of(job, ready_only)
                if now != sent:
                    yield now
                    sent = now
                if job_state.is_terminal(job.state):
                    return
                await changed.wait()
                changed.clear()
                if self._hub.closed is not None:
                    raise self._hub.closed
                job = await self._manager.get(caller, job.id)
        finally:
            self._hub.unfollow(job.id, changed)

    async def scale(self, caller: Identity, job_id: str, task: str, replicas: int) -> None:
        await self._manager.get(caller, job_id)  # NOT_FOUND before anything else
        raise UnimplementedError(
            "scaling a running service needs a coordinator-to-site message that changes a "
            "committed task's replicas, which this release's site link lacks; to fix: cancel "
            "the job and submit it again with the replicas wanted"
        )

    async def update(self, caller: Identity, job_id: str, spec: jobs_pb2.TaskSpec) -> None:
        await self._manager.get(caller, job_id)
        raise UnimplementedError(
            "a rolling update of a running service needs a coordinator-to-site message that "
            "replaces a committed task's spec replica by replica, which this release's site "
            "link lacks; to fix: submit the new version as another job, then cancel the old"
        )
