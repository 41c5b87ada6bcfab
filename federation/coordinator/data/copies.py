"""Copies that keep data reachable beyond the site that made it: each uploaded checkpoint
kept by a second site, and the outputs of a task whose site's store other sites cannot reach
pushed to one they can, each copy recorded in the job."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

from federation.api.v1 import jobs_pb2
from federation.common.keys import TaskKey
from federation.coordinator.data.checkpoint_copies import copy_checkpoint, copy_object
from federation.coordinator.jobs.records import Change, find_task
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.sites.registry import SiteRegistry

log = structlog.get_logger()

COPY_ASK_TIMEOUT_S = 10.0
"""How long a site may take to sign the URLs of a copy."""


class Copies:
    """The copies under way, each in the background."""

    def __init__(self, jobs: JobRepository, sites: SiteRegistry) -> None:
        self._jobs = jobs
        self._sites = sites
        self._tasks: set[asyncio.Task[None]] = set()
        """Checkpoint copies and pushes under way (held so they are not garbage-collected)."""
        self._pushing: set[TaskKey] = set()
        """Tasks whose outputs are being pushed out of a store other sites cannot reach."""

    def _start(self, copying: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.create_task(copying)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def push_outputs(self, job_id: str, task_name: str) -> None:
        """Push the outputs of a task that succeeded at a site whose store other sites cannot
        reach to a reachable store, unless that is under way. Asked when it succeeds, and by
        the scheduler when a dependant finds no reachable copy (a new leader, say)."""
        key = (job_id, task_name)
        if key in self._pushing or (job := self._jobs.cached(job_id)) is None:
            return
        self._pushing.add(key)
        self._start(self._push_outputs(job, task_name)).add_done_callback(
            lambda _: self._pushing.discard(key)
        )

    async def _push_outputs(self, job: jobs_pb2.Job, task_name: str) -> None:
        """The outputs of a task whose site's store other sites cannot reach are pushed to
        a reachable site's store, and the copies recorded: dependants elsewhere stage them
        from there."""
        task = find_task(job, task_name)
        tenant = job.spec.tenant or "_"
        for artifact in task.artifacts:
            if not artifact.key or artifact.partial or artifact.copies:
                continue
            below = "/".join((tenant, job.id, task_name, str(task.epoch), artifact.name))
            try:
                copy = await copy_object(
                    artifact, tenant, below, 0, {artifact.site}, self._sites, COPY_ASK_TIMEOUT_S
                )
            except Exception:  # a bug must not go unseen in a task nobody awaits
                log.exception("output_push_failed", job=job.id, task=task_name)
                return
            if isinstance(copy, str):
                log.warning("output_not_pushed", job=job.id, task=task_name, reason=copy)
                continue

            def mutate(
                job: jobs_pb2.Job,
                name: str = artifact.name,
                key: str = artifact.key,
                copy: jobs_pb2.Artifact = copy,
            ) -> list[Change]:
                for current in find_task(job, task_name).artifacts:
                    if (current.name, current.key) == (name, key):
                        current.copies.append(copy)
                return []

            await self._jobs.update(job.id, mutate)
            log.info("output_pushed", job=job.id, task=task_name, site=copy.site, key=copy.key)

    def copy_checkpoint(
        self, job: jobs_pb2.Job, task_name: str, record: jobs_pb2.CheckpointRecord
    ) -> None:
        """Has another site keep a copy of an uploaded checkpoint, and records it while it is
        still the task's newest."""
        self._start(self._copy(job, task_name, record))

    async def _copy(
        self, job: jobs_pb2.Job, task_name: str, record: jobs_pb2.CheckpointRecord
    ) -> None:
        try:
            copy = await copy_checkpoint(job, task_name, record, self._sites, COPY_ASK_TIMEOUT_S)
        except Exception:  # a bug must not go unseen in a task nobody awaits
            log.exception("checkpoint_copy_failed", job=job.id, task=task_name)
            return
        if isinstance(copy, str):
            log.warning("checkpoint_not_copied", job=job.id, task=task_name, reason=copy)
            return

        def mutate(job: jobs_pb2.Job) -> list[Change]:
            current = find_task(job, task_name).checkpoint
            if (current.stored.site, current.stored.key) == (record.stored.site, record.stored.key):
                current.replicas.append(copy)
            return []

        await self._jobs.update(job.id, mutate)
        log.info("checkpoint_copied", job=job.id, task=task_name, site=copy.site, key=copy.key)
