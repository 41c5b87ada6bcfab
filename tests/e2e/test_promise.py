"""A mixed site runs a task on the devices its estimate named, through real agents."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
import pytest_asyncio

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.local import LocalFederation, SiteSpec

from .conftest import jobs, python_task, spec, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-promise")


def gpus(name: str, model: str, count: int) -> dict[str, object]:
    return {
        "name": name,
        "cpu_cores": 16,
        "memory_mib": 65536,
        "devices": [
            {"kind": "GPU", "vendor": "nvidia", "model": model, "memory_mib": 16384, "count": count}
        ],
    }


# The lone T4 is the tightest fit and first in every tie: best fit alone would take it.
SITE = SiteSpec(
    "mixed-gpus", "datacenter", nodes=[gpus("a-t4", "T4", 1), gpus("b-h100", "H100-80GB", 8)]
)


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    federation = LocalFederation(tmp_path_factory.mktemp("promise"), [SITE])
    try:
        asyncio.run(federation.start())
        yield federation
    finally:
        federation.stop()


@pytest_asyncio.fixture
async def operator(fed: LocalFederation) -> AsyncIterator[grpc.aio.Channel]:
    async with fed.operator().channel() as channel:
        yield channel


async def test_the_task_runs_on_the_device_its_estimate_named(
    operator: grpc.aio.Channel,
) -> None:
    """The estimate assumed an H100 (60 s of A100 work in 24 s); the task ran on one, and the
    estimate the job shows is the one the site committed to."""
    task = python_task(
        "t",
        "import os; print(os.environ['FEDERATION_DEVICES'])",
        resources={"accelerator": {"kind": "GPU", "count": 1}},
        estimated_duration_s=60,
    )
    stub = jobs(operator)
    reply = await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec("promise", [task])))
    job = await wait_for_job(operator, reply.job.id)
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, job.tasks[0].reason
    ran = job.tasks[0]
    assert list(ran.nodes) == ["b-h100"]
    assert list(ran.devices) == ["b-h100:GPU:0"]
    assert ran.estimate.device_speed == 2.5
    assert ran.estimate.run_s == pytest.approx(24.0)
