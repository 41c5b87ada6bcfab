"""Topology beyond the node, end to end: a site of 4 racks x 2 nodes (2 GPUs each, a
declared inventory: this machine has no GPUs) in 2 blocks, and a site of one 8-GPU node that
names no rack. A gang that requires a rack runs in one rack or waits, though GPUs are free
across racks; one that prefers a block fills a block."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2
from federation.local import LocalFederation, SiteSpec

from .conftest import admin, jobs, running, until, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-topology")

RACKS = {"r1": "b1", "r2": "b1", "r3": "b2", "r4": "b2"}


def rack_node(rack: str, i: int) -> dict[str, object]:
    return {
        "name": f"{rack}n{i}",
        "cpu_cores": 16,
        "memory_mib": 65536,
        "labels": {"rack": rack, "block": RACKS[rack]},
        "devices": [
            {"kind": "GPU", "vendor": "nvidia", "model": "H100", "memory_mib": 81920, "count": 2}
        ],
    }


FLAT = {
    "name": "flat-box",
    "cpu_cores": 64,
    "memory_mib": 262144,
    "devices": [
        {"kind": "GPU", "vendor": "nvidia", "model": "H100", "memory_mib": 81920, "count": 8}
    ],
}


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    sites = [
        SiteSpec(
            "racks",
            "datacenter",
            nodes=[rack_node(r, i) for r in RACKS for i in (1, 2)],
            settings={"topology_levels": ["block", "rack"]},
        ),
        SiteSpec("flat", "datacenter", nodes=[FLAT]),
    ]
    with running(tmp_path_factory.mktemp("topology"), sites) as f:
        yield f


def gang(name: str, replicas: int, **topology: str) -> jobs_pb2.JobSpec:
    return jobs_pb2.JobSpec(
        name=name,
        tasks=[
            jobs_pb2.TaskSpec(
                name="train",
                command=[sys.executable, "-c", "import time; time.sleep(600)"],
                replicas=replicas,
                resources=jobs_pb2.ResourceRequest(
                    cpu=1, accelerator=jobs_pb2.AcceleratorRequest(kind=1, count=1)
                ),
                topology=jobs_pb2.TopologyRequest(**topology),
            )
        ],
    )


async def submit(channel: grpc.aio.Channel, spec: jobs_pb2.JobSpec) -> str:
    reply = await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec))
    return reply.job.id


async def get(channel: grpc.aio.Channel, job_id: str) -> jobs_pb2.Job:
    request = job_service_pb2.GetJobRequest(job_id=job_id)
    return (await jobs(channel).GetJob(request)).job


async def running_task(channel: grpc.aio.Channel, job_id: str) -> jobs_pb2.TaskStatus:
    await wait_for_job(channel, job_id, until=frozenset({jobs_pb2.JOB_STATE_RUNNING}))
    return (await get(channel, job_id)).tasks[0]


def racks_of(task: jobs_pb2.TaskStatus) -> set[str]:
    return {node[:2] for node in task.nodes}


async def cancel_all(channel: grpc.aio.Channel, job_ids: list[str]) -> None:
    for job_id in job_ids:
        await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id))
    for job_id in job_ids:
        await wait_for_job(channel, job_id)


async def test_a_required_rack_runs_in_one_rack_or_waits(fed: LocalFederation) -> None:
    """Four gangs take a rack each (4 + 3 + 3 + 3 GPUs): 3 GPUs stay free, one in each of
    three racks, and the flat site has 8 free but no racks. A 2-replica gang that requires a
    rack waits, the explanation naming the topology at both sites; once a rack frees, it runs
    there, in one rack."""
    async with fed.operator().channel() as channel:
        first = await submit(channel, gang("rack-4", 4, required="rack"))
        task = await running_task(channel, first)
        assert task.site == "racks"
        assert len(racks_of(task)) == 1
        assert len(set(task.nodes)) == 2
        held = [first]
        for i in range(3):
            held.append(await submit(channel, gang(f"rack-3-{i}", 3, required="rack")))
            assert len(racks_of(await running_task(channel, held[-1]))) == 1
        taken = [racks_of((await get(channel, job_id)).tasks[0]) for job_id in held]
        assert set().union(*taken) == set(RACKS)

        waiting = await submit(channel, gang("rack-2", 2, required="rack"))

        async def explained() -> bool:
            request = job_service_pb2.ExplainJobRequest(job_id=waiting)
            reply = await jobs(channel).ExplainJob(request)
            codes = {s.site: s.code for s in reply.tasks[0].sites}
            return codes == {"racks": "TOPOLOGY_UNMET", "flat": "TOPOLOGY_UNMET"}

        await until(explained, "the waiting gang explained by its topology")
        assert (await get(channel, waiting)).state == jobs_pb2.JOB_STATE_PENDING

        await cancel_all(channel, [held[1]])
        task = await running_task(channel, waiting)
        assert task.site == "racks"
        assert racks_of(task) == taken[1]
        await cancel_all(channel, [*held[:1], *held[2:], waiting])


async def test_a_preferred_block_is_filled_first(fed: LocalFederation) -> None:
    """Eight replicas that prefer a block, on an idle racks site: one block's 8 GPUs."""
    async with fed.operator().channel() as channel:
        spec = gang("block-8", 8, preferred="block")
        spec.constraints.sites.append("racks")
        job_id = await submit(channel, spec)
        task = await running_task(channel, job_id)
        assert {RACKS[rack] for rack in racks_of(task)} in ({"b1"}, {"b2"})
        assert len(set(task.nodes)) == 4
        await cancel_all(channel, [job_id])


async def test_the_site_reports_its_topology_levels(fed: LocalFederation) -> None:
    """The racks site's view names its levels, widest first; the flat site names none."""
    async with fed.operator().channel() as channel:
        listed = await admin(channel).ListSites(admin_service_pb2.ListSitesRequest())
    levels = {s.name: list(s.view.topology_levels) for s in listed.sites}
    assert levels == {"racks": ["block", "rack"], "flat": []}
