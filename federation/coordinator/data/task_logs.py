"""A replica's output lines, read through the coordinator from the site that ran it.

The site keeps each replica's lines (``agent.task_logs``); the coordinator asks its agent over
the stream (``ReadLogs``), never copies them, and passes them on: a tenant reads only its own
jobs' (``JobManager.get``). Following asks again after the last line read, every
``FOLLOW_EVERY_S``, until the run it started on has ended and nothing new came.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from federation.api.v1 import job_service_pb2, jobs_pb2, site_link_service_pb2
from federation.common import job_state
from federation.coordinator.jobs.manager import JobManager
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.sites.registry import SessionClosedError, SiteRegistry
from federation.errors import (
    FailedPreconditionError,
    FieldViolation,
    InvalidArgumentError,
    UnavailableError,
)
from federation.security.identity import Identity

LOGS_PROTOCOL = 6
"""The site-link protocol from which agents answer ReadLogs."""
FOLLOW_EVERY_S = 0.5
READ_TIMEOUT_S = 10.0


class TaskLogs:
    def __init__(self, manager: JobManager, jobs: JobRepository, sites: SiteRegistry) -> None:
        self._manager = manager
        self._jobs = jobs
        self._sites = sites

    async def stream(
        self, caller: Identity, request: job_service_pb2.StreamLogsRequest
    ) -> AsyncIterator[job_service_pb2.StreamLogsResponse]:
        job = await self._manager.get(caller, request.job_id)
        task = _task(job, request.task, request.replica)
        site, epoch = task.site, task.epoch
        read = site_link_service_pb2.ReadLogs(
            job_id=job.id,
            task=task.name,
            epoch=epoch,
            replica=request.replica,
            since_ns=request.since.ToNanoseconds() if request.HasField("since") else 0,
            tail_lines=request.tail_lines,
        )
        while True:
            answer = await self._ask(site, read)
            if answer.lines:
                read.after_ns = answer.lines[-1].stamp_ns
                yield job_service_pb2.StreamLogsResponse(lines=answer.lines, site=site, epoch=epoch)
            if answer.more:
                continue
            if not request.follow:
                return
            if self._run_ended(job.id, task.name, epoch):
                if not answer.lines:
                    return
                continue  # once more, for lines written as it ended
            await asyncio.sleep(FOLLOW_EVERY_S)

    async def _ask(
        self, site: str, read: site_link_service_pb2.ReadLogs
    ) -> site_link_service_pb2.LogsAnswer:
        session = self._sites.session(site)
        if session is None:
            raise UnavailableError(
                f"site {site}, which ran the task, is not connected; its logs are kept there"
            )
        if session.protocol < LOGS_PROTOCOL:
            raise FailedPreconditionError(
                f"the agent at site {site} speaks site-link protocol {session.protocol}; "
                f"reading logs needs {LOGS_PROTOCOL} or later. To fix: upgrade the agent at {site}"
            )
        request = site_link_service_pb2.CoordinatorMessage(read_logs=read)
        (reply,) = await session.request_many([request], READ_TIMEOUT_S)
        if isinstance(reply, SessionClosedError | TimeoutError):
            raise UnavailableError(f"site {site} did not answer for the logs; try again")
        if reply.logs_answer.error:
            raise FailedPreconditionError(f"site {site}: {reply.logs_answer.error}")
        return reply.logs_answer

    def _run_ended(self, job_id: str, task_name: str, epoch: int) -> bool:
        """Whether the run read from is over: the task ended, or moved on to another run."""
        job = self._jobs.cached(job_id)
        if job is None:
            return True  # finished, out of the active cache
        task = next((t for t in job.tasks if t.name == task_name), None)
        return task is None or task.epoch != epoch or task.state not in job_state.AT_SITE


def _task(job: jobs_pb2.Job, name: str, replica: int) -> jobs_pb2.TaskStatus:
    """The task the request names (the only one when it names none), placed somewhere."""
    if not name and len(job.tasks) == 1:
        name = job.tasks[0].name
    task = next((t for t in job.tasks if t.name == name), None)
    if task is None:
        names = ", ".join(t.name for t in job.tasks)
        why = "is required: the job has several tasks" if not name else "is not a task of it"
        raise InvalidArgumentError([FieldViolation("task", f"{why} ({names})")])
    spec = next(s for s in job.spec.tasks if s.name == task.name)
    if replica >= max(1, spec.replicas):
        raise InvalidArgumentError(
            [FieldViolation("replica", f"task {name} has {max(1, spec.replicas)} replica(s)")]
        )
    if not task.site or not task.epoch:
        raise FailedPreconditionError(f"task {name} has not run anywhere yet: no logs")
    return task
