"""Elastic cloud capacity, end to end: a cloud site runs no A100 node now but may launch two
of type a100x2 (2 A100 each, $8 a node-hour, about 3 s to launch with the simulated provider,
which starts no machine: a declared fake for hardware this machine lacks), beside a
datacenter site whose A100s are partly busy for an hour. A 2 x 2-GPU gang goes to the cloud:
its estimate adds the launch delay and charges the nodes from launch to end; the nodes launch
on commit, the job runs there and succeeds, and once idle the nodes are released."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2, resources_pb2
from federation.local import LocalFederation, SiteSpec

from .conftest import admin, jobs, running, until, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-elastic")

A100 = {"kind": "GPU", "vendor": "nvidia", "model": "A100-80GB", "memory_mib": 81920}
LAUNCH_S = 3.0
PRICE = 8.0
RUN_S = 2.0
LAUNCHABLE = resources_pb2.NodeLaunch.STATE_LAUNCHABLE
RUNNING = resources_pb2.NodeLaunch.STATE_RUNNING


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    sites = [
        SiteSpec(
            "dc",
            "datacenter",
            nodes=[
                {
                    "name": "dc-a100",
                    "cpu_cores": 32,
                    "memory_mib": 262144,
                    "devices": [{**A100, "count": 4}],
                }
            ],
        ),
        SiteSpec(
            "cloud",
            "cloud",
            node_types=[
                {
                    "name": "a100x2",
                    "cpu_cores": 16,
                    "memory_mib": 131072,
                    "devices": [{**A100, "count": 2}],
                    "max": 2,
                    "price_per_hour": PRICE,
                    "spot_price_per_hour": 3.0,
                    "delay_s": LAUNCH_S,
                }
            ],
            settings={"elastic": {"provider": "simulated", "idle_release_s": 2.0}},
        ),
    ]
    with running(tmp_path_factory.mktemp("elastic"), sites) as f:
        yield f


def gpu_job(name: str, replicas: int, devices: int, seconds: float, code: str) -> jobs_pb2.JobSpec:
    return jobs_pb2.JobSpec(
        name=name,
        tasks=[
            jobs_pb2.TaskSpec(
                name="train",
                command=[sys.executable, "-c", code],
                replicas=replicas,
                estimated_duration_s=seconds,
                resources=jobs_pb2.ResourceRequest(
                    cpu=1, accelerator=jobs_pb2.AcceleratorRequest(kind=1, count=devices)
                ),
            )
        ],
    )


async def cloud_nodes(channel: grpc.aio.Channel) -> dict[str, resources_pb2.NodeLaunch]:
    reply = await admin(channel).ListSites(admin_service_pb2.ListSitesRequest())
    (cloud,) = [s for s in reply.sites if s.name == "cloud"]
    return {n.name: n.launch for n in cloud.view.nodes}


async def test_a_gang_launches_cloud_nodes_runs_there_and_they_are_released(
    fed: LocalFederation,
) -> None:
    async with fed.operator().channel() as channel:
        nodes = await cloud_nodes(channel)
        assert set(nodes) == {"a100x2-0", "a100x2-1"}
        assert {n.state for n in nodes.values()} == {LAUNCHABLE}
        assert nodes["a100x2-0"].delay_p50_s == LAUNCH_S

        blocker = gpu_job("blocker", 1, 1, 3600, "import time; time.sleep(600)")
        blocker_id = (
            await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=blocker))
        ).job.id
        await wait_for_job(channel, blocker_id, until=frozenset({jobs_pb2.JOB_STATE_RUNNING}))

        gang = gpu_job(
            "gang", 2, 2, RUN_S, "import os; print('ran on', os.environ['FEDERATION_SITE'])"
        )
        submitted = time.monotonic()
        gang_id = (
            await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=gang))
        ).job.id

        async def launching() -> bool:
            states = {n.state for n in (await cloud_nodes(channel)).values()}
            return states != {LAUNCHABLE}

        await until(launching, "the cloud's nodes launching")
        job = await wait_for_job(channel, gang_id, timeout_s=60)
        assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, job.reason
        (task,) = job.tasks
        assert task.site == "cloud"
        assert set(task.nodes) == {"a100x2-0", "a100x2-1"}
        assert (
            task.started_at.ToDatetime().timestamp() - job.created_at.ToDatetime().timestamp()
            >= LAUNCH_S * 0.9
        )
        assert time.monotonic() - submitted >= LAUNCH_S
        # The estimate it was placed by: the launch delay in the completion time, both nodes'
        # price from launch to the end in the cost.
        estimate = task.estimate
        assert estimate.provision_s == pytest.approx(LAUNCH_S)
        assert estimate.total_s == pytest.approx(
            estimate.queue_s + LAUNCH_S + estimate.transfer_s + estimate.run_s
        )
        assert estimate.cost_usd == pytest.approx(2 * PRICE * (LAUNCH_S + estimate.run_s) / 3600)

        async def released() -> bool:
            return {n.state for n in (await cloud_nodes(channel)).values()} == {LAUNCHABLE}

        await until(released, "the idle nodes released")
        learned = (await cloud_nodes(channel))["a100x2-0"]
        assert learned.delay_p50_s == pytest.approx(LAUNCH_S, abs=1.0)

        await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=blocker_id))
        await wait_for_job(channel, blocker_id)


async def test_more_than_the_site_may_launch_is_not_placed_there(fed: LocalFederation) -> None:
    """3 x 2 GPUs: the cloud may launch 2 nodes of 2: the explanation says so, and nothing
    launches."""
    async with fed.operator().channel() as channel:
        big = gpu_job("too-big", 3, 2, RUN_S, "print('never')")
        big.constraints.sites.append("cloud")
        job_id = (await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=big))).job.id

        async def explained() -> bool:
            request = job_service_pb2.ExplainJobRequest(job_id=job_id)
            reply = await jobs(channel).ExplainJob(request)
            by_site = {s.site: s for s in reply.tasks[0].sites}
            return (
                by_site.get("cloud") is not None
                and by_site["cloud"].code == "INSUFFICIENT_FREE_CAPACITY"
            )

        await until(explained, "the cloud rejected for capacity")
        assert {n.state for n in (await cloud_nodes(channel)).values()} == {LAUNCHABLE}
        await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id))
