"""Every job file in examples/jobs/ parses and passes the coordinator's checks, and runs as it
is on the demo's federation (the sites of ``fedctl demo``): batch jobs succeed, the service's
replicas come up ready. The container example needs sites that run images and reach its
registry: here every demo site says why it does not (``test_containers.py`` runs its task)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import (
    job_service_pb2,
    jobs_pb2,
    serving_service_pb2,
    serving_service_pb2_grpc,
)
from federation.cli.demo import DEMO_SITES
from federation.jobspec import load_job_specs
from federation.local import LocalFederation

from .conftest import jobs, running, until, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-examples")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "jobs"
ALL = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
CONTAINER = "container.yaml"
BATCH = [name for name in ALL if name not in ("service.yaml", CONTAINER)]


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    with running(tmp_path_factory.mktemp("examples"), DEMO_SITES) as fed:
        yield fed


async def submit(channel: grpc.aio.Channel, name: str) -> jobs_pb2.Job:
    (spec,) = load_job_specs(EXAMPLES / name)
    return (await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec))).job


def test_every_example_is_run_here() -> None:
    assert {"cpu-job.yaml", "gpu-gang.yaml", "pipeline.yaml", "checkpointed.yaml"} <= set(BATCH)
    assert {*BATCH, "service.yaml", CONTAINER} == set(ALL)


@pytest.mark.parametrize("name", ALL)
async def test_every_example_parses_and_passes_the_checks(
    federation: LocalFederation, name: str
) -> None:
    """Each file is one job the coordinator accepts as it is (a dry run: nothing stored), and
    some site could take each of its tasks, or says why not."""
    (spec,) = load_job_specs(EXAMPLES / name)
    async with federation.operator().channel() as channel:
        request = job_service_pb2.SubmitJobRequest(spec=spec, validate_only=True)
        reply = await jobs(channel).SubmitJob(request)
    assert [t.name for t in reply.job.spec.tasks] == [t.name for t in spec.tasks]
    assert {t.task for t in reply.placement} == {t.name for t in spec.tasks}


async def test_the_container_example_is_refused_by_each_demo_site_saying_why(
    federation: LocalFederation,
) -> None:
    """The demo's sites run tasks as the agent, and containers take the tenant's account: the
    explanation says so at each site."""
    (spec,) = load_job_specs(EXAMPLES / CONTAINER)
    async with federation.operator().channel() as channel:
        request = job_service_pb2.SubmitJobRequest(spec=spec, validate_only=True)
        (task,) = (await jobs(channel).SubmitJob(request)).placement
    assert {s.site for s in task.sites} == {site.name for site in DEMO_SITES}
    for site in task.sites:
        assert not site.feasible
        assert [(r.stage, r.code) for r in site.rejections][:1] == [
            ("ImagePolicy", "IMAGE_REFUSED")
        ]
        assert "its tasks run as the agent's own account" in site.rejections[0].reason


@pytest.mark.parametrize("name", BATCH)
async def test_a_batch_example_succeeds(federation: LocalFederation, name: str) -> None:
    async with federation.operator().channel() as channel:
        job = await wait_for_job(channel, (await submit(channel, name)).id)
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, [t.reason for t in job.tasks]
    if name == "gpu-gang.yaml":
        assert "CUDA_VISIBLE_DEVICES=" in job.tasks[0].output_tail
    if name == "pipeline.yaml":
        assert job.tasks[0].site == "edge-shanghai"
    if name == "checkpointed.yaml":
        assert "/checkpoints/step-" in job.tasks[0].checkpoint.path


async def test_the_service_example_comes_up_ready(federation: LocalFederation) -> None:
    async with federation.operator().channel() as channel:
        job = await submit(channel, "service.yaml")
        serving = serving_service_pb2_grpc.ServingServiceStub(channel)
        request = serving_service_pb2.ListEndpointsRequest(job_id=job.id)

        async def ready() -> bool:
            reply = await serving.ListEndpoints(request)
            return sum(e.ready for e in reply.endpoints) == 2

        await until(ready, "both replicas of the example service to be ready", timeout_s=30)
        await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=job.id))
        ended = await wait_for_job(channel, job.id)
    assert ended.state == jobs_pb2.JOB_STATE_CANCELLED
