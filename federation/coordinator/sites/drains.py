"""Drains: an operator empties a site, or one node of it, for maintenance.

A drain cordons what it drains (nothing new lands there), then stops each task there that
checkpoints at once and every other task once the drain's deadline passes, as preemption stops
a task: its site stops it (SIGTERM, the stop grace, then SIGKILL), its final report puts it back
to PENDING, and it is placed again elsewhere, from its newest checkpoint if it has one. A task
without a deadline to meet runs to its end. The drain stays, with the tasks it has left, until
an uncordon ends it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence

import structlog

from federation.api.v1 import admin_service_pb2, jobs_pb2
from federation.common import job_state
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.policy.preemption import TaskAt
from federation.coordinator.sites.registry import SiteRegistry

log = structlog.get_logger()

DRAIN_EVERY_S = 1.0
"""How often drains look for tasks to stop: a deadline is kept to about this."""

Stop = Callable[[Sequence[TaskAt], str], Awaitable[None]]
"""Stops tasks as preemption does, for the reason given (``Scheduler.stop``)."""


def tasks_drained(
    jobs: JobRepository, site: str, node: str
) -> Iterator[tuple[jobs_pb2.Job, jobs_pb2.TaskStatus]]:
    """The tasks at ``site`` (on ``node``, if named) that a drain there waits for."""
    for job in jobs.at_site():  # the cached messages, not a copy of every job a second
        for task in job.tasks:
            if task.site != site or task.state not in job_state.AT_SITE:
                continue
            if not node or node in task.nodes:
                yield job, task


def with_progress(jobs: JobRepository, site: admin_service_pb2.Site) -> admin_service_pb2.Site:
    """``site`` with each of its drains' tasks left counted now."""
    for drain in site.drains:
        drain.tasks_left = sum(1 for _ in tasks_drained(jobs, site.name, drain.node))
    return site


def _checkpoints(job: jobs_pb2.Job, task: jobs_pb2.TaskStatus) -> bool:
    spec = next((t for t in job.spec.tasks if t.name == task.name), None)
    return spec is not None and spec.HasField("checkpoint")


class Drains:
    """Stops what the sites' drains hold, once each task may be stopped."""

    def __init__(self, sites: SiteRegistry, jobs: JobRepository, stop: Stop) -> None:
        self._sites = sites
        self._jobs = jobs
        self._stop = stop

    async def run(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(DRAIN_EVERY_S)

    async def step(self) -> None:
        """Stop every drained task that checkpoints, and the others past their deadline."""
        now = time.time()
        for site, drain in self._sites.drained():
            past_deadline = drain.HasField("deadline") and drain.deadline.ToSeconds() <= now
            where = f"site {site}" + (f" node {drain.node}" if drain.node else "")
            due = [
                TaskAt(job.id, task.name, site, task.epoch)
                for job, task in tasks_drained(self._jobs, site, drain.node)
                if not task.preempted_by and (past_deadline or _checkpoints(job, task))
            ]
            if due:
                log.info("drain_stopping", site=site, node=drain.node or None, tasks=len(due))
                await self._stop(due, f"the drain of {where}")
