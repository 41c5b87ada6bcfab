"""A hostile site's views, reports and probe endpoint, refused at the Connect stream over mTLS."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, jobs_pb2, resources_pb2
from federation.api.v1 import site_link_service_pb2 as pb
from federation.api.v1 import site_link_service_pb2_grpc as link_grpc
from federation.coordinator.sites.checks import MAX_HELLO_TASKS
from federation.local import LocalFederation
from federation.security.tls import TlsFiles

from .conftest import admin, channel_as
from .test_refusals import enrol_ghost, envelope, violations

pytestmark = pytest.mark.xdist_group("e2e-site-checks")


def gpu_view(site: str) -> resources_pb2.SiteView:
    """An honest view: one node with one MIG-capable GPU, probed on loopback."""
    view = resources_pb2.SiteView(site=site, price_per_device_hour=2.0)
    node = view.nodes.add(name="n", cpu_cores=8, cpu_free=8, memory_mib=4096, memory_free_mib=4096)
    device = node.devices.add(
        kind=resources_pb2.DEVICE_KIND_GPU,
        vendor="nvidia",
        model="A100-40GB",
        memory_total_mib=40960,
        memory_free_mib=40960,
        health=resources_pb2.DEVICE_HEALTH_HEALTHY,
    )
    device.partitions.add(profile="1g.5gb", total=7, free=7, memory_mib=4864)
    return view


async def refusal(
    tls: TlsFiles, fed: LocalFederation, *writes: pb.ConnectRequest
) -> grpc.aio.AioRpcError:
    """Open a stream as the site, send ``writes`` after the welcome, and return how it ended."""

    async def requests() -> AsyncIterator[pb.ConnectRequest]:
        for write in writes:
            yield write
            await welcomed.wait()
        await asyncio.sleep(30)

    welcomed = asyncio.Event()
    async with channel_as(fed, tls) as channel:
        call = link_grpc.SiteLinkServiceStub(channel).Connect(requests())
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # noqa: PT012
            async with asyncio.timeout(30):
                async for response in call:
                    welcomed.set()
                    assert response.messages  # welcome, probe peers: until refused
    return caught.value


async def test_nan_priced_view_is_refused(
    federation: LocalFederation, operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """A hello whose view has a NaN price ends INVALID_ARGUMENT naming the field; the site
    never shows as connected."""
    tls = await enrol_ghost(federation, "ghost-price", tmp_path)
    view = gpu_view("ghost-price")
    view.price_per_device_hour = math.nan
    err = await refusal(tls, federation, envelope(hello=pb.Hello(view=view, generation=1)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hello.view.price_per_device_hour" in violations(err)
    sites = await admin(operator).ListSites(admin_service_pb2.ListSitesRequest())
    ghost = next(s for s in sites.sites if s.name == "ghost-price")
    assert ghost.state != admin_service_pb2.SITE_STATE_CONNECTED
    assert not ghost.view.nodes


async def test_delta_with_more_partitions_free_than_total_is_refused(
    federation: LocalFederation, tmp_path: Path
) -> None:
    """A site connected with an honest view, then sending a delta that frees 8 of 7 MIG
    slots, is refused naming the partition's field."""
    tls = await enrol_ghost(federation, "ghost-slots", tmp_path)
    view = gpu_view("ghost-slots")
    node = resources_pb2.Node()
    node.CopyFrom(view.nodes[0])
    node.devices[0].partitions[0].free = 8
    update = pb.ViewUpdate(generation=2, delta=resources_pb2.SiteViewDelta(upserted_nodes=[node]))
    err = await refusal(
        tls,
        federation,
        envelope(hello=pb.Hello(view=view, generation=1)),
        envelope(view=update),
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "messages[0].view.delta.upserted_nodes[0].devices[0].partitions[0].free" in (
        violations(err)
    )


async def test_probe_endpoint_on_another_host_is_refused(
    federation: LocalFederation, tmp_path: Path
) -> None:
    """A site naming another host's address as its probe endpoint, which every other agent
    would be told to dial, is refused naming the field; its own address is accepted."""
    tls = await enrol_ghost(federation, "ghost-probe", tmp_path)
    view = gpu_view("ghost-probe")
    view.probe_endpoint = "192.0.2.10:7400"
    err = await refusal(tls, federation, envelope(hello=pb.Hello(view=view, generation=1)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hello.view.probe_endpoint" in violations(err)

    view.probe_endpoint = "127.0.0.1:7400"  # where this test's stream comes from

    async def honest() -> AsyncIterator[pb.ConnectRequest]:
        yield envelope(hello=pb.Hello(view=view, generation=1))
        await asyncio.sleep(30)

    async with channel_as(federation, tls) as channel:
        call = link_grpc.SiteLinkServiceStub(channel).Connect(honest())
        assert (await call.read()).messages[0].HasField("welcome")
        call.cancel()


async def test_hello_with_100k_task_reports_is_refused(
    federation: LocalFederation, tmp_path: Path
) -> None:
    """A hello carrying 100,000 task reports is refused for their number, before any is read
    (applying them kept the coordinator busy for over 21 s)."""
    tls = await enrol_ghost(federation, "ghost-reports", tmp_path)
    report = pb.TaskReport(job_id="nobody", task="t", epoch=1, state=jobs_pb2.JOB_STATE_RUNNING)
    hello = pb.Hello(view=gpu_view("ghost-reports"), generation=1, tasks=[report] * 100_000)
    err = await refusal(tls, federation, envelope(hello=hello))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert violations(err)["hello.tasks"] == f"at most {MAX_HELLO_TASKS} entries, got 100000"
