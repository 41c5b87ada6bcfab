"""Predicted waits through real agents: a long task waits for the busy fast site rather than
start now on a slow one, and a short one does not."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2
from federation.local import LocalFederation

from .conftest import admin, gpu_site, jobs, python_task, running, spec, until, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-waits")

RUNNING = frozenset({jobs_pb2.JOB_STATE_RUNNING})
H100 = {"accelerator": {"kind": "GPU", "count": 1, "models": ["H100-80GB"]}}
ANY_GPU = {"accelerator": {"kind": "GPU", "count": 1}}


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    """``fast``: one H100 (2.5x an A100 for training); ``slow``: one V100 (0.38x)."""
    sites = [gpu_site("fast", 1, "H100-80GB"), gpu_site("slow", 1, "V100")]
    with running(tmp_path_factory.mktemp("waits"), sites) as fed:
        yield fed


async def _submit(channel: grpc.aio.Channel, name: str, task: dict[str, object]) -> str:
    reply = await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec(name, [task])))
    return reply.job.id


async def _site(channel: grpc.aio.Channel, name: str) -> admin_service_pb2.Site:
    reply = await admin(channel).ListSites(admin_service_pb2.ListSitesRequest())
    (site,) = [s for s in reply.sites if s.name == name]
    return site


async def _holding_the_h100(channel: grpc.aio.Channel, holder: str) -> None:
    """Until the holder runs and the fast site's view shows its H100 taken (else a task
    placed meanwhile is offered there and declined, as the view said it was free)."""
    await wait_for_job(channel, holder, until=RUNNING)

    async def taken() -> bool:
        fast = await _site(channel, "fast")
        return all(d.allocated for n in fast.view.nodes for d in n.devices)

    await until(taken, "the fast site's view to show its H100 taken", timeout_s=10)


async def test_a_long_task_waits_for_the_fast_site(operator: grpc.aio.Channel) -> None:
    """The H100 is held by a task due to end in 4 s (10 s of A100 work). A task of 1,000 s of
    A100 work would take 2,632 s on the free V100 but 400 s on the H100 after the wait: it
    waits, saying for what, and then runs on the H100."""
    holder = await _submit(
        operator,
        "holder",
        python_task("t", "import time; time.sleep(4)", resources=H100, estimated_duration_s=10),
    )
    await _holding_the_h100(operator, holder)
    long = await _submit(
        operator,
        "long",
        python_task("t", "print('ran')", resources=ANY_GPU, estimated_duration_s=1000),
    )

    async def waiting() -> bool:
        reply = await jobs(operator).GetJob(job_service_pb2.GetJobRequest(job_id=long))
        verdicts = reply.job.tasks[0].verdicts
        return bool(verdicts) and verdicts[0].stage == "Wait"

    await until(waiting, "the long task to wait for the fast site", timeout_s=10)
    reply = await jobs(operator).GetJob(job_service_pb2.GetJobRequest(job_id=long))
    task = reply.job.tasks[0]
    assert task.state == jobs_pb2.JOB_STATE_PENDING
    assert task.verdicts[0].site == "fast"
    assert "waits for room at fast" in task.reason
    explained = await jobs(operator).ExplainJob(job_service_pb2.ExplainJobRequest(job_id=long))
    (fast,) = [s for s in explained.tasks[0].sites if s.site == "fast"]
    assert fast.code == "INSUFFICIENT_FREE_CAPACITY"
    assert 0 <= fast.estimate.queue_s <= 4  # the predicted wait
    assert fast.estimate.run_s == pytest.approx(400.0)
    forecast = (await _site(operator, "fast")).forecast
    assert forecast.tasks == 1
    assert forecast.waiting == 1
    assert 0 <= forecast.next_free_s <= 4
    done = await wait_for_job(operator, long)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.tasks[0].reason
    assert done.tasks[0].site == "fast"
    assert done.tasks[0].estimate.device_model == "H100-80GB"
    assert (await wait_for_job(operator, holder)).state == jobs_pb2.JOB_STATE_SUCCEEDED
    forecast = (await _site(operator, "fast")).forecast
    assert (forecast.tasks, forecast.waiting, forecast.next_free_s) == (0, 0, -1)
    assert forecast.arrivals_per_hour > 1.9  # two tasks, a few seconds ago
    assert 0 < forecast.mean_run_s < 10  # the holder's 4 s and the long task's moment


async def test_a_short_task_starts_now_on_the_slow_site(operator: grpc.aio.Channel) -> None:
    """The H100 is held for a predicted 400 s: a task of 10 s of A100 work (26 s on the V100)
    does not wait for it."""
    holder = await _submit(
        operator,
        "holder",
        python_task("t", "import time; time.sleep(600)", resources=H100, estimated_duration_s=1000),
    )
    try:
        await _holding_the_h100(operator, holder)
        short = await _submit(
            operator,
            "short",
            python_task("t", "print('ran')", resources=ANY_GPU, estimated_duration_s=10),
        )
        done = await wait_for_job(operator, short)
        assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.tasks[0].reason
        assert done.tasks[0].site == "slow"
        assert not any(v.stage == "Wait" for v in done.tasks[0].verdicts)
    finally:
        await jobs(operator).CancelJob(job_service_pb2.CancelJobRequest(job_id=holder))
        await wait_for_job(operator, holder)


async def test_a_wait_ends_when_its_promise_is_broken(operator: grpc.aio.Channel) -> None:
    """The H100's holder was to end in 4 s but runs on: the long task, told a wait of about
    4 s, waits no longer than that and its slack before it starts on the free V100."""
    holder = await _submit(
        operator,
        "overrunning",
        python_task("t", "import time; time.sleep(60)", resources=H100, estimated_duration_s=10),
    )
    await _holding_the_h100(operator, holder)
    long = await _submit(
        operator,
        "patient",
        python_task("t", "print('ran')", resources=ANY_GPU, estimated_duration_s=1000),
    )
    done = await wait_for_job(operator, long, timeout_s=40)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.tasks[0].reason
    assert done.tasks[0].site == "slow"
    holding = await jobs(operator).GetJob(job_service_pb2.GetJobRequest(job_id=holder))
    assert holding.job.state == jobs_pb2.JOB_STATE_RUNNING  # it did not wait the holder out
    await jobs(operator).CancelJob(job_service_pb2.CancelJobRequest(job_id=holder))
