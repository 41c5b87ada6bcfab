"""Batch retries through a real federation: a failing task runs again after its backoff, each
attempt's reason is in the job's events, and it fails for good once its attempts are used up."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2

from .conftest import jobs, python_task, spec, until, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-jobs")


def failing_until(runs: Path, succeed_at: int) -> str:
    """Code that logs each run's start and end times in ``runs`` and exits 3 until run
    ``succeed_at`` (0: never succeeds)."""
    return (
        "import sys, time\n"
        f"path = {str(runs)!r}\n"
        "n = sum(1 for _ in open(path)) + 1 if __import__('os').path.exists(path) else 1\n"
        "start = time.time(); time.sleep(0.2)\n"
        "open(path, 'a').write(f'{n} {start} {time.time()}\\n')\n"
        f"sys.exit(0 if n == {succeed_at} else 3)\n"
    )


async def submit_and_wait(
    channel: grpc.aio.Channel, job: jobs_pb2.JobSpec
) -> job_service_pb2.GetJobResponse:
    stub = jobs(channel)
    submitted = (await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))).job
    await wait_for_job(channel, submitted.id)
    request = job_service_pb2.GetJobRequest(job_id=submitted.id, include_events=True)
    return await stub.GetJob(request)


async def test_a_failing_task_runs_again_after_its_backoff(
    operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """Two failures, then success: three runs, each after the backoff (doubled the second
    time), and the events say what each failed attempt was and how long the next waits."""
    runs = tmp_path / "runs"
    task = python_task("flaky", failing_until(runs, 3), retry={"max_attempts": 4, "backoff_s": 0.5})
    got = await submit_and_wait(operator, spec("retried", [task]))
    job = got.job
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED
    assert job.tasks[0].failed_attempts == 2
    assert not job.tasks[0].HasField("retry_at")
    spans = [tuple(map(float, line.split()[1:])) for line in runs.read_text().splitlines()]
    assert len(spans) == 3
    (_, end1), (start2, end2), (start3, _) = spans
    assert start2 - end1 >= 0.5
    assert start3 - end2 >= 1.0
    reasons = [e.reason for e in got.events if e.state == jobs_pb2.JOB_STATE_PENDING]
    assert "attempt 1 of 4 failed (replica 0 exited with 3); next in 0.5s" in reasons
    assert "attempt 2 of 4 failed (replica 0 exited with 3); next in 1s" in reasons


async def test_a_task_out_of_attempts_fails_and_says_so(
    operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """Every attempt fails: the task ran exactly max_attempts times and the job failed with the
    last attempt's exit code and a reason that says none are left."""
    runs = tmp_path / "runs"
    task = python_task(
        "broken", failing_until(runs, 0), retry={"max_attempts": 2, "backoff_s": 0.1}
    )
    job = (await submit_and_wait(operator, spec("out-of-attempts", [task]))).job
    assert job.state == jobs_pb2.JOB_STATE_FAILED
    assert len(runs.read_text().splitlines()) == 2
    status = job.tasks[0]
    assert (status.failed_attempts, status.exit_code) == (2, 3)
    assert status.reason == "attempt 2 of 2 failed (replica 0 exited with 3); none left"


async def test_without_a_retry_policy_a_task_runs_once(
    operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    job = (
        await submit_and_wait(
            operator, spec("no-retry", [python_task("once", failing_until(runs, 0))])
        )
    ).job
    assert job.state == jobs_pb2.JOB_STATE_FAILED
    assert len(runs.read_text().splitlines()) == 1
    assert (job.tasks[0].failed_attempts, job.tasks[0].reason) == (1, "replica 0 exited with 3")


async def test_a_retrying_task_holds_its_siblings(
    operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """A failed attempt with attempts left does not stop the job's other tasks; they would be
    stopped only once the task fails for good."""
    runs = tmp_path / "runs"
    sibling_done = tmp_path / "sibling"
    tasks = [
        python_task("flaky", failing_until(runs, 2), retry={"max_attempts": 2, "backoff_s": 0.1}),
        python_task(
            "steady", f"import time; time.sleep(2); open({str(sibling_done)!r}, 'w').write('ok')"
        ),
    ]
    job = (await submit_and_wait(operator, spec("siblings", tasks))).job
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED
    assert sibling_done.read_text() == "ok"
    assert {t.name: t.failed_attempts for t in job.tasks} == {"flaky": 1, "steady": 0}


async def test_explain_shows_the_backoff_and_a_cancel_ends_it(
    operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """A task waiting out a long backoff is explained as such, and cancelling its job ends it
    at once rather than after the backoff."""
    runs = tmp_path / "runs"
    task = python_task(
        "slow-retry", failing_until(runs, 0), retry={"max_attempts": 2, "backoff_s": 600}
    )
    stub = jobs(operator)
    job = (await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec("backoff", [task])))).job

    async def failed_once() -> bool:
        got = await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job.id))
        return got.job.tasks[0].failed_attempts == 1

    await until(failed_once, "the first attempt to fail")
    explained = await stub.ExplainJob(job_service_pb2.ExplainJobRequest(job_id=job.id))
    (held_back,) = explained.tasks[0].held_back
    assert held_back.stage == "Retry"
    assert held_back.reason.startswith("attempt 1 failed; the next starts in ")
    await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=job.id))
    done = await wait_for_job(operator, job.id, timeout_s=10)
    assert done.state == jobs_pb2.JOB_STATE_CANCELLED
    assert len(runs.read_text().splitlines()) == 1
