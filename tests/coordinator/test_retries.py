"""What a final report does to a task's attempts: a failure uses one up and waits out the
backoff; a preemption or a copy its site stopped on its own (interrupted) uses none."""

from __future__ import annotations

import time

import pytest

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.coordinator.jobs import retries
from federation.coordinator.jobs.records import Change, find_task

from .test_reconcile import CAN, Federation, _run_at, bodies, fed, report

__all__ = ["fed"]  # the fixture, imported for pytest

FAILED, PENDING = job_state.FAILED, job_state.PENDING


async def running_at_a(fed: Federation, retry: jobs_pb2.RetryPolicy | None = None) -> None:
    """Job j with task t running at site a, epoch 1."""
    job = jobs_pb2.Job(id="j", state=PENDING)
    job.spec.id = job.spec.name = "j"
    spec = job.spec.tasks.add(name="t", command=["x"])
    if retry is not None:
        spec.retry.CopyFrom(retry)
    job.tasks.add(name="t", state=PENDING)
    await fed.jobs.create([job])
    await fed.jobs.update("j", _run_at("a"))


def failed(epoch: int = 1, code: int = 3) -> jobs_pb2.JobState.ValueType:
    out = report(epoch, FAILED)
    out.exit_code = code
    return out


@pytest.mark.parametrize(
    ("policy", "failed_so_far", "wait_s"),
    [
        (jobs_pb2.RetryPolicy(), 1, 10.0),
        (jobs_pb2.RetryPolicy(backoff_s=2), 1, 2.0),
        (jobs_pb2.RetryPolicy(backoff_s=2), 3, 8.0),
        (jobs_pb2.RetryPolicy(backoff_s=2, max_backoff_s=5), 3, 5.0),
        (jobs_pb2.RetryPolicy(backoff_s=300), 4, 600.0),
        (jobs_pb2.RetryPolicy(backoff_s=1), 200, 600.0),
    ],
)
def test_backoff_doubles_up_to_its_cap(
    policy: jobs_pb2.RetryPolicy, failed_so_far: int, wait_s: float
) -> None:
    spec = jobs_pb2.TaskSpec(retry=policy)
    assert retries.backoff_s(spec, failed_so_far) == wait_s


async def test_a_failure_with_attempts_left_waits_out_its_backoff(fed: Federation) -> None:
    await running_at_a(fed, jobs_pb2.RetryPolicy(max_attempts=3, backoff_s=30))
    before = time.time()
    await fed.manager.apply_report("a", failed())
    task = await fed.task()
    assert (task.state, task.failed_attempts, task.site) == (PENDING, 1, "")
    assert task.reason == "attempt 1 of 3 failed (exited with 3); next in 30s"
    assert 29 < retries.due_in_s(task, before) <= 30.5
    assert not task.HasField("started_at")
    assert ("ack", 1) in bodies(fed.sent("a"))


async def test_the_last_attempt_fails_the_task(fed: Federation) -> None:
    await running_at_a(fed, jobs_pb2.RetryPolicy(max_attempts=2, backoff_s=1))
    await fed.manager.apply_report("a", failed())
    await fed.jobs.update("j", _run_at("b"))
    await fed.manager.apply_report("b", failed(epoch=2, code=4))
    task = await fed.task()
    assert (task.state, task.failed_attempts, task.exit_code) == (FAILED, 2, 4)
    assert task.reason == "attempt 2 of 2 failed (exited with 4); none left"


async def test_an_interrupted_copy_is_placed_again_without_using_an_attempt(
    fed: Federation,
) -> None:
    await running_at_a(fed, jobs_pb2.RetryPolicy(max_attempts=2))
    stopped = report(1, CAN)
    stopped.interrupted = True
    stopped.reason = "cut off from every coordinator for 31s"
    await fed.manager.apply_report("a", stopped)
    task = await fed.task()
    assert (task.state, task.failed_attempts, task.site) == (PENDING, 0, "")
    assert (
        task.reason == "stopped by a: cut off from every coordinator for 31s; placing it again anew"
    )
    assert not task.HasField("retry_at")
    assert ("ack", 1) in bodies(fed.sent("a"))


async def test_an_interrupted_copy_of_a_cancelled_job_ends_cancelled(fed: Federation) -> None:
    await running_at_a(fed)

    def cancel(job: jobs_pb2.Job) -> list[Change]:
        job.cancel_requested = True
        return []

    await fed.jobs.update("j", cancel)
    stopped = report(1, CAN)
    stopped.interrupted = True
    await fed.manager.apply_report("a", stopped)
    assert (await fed.task()).state == CAN


async def test_a_preempted_copy_that_exits_non_zero_uses_no_attempt(fed: Federation) -> None:
    await running_at_a(fed, jobs_pb2.RetryPolicy(max_attempts=2))

    def preempt(job: jobs_pb2.Job) -> list[Change]:
        find_task(job, "t").preempted_by = "k/u"
        return []

    await fed.jobs.update("j", preempt)
    await fed.manager.apply_report("a", failed(code=143))
    task = await fed.task()
    assert (task.state, task.failed_attempts, task.preemptions) == (PENDING, 0, 1)
