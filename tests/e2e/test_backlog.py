"""Room that comes free goes to the first job in line that could use it, over real agents,
even behind a backlog of jobs no site has the hardware for.

Room freed by a task's end clears the retry timers of the front of the line only (its first
``FRONT_OF_LINE`` jobs). It once counted jobs that every site refused for hardware it lacks:
a backlog of them at the head of the line took the whole front, was placed again at every
task's end, and the job behind it that the room was for waited out its own retry timer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.coordinator.scheduling.config import FRONT_OF_LINE
from federation.local import LocalFederation

from .conftest import gpu_site, jobs, python_task, running, spec, until
from .test_queues import gpu_job, states

pytestmark = pytest.mark.xdist_group("e2e-backlog")

RUNNING, SUCCEEDED = jobs_pb2.JOB_STATE_RUNNING, jobs_pb2.JOB_STATE_SUCCEEDED
WAITED_S = 17.0
"""How long the job behind the backlog waits for room before the room frees: its retries
come 0.5, 1.5, 3.5, 7.5, 15.5 and 31.5 s after its submission, so its own timer is then
more than 14 s away."""


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    root = tmp_path_factory.mktemp("backlog")
    config = root / "coordinator.toml"
    config.write_text("retry_interval_s = 60.0\n")  # a waiting job's timer may grow long
    with running(root / "fed", [gpu_site("bl-a", 1)], ["--config", str(config)]) as fed:
        yield fed


def fpga_job(name: str) -> jobs_pb2.JobSpec:
    """A job no site can take: none has an FPGA."""
    task = python_task("t", "pass", resources={"accelerator": {"kind": "FPGA", "count": 1}})
    return spec(name, [task])


async def test_freed_room_passes_a_backlog_no_site_can_take(
    operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    stub = jobs(operator)
    release = tmp_path / "release"
    hold = await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=gpu_job("hold", "", release)))

    async def held() -> bool:
        return (await states(operator, [hold.job.id]))[hold.job.id] == RUNNING

    await until(held, "the only GPU held")
    backlog = [fpga_job(f"fpga-{i}") for i in range(FRONT_OF_LINE + 8)]
    reply = await stub.SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=backlog))
    waiting = await stub.SubmitJob(
        job_service_pb2.SubmitJobRequest(spec=gpu_job("behind", "", release))
    )
    submitted = time.monotonic()
    last_fpga = reply.jobs[-1].id

    async def tried() -> bool:
        ids = [last_fpga, waiting.job.id]
        got = [(await stub.GetJob(job_service_pb2.GetJobRequest(job_id=i))).job for i in ids]
        return all(job.reason.startswith("no site can take it now") for job in got)

    await until(tried, "the backlog and the job behind it tried once")
    got = await stub.GetJob(job_service_pb2.GetJobRequest(job_id=waiting.job.id))
    assert got.job.state == jobs_pb2.JOB_STATE_PENDING
    assert {v.code for v in got.job.tasks[0].verdicts} == {"INSUFFICIENT_FREE_CAPACITY"}
    await asyncio.sleep(max(0.0, submitted + WAITED_S - time.monotonic()))
    release.touch()
    freed = time.monotonic()

    async def placed() -> bool:
        state = (await states(operator, [waiting.job.id]))[waiting.job.id]
        return state in (RUNNING, SUCCEEDED)

    await until(placed, "the job behind placed once the GPU freed", timeout_s=30)
    # Its own timer was over 14 s away: the freed room woke it, past the backlog.
    assert time.monotonic() - freed < 10
    still = await states(operator, [j.id for j in reply.jobs])
    assert set(still.values()) == {jobs_pb2.JOB_STATE_PENDING}
