"""Copies of a task that come back: record their checkpoints, or take back a kept original.

A task moved off a lost site remembers the copy it left there (``TaskStatus.displaced``).
When that site comes back and reports the copy, the job's reconcile rule
(``disconnect.original_wins``) decides: usually the replacement goes on and the original is
fenced (stopped, its result refused); with keep_original or best the original may be taken
back instead, and then the replacement is stopped.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.common import job_state
from federation.coordinator.jobs.records import (
    Change,
    Mutation,
    find_task,
    forget_devices,
    transition,
)
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.sites.disconnect import (
    is_displaced_original,
    is_newer_checkpoint,
    original_wins,
    policy_of,
)
from federation.coordinator.sites.registry import cancel_request

log = structlog.get_logger()

TellSite = Callable[[str, site_link_service_pb2.CoordinatorMessage], None]
"""Sends one message to a site, if it is connected."""


def record_checkpoint(
    task: jobs_pb2.TaskStatus, site: str, report: site_link_service_pb2.TaskReport
) -> bool:
    """Record the checkpoint a current copy reported, if it is a newer one; True if recorded."""
    reported = jobs_pb2.CheckpointRecord()
    reported.CopyFrom(report.checkpoint)
    reported.site = site  # a site speaks only for itself
    reported.epoch = report.epoch
    if reported.HasField("stored"):
        reported.stored.site = site  # in its own store
    del reported.replicas[:]  # copies are the coordinator's to record
    recorded = task.checkpoint if task.HasField("checkpoint") else None
    if not is_newer_checkpoint(recorded, reported):
        return False
    task.checkpoint.CopyFrom(reported)
    return True


class Reconciler:
    """Takes back a returning original copy when its job's reconcile rule keeps it.

    Args:
        jobs: The job repository.
        tell_site: Sends a cancel to the replacement's site.
    """

    def __init__(self, jobs: JobRepository, tell_site: TellSite) -> None:
        self._jobs = jobs
        self._tell_site = tell_site

    async def take_back(
        self,
        site: str,
        report: site_link_service_pb2.TaskReport,
        job: jobs_pb2.Job,
        task: jobs_pb2.TaskStatus,
    ) -> bool:
        """Make the original copy ``report`` speaks of current again, if the rule keeps it.

        Returns True when it is current now (the caller then applies the report as usual),
        False when it stays stale (the caller fences it off).
        """
        if not is_displaced_original(task, site, report):
            return False
        policy = policy_of(job.spec)
        if not original_wins(policy, report, task):
            log.info(
                "original_copy_refused",
                job=job.id,
                task=task.name,
                site=site,
                epoch=report.epoch,
                rule=policy.reconcile_name,
            )
            return False
        stopped: list[tuple[str, int]] = []
        reason = f"the original at {site} came back and {policy.reconcile_name} keeps it"
        updated = await self._jobs.update(
            job.id, _take_back(task.name, site, report.epoch, reason, stopped)
        )
        current = find_task(updated, task.name)
        if current.site != site or current.epoch != report.epoch:
            return False  # something else happened first
        log.warning(
            "original_copy_kept",
            job=job.id,
            task=task.name,
            site=site,
            epoch=report.epoch,
            rule=policy.reconcile_name,
            replacement=stopped,
        )
        for other_site, epoch in stopped:
            self._tell_site(
                other_site, cancel_request(job.id, task.name, epoch, f"superseded: {reason}")
            )
        return True


def _take_back(
    task_name: str, site: str, epoch: int, reason: str, stopped: list[tuple[str, int]]
) -> Mutation:
    """Replacement (wherever it is) back to PENDING, then the original RUNNING at ``site``."""

    def mutate(job: jobs_pb2.Job) -> list[Change]:
        task = find_task(job, task_name)
        if job_state.is_terminal(task.state) or not (
            task.displaced.site == site and task.displaced.epoch == epoch
        ):
            return []
        stopped.clear()
        changes = []
        if task.state in job_state.AT_SITE:
            stopped.append((task.site, task.epoch))
            change = transition(job, task_name, job_state.PENDING, f"replacement stopped: {reason}")
            changes.append(Change(change.task, change.state, change.reason, task.site, task.site))
        elif task.state == job_state.SCHEDULING:
            changes.append(transition(job, task_name, job_state.PENDING, reason))
        task.ClearField("displaced")
        task.site = site
        task.epoch = epoch
        task.reservation_id = ""
        forget_devices(task)
        changes.append(
            transition(
                job, task_name, job_state.RUNNING, f"running at {site}: {reason}", taking_back=True
            )
        )
        return changes

    return mutate
