"""A mixed site runs a task on the devices its estimate named, through real agents."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.cli.render import estimate_line
from federation.local import LocalFederation, SiteSpec

from .conftest import jobs, python_task, running, spec, wait_for_job

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
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    """This module's own federation (``operator`` from conftest connects to it)."""
    with running(tmp_path_factory.mktemp("promise"), [SITE]) as fed:
        yield fed


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
    assert ran.estimate.device_model == "H100-80GB"


async def test_estimates_learn_from_finished_tasks(operator: grpc.aio.Channel) -> None:
    """Tasks estimated at 24 s on an H100 finish in about a second: once a few have, the
    coordinator estimates the next one from what it measured, with the spread it saw, and
    fedctl jobs get shows the estimate against the outcome."""
    stub = jobs(operator)

    async def run_one(name: str) -> jobs_pb2.Job:
        task = python_task(
            "t",
            "import time; time.sleep(0.5)",
            resources={"accelerator": {"kind": "GPU", "count": 1, "models": ["H100-80GB"]}},
            estimated_duration_s=60,
            workload_class="inference-learned",
        )
        reply = await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec(name, [task])))
        job = await wait_for_job(operator, reply.job.id)
        assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, job.tasks[0].reason
        return job

    first = await run_one("learn-0")
    assert first.tasks[0].estimate.run_s == pytest.approx(60 / 2.5)  # the table's H100
    for i in range(1, 3):
        await run_one(f"learn-{i}")
    learned = (await run_one("learn-3")).tasks[0]
    # Measured between the RUNNING and the final report: about 0.5 s, never 24.
    assert 0.2 < learned.estimate.run_s < 5.0, learned.estimate
    assert learned.estimate.device_model == "H100-80GB"
    shown = estimate_line(learned)
    assert "on H100-80GB; ran" in shown
