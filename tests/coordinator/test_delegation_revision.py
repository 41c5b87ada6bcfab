"""A service's spec changed while its task was offered: the offer's answer does not delegate
it, so the old spec never runs where the store says the new one does."""

from __future__ import annotations

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.coordinator.scheduling.delegation import mark_delegated


def pending_job(revision: int) -> jobs_pb2.Job:
    job = jobs_pb2.Job(id="web-1")
    job.spec.tasks.add(name="web", kind=jobs_pb2.TASK_KIND_SERVICE, replicas=2)
    job.tasks.add(name="web", state=job_state.PENDING, revision=revision)
    return job


def test_an_offer_of_an_older_revision_is_not_delegated() -> None:
    job = pending_job(revision=1)
    assert mark_delegated("web", "edge-a", 1, 0, "r-1", None)(job) == []
    assert (job.tasks[0].state, job.tasks[0].site) == (job_state.PENDING, "")


def test_an_offer_of_the_current_revision_is_delegated() -> None:
    job = pending_job(revision=1)
    [change] = mark_delegated("web", "edge-a", 1, 1, "r-1", None)(job)
    assert change.state == job_state.DELEGATED
    assert (job.tasks[0].site, job.tasks[0].reservation_id) == ("edge-a", "r-1")
