"""Elastic cloud capacity end to end on Ray's autoscaler: a Ray site with no A100 node now that
may launch two a100x2 nodes (2 A100 each, $8 a node-hour, 10 s expected launch) through the
fake multi-node autoscaler, beside a datacenter site whose only A100 is busy. A 2 x 2-A100 gang
goes to the Ray site: its explanation carries the launch delay and the nodes' cost, the nodes
appear in Ray and in the site's view, the job succeeds on them, and once idle they are released
and Ray removes them. A 3 x 2 gang, beyond what the site may launch, is not placed there.
(The same proof on the simulated provider: tests/e2e/test_elastic.py.)"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc
import pytest

from federation.api.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    job_service_pb2,
    job_service_pb2_grpc,
    jobs_pb2,
    resources_pb2,
)
from federation.local import LocalFederation, SiteSpec
from federation.testing.ray_head import FakeNodeType, LocalRayHead, ray_binary
from federation.watch import events_of

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(300)]

CLOUD, DC = "cloud-ray", "dc"
A100 = {"kind": "GPU", "vendor": "nvidia", "model": "A100-80GB", "memory_mib": 81920}
DELAY_S = 10.0
PRICE = 8.0
RUN_S = 2.0
LAUNCHABLE = resources_pb2.NodeLaunch.STATE_LAUNCHABLE
RUNNING = resources_pb2.NodeLaunch.STATE_RUNNING
TERMINAL = (jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED)


@pytest.fixture(scope="module")
def head() -> Iterator[LocalRayHead]:
    if ray_binary() is None:
        pytest.skip("Ray is not installed: pip install -e '.[ray]'")
    import ray

    ray.shutdown()
    a100x2 = FakeNodeType({"CPU": 2, "GPU_A100": 2, "a100x2": 1}, max_workers=2)
    head = LocalRayHead(cpus=2, a100s=0, worker_types={"a100x2": a100x2})
    head.start()
    try:
        ray.init(address=head.address, logging_level="ERROR", log_to_driver=False)
        yield head
    finally:
        ray.shutdown()
        head.stop()


@pytest.fixture(scope="module")
def fed(head: LocalRayHead, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    ray = {
        "address": head.address,
        "dashboard": head.dashboard,
        "python": sys.executable,
        "poll_interval_s": 0.25,
        "devices": {"GPU_A100": {"model": "A100-80GB", "memory_mib": 81920, "declared": True}},
    }
    sites = [
        SiteSpec(
            DC,
            "datacenter",
            nodes=[{"name": "dc-a100", "cpu_cores": 8, "memory_mib": 16384, "devices": [{**A100}]}],
        ),
        SiteSpec(
            CLOUD,
            "cloud",
            node_types=[
                {
                    "name": "a100x2",
                    "cpu_cores": 2,
                    "memory_mib": 4096,
                    "devices": [{**A100, "count": 2}],
                    "max": 2,
                    "price_per_hour": PRICE,
                    "delay_s": DELAY_S,
                }
            ],
            settings={
                "scheduler": "ray",
                "ray": ray,
                "elastic": {"provider": "ray", "idle_release_s": 2.0},
            },
        ),
    ]
    federation = LocalFederation(tmp_path_factory.mktemp("elastic-ray"), sites)
    try:
        asyncio.run(federation.start())
        yield federation
    finally:
        federation.stop()


@pytest.fixture
async def channel(fed: LocalFederation) -> AsyncIterator[grpc.aio.Channel]:
    async with fed.operator().channel() as opened:
        yield opened


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
                    cpu=1,
                    accelerator=jobs_pb2.AcceleratorRequest(
                        kind=resources_pb2.DEVICE_KIND_GPU, count=devices
                    ),
                ),
            )
        ],
    )


async def cloud_nodes(channel: grpc.aio.Channel) -> dict[str, resources_pb2.Node]:
    reply = await admin_service_pb2_grpc.AdminServiceStub(channel).ListSites(
        admin_service_pb2.ListSitesRequest()
    )
    (cloud,) = [s for s in reply.sites if s.name == CLOUD]
    return {n.name: n for n in cloud.view.nodes}


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60) -> float:
    began = time.monotonic()
    while not await check():
        assert time.monotonic() - began < timeout_s, f"timed out waiting for {what}"
        await asyncio.sleep(0.2)
    return time.monotonic() - began


async def submit(channel: grpc.aio.Channel, spec: jobs_pb2.JobSpec) -> str:
    stub = job_service_pb2_grpc.JobServiceStub(channel)
    return (await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec))).job.id


async def wait_for(
    channel: grpc.aio.Channel, job_id: str, states: tuple[int, ...] = TERMINAL
) -> jobs_pb2.Job:
    stub = job_service_pb2_grpc.JobServiceStub(channel)

    async def follow() -> jobs_pb2.Job:
        request = job_service_pb2.WatchJobsRequest(job_ids=[job_id], include_current=True)
        async for event in events_of(stub.WatchJobs(request)):
            if event.job_state in states:
                break
        return (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job

    return await asyncio.wait_for(follow(), 120)


def ray_a100x2_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n["Alive"] and n["Resources"].get("a100x2")]


async def test_a_gang_launches_ray_nodes_runs_there_and_they_are_released(
    channel: grpc.aio.Channel,
) -> None:
    nodes = await cloud_nodes(channel)
    assert {n.launch.state for n in nodes.values() if n.HasField("launch")} == {LAUNCHABLE}
    assert {"a100x2-0", "a100x2-1"} <= set(nodes)
    assert not any(
        d.model == "A100-80GB"
        for n in nodes.values()
        if not n.HasField("launch")
        for d in n.devices
    )

    blocker_id = await submit(
        channel, gpu_job("blocker", 1, 1, 3600, "import time; time.sleep(600)")
    )
    await wait_for(channel, blocker_id, (jobs_pb2.JOB_STATE_RUNNING,))

    env = "os.environ['FEDERATION_SITE'], os.environ['FEDERATION_DEVICES']"
    code = f"import os; print('ran on', {env})"
    submitted = time.monotonic()
    gang_id = await submit(channel, gpu_job("gang", 2, 2, RUN_S, code))

    async def launching() -> bool:
        states = {
            n.launch.state for n in (await cloud_nodes(channel)).values() if n.HasField("launch")
        }
        return states != {LAUNCHABLE}

    await until(launching, "the Ray site's nodes launching")
    job = await wait_for(channel, gang_id)
    took = time.monotonic() - submitted
    (task,) = job.tasks
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, task.reason
    assert task.site == CLOUD
    assert set(task.nodes) == {"a100x2-0", "a100x2-1"}
    assert f"ran on {CLOUD} a100x2-" in task.output_tail
    # What it was placed by: the launch delay in the completion time, both nodes' price from
    # launch to the end in the cost.
    explained = await job_service_pb2_grpc.JobServiceStub(channel).ExplainJob(
        job_service_pb2.ExplainJobRequest(job_id=gang_id)
    )
    estimate = explained.tasks[0].committed_estimate
    assert estimate.provision_s == pytest.approx(DELAY_S)
    assert estimate.cost_usd == pytest.approx(2 * PRICE * (DELAY_S + estimate.run_s) / 3600)
    assert task.estimate.cost_usd == pytest.approx(estimate.cost_usd)
    print(
        f"submit to end: {took:.1f}s; estimate {estimate.provision_s}s launch, "
        f"${estimate.cost_usd:.4f}"
    )

    # The launched nodes were in Ray; once idle they are released and Ray removes them.
    async def released() -> bool:
        view = await cloud_nodes(channel)
        return {n.launch.state for n in view.values() if n.HasField("launch")} == {LAUNCHABLE}

    await until(released, "the idle nodes released")
    learned = (await cloud_nodes(channel))["a100x2-0"].launch
    print(f"learned launch delay p50 {learned.delay_p50_s:.1f}s p90 {learned.delay_p90_s:.1f}s")
    assert learned.delay_p50_s != DELAY_S

    async def removed() -> bool:
        return not await asyncio.to_thread(ray_a100x2_nodes)

    gone = await until(removed, "Ray removing the released nodes")
    print(f"removed by Ray {gone:.1f}s after their release")

    stub = job_service_pb2_grpc.JobServiceStub(channel)
    await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=blocker_id))
    await wait_for(channel, blocker_id)


async def test_more_than_the_site_may_launch_is_not_placed_there(
    channel: grpc.aio.Channel,
) -> None:
    big = gpu_job("too-big", 3, 2, RUN_S, "print('never')")
    big.constraints.sites.append(CLOUD)
    job_id = await submit(channel, big)
    stub = job_service_pb2_grpc.JobServiceStub(channel)

    async def explained() -> bool:
        reply = await stub.ExplainJob(job_service_pb2.ExplainJobRequest(job_id=job_id))
        by_site = {s.site: s for s in reply.tasks[0].sites}
        return (
            by_site.get(CLOUD) is not None and by_site[CLOUD].code == "INSUFFICIENT_FREE_CAPACITY"
        )

    await until(explained, "the Ray site rejected for capacity")
    view = await cloud_nodes(channel)
    assert {n.launch.state for n in view.values() if n.HasField("launch")} == {LAUNCHABLE}
    assert not await asyncio.to_thread(ray_a100x2_nodes)
    await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id))
