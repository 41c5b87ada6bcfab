"""A service near a region, through real agents: it lands at the site with the shortest
declared RTT to the region, where without near_region the default profile picks another."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.local import LocalFederation, SiteSpec

from .conftest import jobs, python_task, running, spec, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-near-region")


def box(cores: int) -> dict[str, object]:
    return {"name": "box", "cpu_cores": cores, "memory_mib": 65536}


def rtt_to(peer: str, rtt_ms: float) -> dict[str, object]:
    return {"links": [{"peer": peer, "bandwidth_mbps": 1000.0, "rtt_ms": rtt_ms}]}


# The region's own site is too small for the service; of the two that can take it, the
# roomier one is 90 ms from the region, the smaller one 8 ms.
SITES = [
    SiteSpec("eu-clients", "edge", region="eu-west", nodes=[box(1)]),
    SiteSpec(
        "eu-near", "edge", region="eu-central", nodes=[box(4)], settings=rtt_to("eu-clients", 8)
    ),
    SiteSpec(
        "us-big", "datacenter", region="us-east", nodes=[box(64)], settings=rtt_to("eu-clients", 90)
    ),
]


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    with running(tmp_path_factory.mktemp("near"), SITES) as f:
        yield f


def web(name: str, **policy: object) -> jobs_pb2.JobSpec:
    task = python_task(
        "api",
        "import time; time.sleep(600)",
        kind="TASK_KIND_SERVICE",
        service=policy,
        resources={"cpu": 2, "memory_mib": 64},
    )
    return spec(name, [task])


async def test_a_service_near_a_region_lands_at_the_nearest_site(fed: LocalFederation) -> None:
    """With near_region eu-west the service runs at eu-near (8 ms), not at us-big, where the
    same service without it runs (more room); explain shows the RTT each site was ranked by."""
    running_ = frozenset({jobs_pb2.JOB_STATE_RUNNING})
    async with fed.operator().channel() as channel:
        placed = {}
        for name, policy in (("anywhere", {}), ("near", {"nearRegion": "eu-west"})):
            job = (
                await jobs(channel).SubmitJob(
                    job_service_pb2.SubmitJobRequest(spec=web(name, **policy))
                )
            ).job
            placed[name] = await wait_for_job(channel, job.id, until=running_)
        reply = await jobs(channel).ExplainJob(
            job_service_pb2.ExplainJobRequest(job_id=placed["near"].id)
        )
        for job in placed.values():
            await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=job.id))
            await wait_for_job(channel, job.id)
    assert placed["anywhere"].tasks[0].site == "us-big"
    assert placed["near"].tasks[0].site == "eu-near"
    (task,) = reply.tasks
    assert "eu-near 8.0 ms (to eu-clients), us-big 90.0 ms (to eu-clients)" in task.note
    scores = {s.site: s.scores["NearRegion"] for s in task.sites if s.feasible}
    assert scores["eu-near"] > scores["us-big"]
