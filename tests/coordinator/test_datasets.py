"""The dataset registry at submission and in placement: an input naming a registered dataset
gets its holder and size, and placement weighs moving those bytes over the measured link."""

from __future__ import annotations

from federation.api.v1 import data_service_pb2, jobs_pb2, resources_pb2
from federation.coordinator.data.datasets import DatasetBook, dataset_key
from federation.coordinator.scheduling.task_requests import request_for
from federation.coordinator.sites.registry import SiteRegistry
from federation.placement.registry import build_framework
from federation.placement.snapshot import SiteInput, build_snapshot
from federation.store import Put, SqliteStore

GPU = resources_pb2.DEVICE_KIND_GPU
TWO_TB = 2 * 10**12
FRAMES = data_service_pb2.Dataset(
    name="frames",
    tenant="tenant-a",
    location="s3://holder/federation/tenant-a/frames",
    site="holder",
    bytes=TWO_TB,
    sha256="0" * 64,
)


async def book(store: SqliteStore) -> DatasetBook:
    """A registry loaded from the store, as a new term loads it."""
    await store.commit([Put(dataset_key(FRAMES.tenant, FRAMES.name), FRAMES.SerializeToString())])
    loaded = DatasetBook(store, SiteRegistry(store, lambda: None))
    await loaded.load()
    return loaded


def job(*inputs: jobs_pb2.DataInput) -> jobs_pb2.JobSpec:
    task = jobs_pb2.TaskSpec(name="t", command=["x"], estimated_duration_s=36_000, inputs=inputs)
    task.resources.accelerator.CopyFrom(jobs_pb2.AcceleratorRequest(kind=GPU, count=1))
    return jobs_pb2.JobSpec(name="j", tasks=[task])


def site(name: str, model: str, peer: str, bandwidth_mbps: float) -> SiteInput:
    device = resources_pb2.Device(
        kind=GPU, vendor="nvidia", model=model, memory_total_mib=81920, health=1
    )
    node = resources_pb2.Node(
        name=f"{name}-n", cpu_free=64, memory_free_mib=1 << 20, schedulable=True, devices=[device]
    )
    link = resources_pb2.Link(peer_site=peer, bandwidth_mbps=bandwidth_mbps, rtt_ms=10)
    view = resources_pb2.SiteView(site=name, nodes=[node], links=[link])
    return SiteInput(view, True, False)


def ranked(spec: jobs_pb2.JobSpec, bandwidth_mbps: float) -> list[str]:
    """Where the task goes: the holder has a slow device, the other site one 2.5x faster."""
    sites = [
        site("holder", "A100-80GB", "fast", bandwidth_mbps),
        site("fast", "H100-80GB", "holder", bandwidth_mbps),
    ]
    placed = jobs_pb2.Job(spec=spec, tasks=[jobs_pb2.TaskStatus(name="t")])
    request = request_for(placed, "t")
    assert request is not None
    return list(build_framework().place(request, build_snapshot(sites)).ranked)


async def test_an_input_naming_a_dataset_gets_its_holder_and_size(store: SqliteStore) -> None:
    registry = await book(store)
    spec = job(
        jobs_pb2.DataInput(dataset="dataset:frames"),
        jobs_pb2.DataInput(dataset=FRAMES.location, path="in/frames"),
    )
    assert registry.resolve_inputs([("spec", "tenant-a", spec)]) == []
    first, second = spec.tasks[0].inputs
    assert (first.dataset, first.site, first.bytes, first.path) == (
        "dataset:frames",
        "holder",
        TWO_TB,
        "frames",
    )
    assert (second.dataset, second.path) == ("dataset:frames", "in/frames")


async def test_another_tenants_or_an_unknown_dataset_is_refused_at_its_field(
    store: SqliteStore,
) -> None:
    registry = await book(store)
    spec = job(
        jobs_pb2.DataInput(dataset="dataset:frames"),
        jobs_pb2.DataInput(dataset=FRAMES.location),
        jobs_pb2.DataInput(dataset="dataset:nothing"),
    )
    found = {v.field: v.description for v in registry.resolve_inputs([("spec", "tenant-b", spec)])}
    assert set(found) == {f"spec.tasks[0].inputs[{i}].dataset" for i in range(3)}
    assert all("registered for tenant tenant-b" in d for d in found.values())
    assert spec.tasks[0].inputs[0].site == ""  # nothing of tenant-a's leaked into it
    elsewhere = job(jobs_pb2.DataInput(dataset="dataset:frames", site="fast"))
    (violation,) = registry.resolve_inputs([("spec", "tenant-a", elsewhere)])
    assert violation.field == "spec.tasks[0].inputs[0].site"
    assert "held at site holder" in violation.description


async def test_placement_prefers_the_holder_when_moving_the_dataset_would_dominate(
    store: SqliteStore,
) -> None:
    registry = await book(store)
    reads = job(jobs_pb2.DataInput(dataset="dataset:frames"))
    assert registry.resolve_inputs([("spec", "tenant-a", reads)]) == []
    # 2 TB over 100 Mbit/s is ~44 h, against 6 h saved by the faster device: stay at the holder.
    assert ranked(reads, 100.0)[0] == "holder"
    # Over 100 Gbit/s it moves in under 3 minutes: the faster site wins.
    assert ranked(reads, 100_000.0)[0] == "fast"
    # Without the dataset there is nothing to move: the faster site wins on the thin link too.
    assert ranked(job(), 100.0)[0] == "fast"
