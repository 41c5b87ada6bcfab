"""Placement that knows the hardware and the links, through real agents and processes."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2
from federation.local import LocalFederation, SiteSpec

from .conftest import admin, jobs, wait_for_job
from .test_refusals import violations

pytestmark = pytest.mark.xdist_group("e2e-placement")

GB = 10**9


def gpus(model: str, count: int, driver: str = "550.54") -> dict[str, object]:
    return {
        "name": f"{model.lower()}-box",
        "cpu_cores": 32,
        "memory_mib": 262144,
        "labels": {"driver": driver},
        "devices": [
            {"kind": "GPU", "vendor": "nvidia", "model": model, "memory_mib": 32768, "count": count}
        ],
    }


def link(peer: str, mbps: float) -> dict[str, object]:
    return {"peer": peer, "bandwidth_mbps": mbps, "rtt_ms": 20.0}


SITES = [
    SiteSpec(
        "edge-cam",
        "edge",
        nodes=[
            {
                "name": "cam-box",
                "cpu_cores": 8,
                "memory_mib": 16384,
                "labels": {"cann": "8.0.0"},
                "devices": [
                    {
                        "kind": "NPU",
                        "vendor": "huawei",
                        "model": "Ascend-910B",
                        "memory_mib": 65536,
                        "count": 2,
                    }
                ],
            }
        ],
        settings={"datasets": {"camera": 50 * GB}, "links": [link("fast", 40_000)]},
    ),
    SiteSpec(
        "store-thin",
        "datacenter",
        nodes=[gpus("V100", 2, driver="470.82")],
        settings={"datasets": {"thin-data": 2000 * GB}, "links": [link("fast", 100)]},
    ),
    SiteSpec(
        "store-fat",
        "datacenter",
        nodes=[gpus("V100", 2, driver="470.82")],
        settings={"datasets": {"fat-data": 2000 * GB}, "links": [link("fast", 100_000)]},
    ),
    SiteSpec("fast", "cloud", nodes=[gpus("H100-80GB", 4)], price_per_device_hour=2.0),
]


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    federation = LocalFederation(tmp_path_factory.mktemp("placement"), SITES)
    try:
        asyncio.run(federation.start())
        yield federation
    finally:
        federation.stop()


def train(name: str, dataset: str, **task: object) -> jobs_pb2.JobSpec:
    return jobs_pb2.JobSpec(
        name=name,
        tasks=[
            jobs_pb2.TaskSpec(
                name="train",
                command=[sys.executable, "-c", "print('trained')"],
                estimated_duration_s=36_000,
                resources=jobs_pb2.ResourceRequest(
                    cpu=1, accelerator=jobs_pb2.AcceleratorRequest(kind=1, count=1)
                ),
                inputs=[jobs_pb2.DataInput(dataset=dataset)],
                **task,
            )
        ],
    )  # type: ignore[arg-type]


async def run(channel: grpc.aio.Channel, spec: jobs_pb2.JobSpec) -> jobs_pb2.Job:
    job = (await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec))).job
    return await wait_for_job(channel, job.id)


async def test_data_stays_on_thin_links_and_moves_on_fat_ones(fed: LocalFederation) -> None:
    """2 TB behind a 100 Mbit/s link trains where it is; behind 100 Gbit/s it moves to H100s."""
    async with fed.operator().channel() as channel:
        thin = await run(channel, train("thin", "thin-data"))
        fat = await run(channel, train("fat", "fat-data"))
    assert thin.tasks[0].site == "store-thin"
    assert thin.tasks[0].estimate.transfer_bytes == 0
    assert fat.tasks[0].site == "fast"
    assert fat.tasks[0].estimate.transfer_bytes == 2000 * GB
    assert fat.tasks[0].estimate.transfer_s == pytest.approx(2000 * GB * 8 / 100e9 + 0.02)
    assert thin.state == fat.state == jobs_pb2.JOB_STATE_SUCCEEDED


async def test_pipeline_preprocesses_at_the_edge_and_trains_elsewhere(
    fed: LocalFederation,
) -> None:
    """A two-task pipeline runs its first task where the data is, the second on fast GPUs."""
    spec = jobs_pb2.JobSpec(
        name="pipeline",
        tasks=[
            jobs_pb2.TaskSpec(
                name="preprocess",
                command=[sys.executable, "-c", "print('frames cut')"],
                estimated_duration_s=600,
                output_bytes=5 * GB,
                resources=jobs_pb2.ResourceRequest(
                    cpu=1, accelerator=jobs_pb2.AcceleratorRequest(kind=2, count=1)
                ),
                inputs=[jobs_pb2.DataInput(dataset="camera")],
            ),
            jobs_pb2.TaskSpec(
                name="train",
                command=[sys.executable, "-c", "print('trained')"],
                estimated_duration_s=36_000,
                depends_on=["preprocess"],
                requires={"cuda": ">=12.1"},
                resources=jobs_pb2.ResourceRequest(
                    cpu=1, accelerator=jobs_pb2.AcceleratorRequest(kind=1, count=1)
                ),
            ),
        ],
    )
    async with fed.operator().channel() as channel:
        done = await run(channel, spec)
        events = (
            await jobs(channel).GetJob(
                job_service_pb2.GetJobRequest(job_id=done.id, include_events=True)
            )
        ).events
    sites = {t.name: t.site for t in done.tasks}
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED
    assert sites == {"preprocess": "edge-cam", "train": "fast"}
    train_status = next(t for t in done.tasks if t.name == "train")
    assert train_status.estimate.transfer_bytes == 5 * GB  # the output moved edge -> fast
    order = [(e.task, e.state) for e in events if e.task]
    assert order.index(("preprocess", jobs_pb2.JOB_STATE_SUCCEEDED)) < order.index(
        ("train", jobs_pb2.JOB_STATE_DELEGATED)
    )


async def test_explain_shows_filters_and_terms(fed: LocalFederation) -> None:
    """ExplainJob names the filter that rejected each site and breaks scores down by term."""
    spec = train("explained", "thin-data", requires={"cuda": ">=12.1"})
    async with fed.operator().channel() as channel:
        job = (await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec))).job
        await wait_for_job(channel, job.id)
        reply = await jobs(channel).ExplainJob(job_service_pb2.ExplainJobRequest(job_id=job.id))
    (task,) = reply.tasks
    by_site = {s.site: s for s in task.sites}
    assert by_site["store-thin"].plugin == "Compatibility"
    assert "node driver 470.82 supports cuda 11.4" in by_site["store-thin"].reason
    assert by_site["edge-cam"].plugin in ("Compatibility", "CapacityFit")
    fast = by_site["fast"]
    assert fast.feasible
    assert fast.rank == 1
    assert set(fast.scores) == {"CompletionTime", "Cost", "Energy", "FreeCapacity", "NearRegion"}
    # 2 TB over the thin 100 Mbit/s link dominates the estimate.
    assert fast.estimate.transfer_s > fast.estimate.run_s > 0
    assert fast.estimate.total_s == pytest.approx(
        fast.estimate.queue_s + fast.estimate.transfer_s + fast.estimate.run_s
    )


async def test_a_selector_places_by_what_it_reads(fed: LocalFederation) -> None:
    """A selector is evaluated in the sandbox, off the scheduler's loop, then placed on: the
    V100 sites hold no data here and are nearer in cost, but only the H100s match."""
    selector = 'device.model.startsWith("H100") && device.memory_gib >= 32.0'
    accelerator = jobs_pb2.AcceleratorRequest(kind=1, count=1, selector=selector)
    spec = jobs_pb2.JobSpec(
        name="selected",
        tasks=[
            jobs_pb2.TaskSpec(
                name="t",
                command=[sys.executable, "-c", "print('ran')"],
                resources=jobs_pb2.ResourceRequest(cpu=1, accelerator=accelerator),
            )
        ],
    )
    async with fed.operator().channel() as channel:
        job = await run(channel, spec)
        reply = await jobs(channel).ExplainJob(job_service_pb2.ExplainJobRequest(job_id=job.id))
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED
    assert job.tasks[0].site == "fast"
    by_site = {s.site: s for s in reply.tasks[0].sites}
    assert by_site["store-thin"].code == "DEVICE_SELECTOR_UNMATCHED"
    assert by_site["fast"].feasible


async def test_agents_measure_links_between_them(fed: LocalFederation) -> None:
    """Sites with no declared link get a measured one (bandwidth and RTT, with its age)."""
    async with fed.operator().channel() as channel:
        for _ in range(200):
            sites = (await admin(channel).ListSites(admin_service_pb2.ListSitesRequest())).sites
            views = {s.name: s.view for s in sites}
            measured = [lk for lk in views["store-thin"].links if lk.peer_site == "store-fat"]
            if measured:
                break
            await asyncio.sleep(0.05)
    (found,) = measured
    assert not found.declared
    assert found.bandwidth_mbps > 0
    assert found.rtt_ms > 0
    assert found.measured_at > 0
    declared = [lk for lk in views["store-thin"].links if lk.peer_site == "fast"]
    assert declared[0].declared
    assert declared[0].bandwidth_mbps == 100


BAD = [
    ("selector", {"selector": "device.vendor =="}, "accelerator.selector"),
    ("attribute", {"selector": "device.colour == 'red'"}, "accelerator.selector"),
    ("fraction", {"fraction": 1.5}, "accelerator.fraction"),
]


@pytest.mark.parametrize(("case", "accelerator", "field"), BAD, ids=[b[0] for b in BAD])
async def test_bad_accelerator_requests_are_refused(
    fed: LocalFederation, case: str, accelerator: dict[str, object], field: str
) -> None:
    """Bad selectors and fractions get INVALID_ARGUMENT naming the field."""
    spec = train("bad", "thin-data")
    spec.tasks[0].resources.accelerator.CopyFrom(jobs_pb2.AcceleratorRequest(kind=1, **accelerator))  # type: ignore[arg-type]
    async with fed.operator().channel() as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"spec.tasks[0].resources.{field}" in violations(caught.value)


async def test_bad_inputs_versions_and_cycles_are_refused(fed: LocalFederation) -> None:
    """Unknown datasets, invalid version ranges and dependency cycles are INVALID_ARGUMENT."""
    unknown = train("x", "no-such-data")
    bad_range = train("x", "thin-data", requires={"cuda": ">>12"})
    cycle = jobs_pb2.JobSpec(
        name="x",
        tasks=[
            jobs_pb2.TaskSpec(name="a", command=["a"], depends_on=["b"]),
            jobs_pb2.TaskSpec(name="b", command=["b"], depends_on=["a"]),
        ],
    )
    expected = [
        (unknown, "spec.tasks[0].inputs[0].dataset", "unknown dataset"),
        (bad_range, "spec.tasks[0].requires[cuda]", "not a valid version range"),
        (cycle, "spec.tasks", "dependency cycle"),
    ]
    async with fed.operator().channel() as channel:
        for spec, field, text in expected:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert text in violations(caught.value)[field]
