"""What a site's report of a task changes in its job: whether the report is about the task's
current delegation, the transitions it makes (preempted, placed again, a failed attempt,
crash loops), and the acknowledgement the site gets."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.common import job_state
from federation.coordinator.jobs import retries
from federation.coordinator.jobs.records import (
    Change,
    find_spec,
    forget_devices,
    transition,
    unplace,
)
from federation.service_policy import RestartPolicy

log = structlog.get_logger()

MAX_REPORT_REASON = 1024
MAX_OUTPUT_TAIL = 4096
"""What a site's report may put in a job (characters; the rest is cut): each transition rewrites
the job's record with its kept events, and etcd refuses a value over 1.5 MiB."""


def reports_on(
    task: jobs_pb2.TaskStatus, site: str, report: site_link_service_pb2.TaskReport
) -> bool:
    """Whether ``report`` from ``site`` is about the delegation ``task`` holds now."""
    return task.site == site and task.epoch == report.epoch and task.state in job_state.AT_SITE


def stages_on(task: jobs_pb2.TaskStatus, site: str, epoch: int) -> bool:
    """Whether ``task`` is delegated to ``site`` in ``epoch`` and not started yet: when its
    inputs are staged in."""
    return task.site == site and task.epoch == epoch and task.state == job_state.DELEGATED


@dataclass(slots=True)
class ReportEffects:
    """What applying one report implies beyond the write (set by its mutation)."""

    superseded: bool = False
    """The task moved on since the report was checked: fence the report off."""
    siblings: list[tuple[str, str, int]] = field(default_factory=list)
    """(site, task, epoch) of sibling tasks to cancel because this one failed."""
    uploaded: jobs_pb2.CheckpointRecord | None = None
    """A checkpoint recorded as uploaded, for another site to keep a copy of."""


def crash_loop_changes(
    job: jobs_pb2.Job, task: jobs_pb2.TaskStatus, endpoints: Sequence[jobs_pb2.Endpoint]
) -> list[Change]:
    """An event (the task still RUNNING) and a log line for each replica of a service that
    starts or stops crash-looping in ``endpoints`` against the task's endpoints so far."""
    before = {e.replica: e.crash_looping for e in task.endpoints}
    changes = []
    for endpoint in endpoints:
        if endpoint.crash_looping == before.get(endpoint.replica, False):
            continue
        log.warning(
            "replica_crash_loop" if endpoint.crash_looping else "replica_crash_loop_over",
            job=job.id,
            task=task.name,
            replica=endpoint.replica,
            restarts=endpoint.restarts,
        )
        if endpoint.crash_looping:
            # The agent's rule, with the defaults the API names filled in.
            policy = RestartPolicy.of(find_spec(job, task.name).service)
            reason = (
                f"replica {endpoint.replica} is crash-looping: {policy.crash_loop_after} "
                f"restarts in a row after runs shorter than {policy.min_run_s:g}s; "
                f"restarted every {policy.max_backoff_s:g}s"
            )
        else:
            reason = f"replica {endpoint.replica} is no longer crash-looping"
        changes.append(Change(task.name, task.state, reason, task.site))
    return changes


def back_from_preemption(job: jobs_pb2.Job, task: jobs_pb2.TaskStatus) -> Change:
    """A preempted task has stopped: back to PENDING, to restart from its newest checkpoint
    (``request_for`` reads it) wherever it is placed next."""
    by = task.preempted_by
    task.preempted_by = ""
    task.preemptions += 1
    unplace(task)
    forget_devices(task)
    restart = (
        f"restarts from checkpoint {task.checkpoint.path}"
        if task.checkpoint.path
        else "restarts from the start (no checkpoint)"
    )
    return transition(job, task.name, job_state.PENDING, f"preempted by {by}; {restart}")


def waiting_again(
    job: jobs_pb2.Job, task: jobs_pb2.TaskStatus, site: str, why: str
) -> list[Change]:
    """A running task its site put back in its own queue (Slurm requeued it): DELEGATED, with
    no devices and no start until the site reports it running again."""
    if task.state != job_state.RUNNING:
        return []
    forget_devices(task)
    del task.endpoints[:]
    task.ClearField("started_at")
    reason = f"waiting again at {site}: {why or 'back in its queue'}"[:MAX_REPORT_REASON]
    return [transition(job, task.name, job_state.DELEGATED, reason)]


def placed_again(job: jobs_pb2.Job, task: jobs_pb2.TaskStatus, why: str) -> Change:
    """A copy its site stopped for a reason of its own: back to PENDING, no attempt used."""
    unplace(task)
    forget_devices(task)
    restart = f"from checkpoint {task.checkpoint.path}" if task.checkpoint.path else "anew"
    return transition(job, task.name, job_state.PENDING, f"{why}; placing it again {restart}")


def failed_attempt(job: jobs_pb2.Job, task: jobs_pb2.TaskStatus, why: str) -> Change:
    """A failed run: counted, and back to PENDING after its backoff while the task has
    attempts left; FAILED once it has none."""
    spec = find_spec(job, task.name)
    task.failed_attempts += 1
    most = retries.max_attempts(spec)
    if most == 1:
        return transition(job, task.name, job_state.FAILED, why)
    if task.failed_attempts >= most:
        reason = f"attempt {task.failed_attempts} of {most} failed ({why}); none left"
        return transition(job, task.name, job_state.FAILED, reason)
    delay_s = retries.backoff_s(spec, task.failed_attempts)
    task.retry_at.FromNanoseconds(time.time_ns() + int(delay_s * 1e9))
    task.ClearField("started_at")  # the next attempt's run time is its own (speed learning)
    unplace(task)
    forget_devices(task)
    reason = f"attempt {task.failed_attempts} of {most} failed ({why}); next in {delay_s:g}s"
    return transition(job, task.name, job_state.PENDING, reason)


def ack(report: site_link_service_pb2.TaskReport) -> site_link_service_pb2.CoordinatorMessage:
    return site_link_service_pb2.CoordinatorMessage(
        ack=site_link_service_pb2.TaskStatusAck(
            job_id=report.job_id, task=report.task, epoch=report.epoch
        )
    )


def default_reason(report: site_link_service_pb2.TaskReport) -> str:
    if report.state == job_state.SUCCEEDED:
        return "exited 0"
    if report.state == job_state.FAILED:
        return f"exited with {report.exit_code}"
    return "cancelled"


def ran_s(task: jobs_pb2.TaskStatus) -> float:
    """How long a task that ended ran, NaN if it never started."""
    if not (task.HasField("started_at") and task.HasField("finished_at")):
        return math.nan
    return (task.finished_at.ToNanoseconds() - task.started_at.ToNanoseconds()) / 1e9
