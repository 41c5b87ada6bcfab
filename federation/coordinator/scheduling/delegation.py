"""What a negotiation writes in the job record (DELEGATED at its epoch, back to PENDING with
the reasons) and the spans it traces for each offer and commit."""

from __future__ import annotations

import structlog

from federation import tracing
from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.common import job_state
from federation.coordinator.jobs.records import Change, Mutation, find_task, transition, unplace
from federation.coordinator.scheduling.offers import Negotiation
from federation.coordinator.scheduling.verdicts import summarize
from federation.errors import FederationError

log = structlog.get_logger()


def to_pending(
    job: jobs_pb2.Job, task: jobs_pb2.TaskStatus, verdicts: list[jobs_pb2.SiteVerdict]
) -> Change:
    """Put ``task`` (of ``job``) back to PENDING with the reasons no site took it."""
    del task.verdicts[:]
    task.verdicts.extend(verdicts)
    return transition(job, task.name, job_state.PENDING, summarize(verdicts))


def stay_pending(task_name: str, verdicts: list[jobs_pb2.SiteVerdict]) -> Mutation:
    """Record why a waiting task fits nowhere; nothing when the reasons are the same."""

    def mutate(job: jobs_pb2.Job) -> list[Change]:
        task = find_task(job, task_name)
        if task.state != job_state.PENDING or list(task.verdicts) == verdicts:
            return []
        return [to_pending(job, task, verdicts)]

    return mutate


def mark_delegated(
    task_name: str,
    site: str,
    epoch: int,
    revision: int,
    reservation_id: str,
    estimated: jobs_pb2.Estimate | None,
) -> Mutation:
    def mutate(job: jobs_pb2.Job) -> list[Change]:
        task = find_task(job, task_name)
        if task.state != job_state.PENDING or max(task.epoch, task.issued_epoch) >= epoch:
            return []  # cancelled, or another delegation went first
        if task.revision != revision:
            return []  # its spec changed while offered: offered again, as it is now
        task.epoch = task.issued_epoch = epoch
        task.site = site
        task.reservation_id = reservation_id
        if estimated is not None:
            task.estimate.CopyFrom(estimated)
        del task.verdicts[:]
        task.ClearField("retry_at")  # its backoff, if it had one, is over
        change = transition(job, task_name, job_state.DELEGATED, f"{site} accepted")
        return [change]

    return mutate


def back_from_site(task_name: str, epoch: int, reason: str) -> Mutation:
    def mutate(job: jobs_pb2.Job) -> list[Change]:
        task = find_task(job, task_name)
        if task.state != job_state.DELEGATED or task.epoch != epoch:
            return []
        unplace(task)
        return [transition(job, task_name, job_state.PENDING, reason)]

    return mutate


def back_to_pending(n: Negotiation) -> Mutation:
    """A negotiation that found no site: its task back to PENDING with its verdicts."""
    task_name, verdicts = n.task, n.verdicts

    def mutate(job: jobs_pb2.Job) -> list[Change]:
        task = find_task(job, task_name)
        # Its own delegation here means no commit left, or its site refused the commit
        # and writing that down failed: the bumped epoch of the next try fences it.
        if task.state != job_state.PENDING and not delegated_as(task, n):
            return []
        unplace(task)
        # Epochs offered in vain are recorded, so the task's next offers go above them.
        task.issued_epoch = max(task.issued_epoch, n.epoch)
        return [to_pending(job, task, verdicts)]

    return mutate


def delegated_as(task: jobs_pb2.TaskStatus, n: Negotiation) -> bool:
    """Whether ``task`` is DELEGATED as ``n`` wrote it: its epoch, site and reservation."""
    return (
        task.state == job_state.DELEGATED
        and task.epoch == n.epoch
        and (task.site, task.reservation_id) == n.chosen
    )


def task_of(
    written: dict[str, jobs_pb2.Job | FederationError], n: Negotiation
) -> jobs_pb2.TaskStatus | None:
    """The task as written, or None (logged) when its job could not be written."""
    job = written[n.job_id]
    if isinstance(job, FederationError):
        log.warning("negotiation_failed", job=n.job_id, task=n.task, error=str(job))
        return None
    return find_task(job, n.task)


def trace_offer(
    n: Negotiation,
    site: str,
    asked_ns: int,
    answer: site_link_service_pb2.OfferAnswer | None,
    why: str,
) -> None:
    """``task.offer``: one site's answer to its offer, from the round's asking to its answer.
    A refusal is an answer, not a failure: its reason is an attribute."""
    attributes: dict[str, tracing.Value] = {"federation.accepted": answer is not None}
    if answer is not None:
        attributes["federation.offer.run_s"] = answer.run_s
        attributes["federation.offer.device_model"] = answer.device_model
    else:
        attributes["federation.reason"] = why
    tracing.record(
        "task.offer",
        n.job_id,
        asked_ns,
        task=n.task,
        site=site,
        epoch=n.epoch,
        attributes=attributes,
    )


def trace_commit(n: Negotiation, site: str, started_ns: int, why: str) -> None:
    """``task.commit``: from writing DELEGATED to the site's answer (``why``: not started)."""
    if not tracing.on():
        return
    tracing.record(
        "task.commit",
        n.job_id,
        started_ns,
        task=n.task,
        site=site,
        epoch=n.epoch,
        error=why,
        attributes={"federation.started": not why},
    )
