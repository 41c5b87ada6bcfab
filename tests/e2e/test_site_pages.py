"""Site listings of any size, at a real coordinator over mTLS: ListSites pages, and the status
stays small.

The coordinator's store holds many site records (joined sites that are not connected now,
written before it starts); a few more sites join for real and say hello with views of over a
megabyte each, so a page of them ends on the byte bound before the count bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from federation.agent.config import AgentConfig
from federation.agent.enroll import ensure_enrolled
from federation.api.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    resources_pb2,
    site_link_service_pb2,
    site_link_service_pb2_grpc,
)
from federation.coordinator.admin import DEFAULT_PAGE, MAX_PAGE, MAX_REPLY_BYTES
from federation.coordinator.config import STORE_FILE
from federation.coordinator.sites.registry import SITES
from federation.envelopes import envelopes
from federation.listing import list_sites, retry_delay_s
from federation.local import LocalFederation
from federation.security.tls import channel_credentials
from federation.store import Put
from federation.store.sqlite import SqliteStore

from .conftest import admin, channel_as
from .test_cli import fedctl
from .test_refusals import violations

pytestmark = pytest.mark.xdist_group("e2e-site-pages")

STORED = 1250
"""Site records in the store: more than one page of the largest size a caller may ask."""
LARGE = ("big-a", "big-b", "big-c", "big-d")
"""Sites that join and connect, each with a view of ``LARGE_NODES`` nodes of 8 GPUs."""
LARGE_NODES = 3200
"""About 1.2 MiB a view: two fit a page, three do not; all four together pass 4 MiB."""


def stored_name(i: int) -> str:
    return f"site-{i:04d}"


def large_view(site: str) -> resources_pb2.SiteView:
    """A view of ``LARGE_NODES`` nodes of 8 GPUs each."""
    view = resources_pb2.SiteView(site=site, domain=resources_pb2.DOMAIN_DATACENTER)
    for n in range(LARGE_NODES):
        node = view.nodes.add(
            name=f"n{n:04d}", cpu_cores=64, cpu_free=64, schedulable=True, memory_mib=1 << 19
        )
        node.memory_free_mib = node.memory_mib
        for g in range(8):
            node.devices.add(
                id=f"n{n}-g{g}",
                index=g,
                kind=resources_pb2.DEVICE_KIND_GPU,
                vendor="nvidia",
                model="H100-80GB",
                memory_total_mib=81920,
                memory_free_mib=81920,
                health=resources_pb2.DEVICE_HEALTH_HEALTHY,
            )
    return view


async def seed(path: Path) -> None:
    """Write ``STORED`` joined sites' records into a coordinator's store before it starts."""
    path.parent.mkdir(mode=0o700, parents=True)
    store = await SqliteStore.open(path)
    try:
        records = [
            admin_service_pb2.Site(name=stored_name(i), domain=resources_pb2.DOMAIN_EDGE)
            for i in range(STORED)
        ]
        await store.commit(
            [Put(f"{SITES}{record.name}", record.SerializeToString()) for record in records]
        )
    finally:
        await store.close()


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    """A coordinator whose store already holds ``STORED`` sites (heartbeats may be late)."""
    root = tmp_path_factory.mktemp("site-pages")
    asyncio.run(seed(root / "coordinator" / STORE_FILE))
    fed = LocalFederation(root, [], coordinator_args=["--missed-heartbeats", "100"])
    try:
        asyncio.run(fed.start_coordinator())
        yield fed
    finally:
        fed.stop()


@pytest_asyncio.fixture
async def connected(federation: LocalFederation) -> AsyncIterator[list[str]]:
    """The ``LARGE`` sites joined, connected and holding their views while the test runs."""
    async with large_sites(federation) as names:
        yield names


@contextlib.asynccontextmanager
async def large_sites(federation: LocalFederation) -> AsyncIterator[list[str]]:
    """The ``LARGE`` sites joined, connected and holding their views while it is entered."""
    channels: list[grpc.aio.Channel] = []
    calls = []
    try:
        for name in LARGE:
            state_dir = federation.root / "sites" / name
            joined = state_dir.exists()  # by an earlier test: its certificate is there
            config = AgentConfig(
                site=name,
                domain="datacenter",
                coordinator=federation.address,
                ca=federation.pki.ca_cert,
                state_dir=state_dir,
                token="" if joined else await federation.create_token(name, "datacenter"),
                join_address=f"127.0.0.1:{federation.join_port}",
            )
            creds = await ensure_enrolled(config)
            channel = grpc.aio.secure_channel(federation.address, channel_credentials(creds.tls))
            channels.append(channel)
            queue: asyncio.Queue[site_link_service_pb2.AgentMessage | None] = asyncio.Queue()
            call = site_link_service_pb2_grpc.SiteLinkServiceStub(channel).Connect(
                envelopes(
                    queue, lambda messages: site_link_service_pb2.ConnectRequest(messages=messages)
                )
            )
            calls.append(call)
            hello = site_link_service_pb2.Hello(view=large_view(name), generation=1)
            queue.put_nowait(site_link_service_pb2.AgentMessage(hello=hello))
            await call.read()  # the welcome: the coordinator holds the view
        yield list(LARGE)
    finally:
        for call in calls:
            call.cancel()
        for channel in channels:
            await channel.close()


def every_name() -> list[str]:
    return sorted([*LARGE, *(stored_name(i) for i in range(STORED))])


async def test_pages_cover_every_site_once_in_name_order(
    federation: LocalFederation, connected: list[str]
) -> None:
    """Page after page, every site comes exactly once, in name order; a page holds at most
    the size asked and stays under the byte bound, so large views end pages early."""
    async with channel_as(federation, federation.operator().tls) as channel:
        stub = admin(channel)
        for page_size, most in ((0, DEFAULT_PAGE), (MAX_PAGE, MAX_PAGE), (7, 7)):
            seen: list[str] = []
            token = ""
            pages = 0
            while True:
                reply = await stub.ListSites(
                    admin_service_pb2.ListSitesRequest(page_size=page_size, page_token=token)
                )
                pages += 1
                assert 1 <= len(reply.sites) <= most
                assert reply.ByteSize() <= MAX_REPLY_BYTES + 64 * len(reply.sites)
                names = [site.name for site in reply.sites]
                assert len(set(names) & set(LARGE)) <= 2  # the bytes end a page before three
                if pages == 1 and most > 2:
                    assert names == ["big-a", "big-b"]
                seen += names
                token = reply.next_page_token
                if not token:
                    break
            assert seen == every_name()
            assert pages >= -(-len(seen) // most)
        listed = {site.name: site for site in await list_sites(stub)}
    assert len(listed["big-b"].view.nodes) == LARGE_NODES
    assert 2 * listed["big-b"].ByteSize() < MAX_REPLY_BYTES < 3 * listed["big-b"].ByteSize()
    assert listed["big-b"].state == admin_service_pb2.SITE_STATE_CONNECTED
    assert listed[stored_name(0)].state == admin_service_pb2.SITE_STATE_DISCONNECTED


async def test_bad_page_token_and_size_are_refused(federation: LocalFederation) -> None:
    """A page token the service did not give, or a page past the largest, is INVALID_ARGUMENT
    naming the field."""
    async with channel_as(federation, federation.operator().tls) as channel:
        stub = admin(channel)
        for request, field in (
            (admin_service_pb2.ListSitesRequest(page_token="Not/a site"), "page_token"),
            (admin_service_pb2.ListSitesRequest(page_size=MAX_PAGE + 1), "page_size"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.ListSites(request)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in violations(caught.value)
        # A site that left between pages: the next page starts after its name all the same.
        reply = await stub.ListSites(
            admin_service_pb2.ListSitesRequest(page_size=2, page_token="site-0001a")
        )
        assert [site.name for site in reply.sites] == [stored_name(2), stored_name(3)]


async def test_status_counts_sites_and_stays_small(
    federation: LocalFederation, connected: list[str]
) -> None:
    """GetFederationStatus counts the sites by state instead of carrying their views."""
    async with channel_as(federation, federation.operator().tls) as channel:
        status = await admin(channel).GetFederationStatus(
            admin_service_pb2.GetFederationStatusRequest()
        )
    assert dict(status.sites_by_state) == {
        "SITE_STATE_CONNECTED": len(LARGE),
        "SITE_STATE_DISCONNECTED": STORED,
    }
    assert status.ByteSize() < 16 * 1024


async def test_fedctl_lists_every_site(federation: LocalFederation, connected: list[str]) -> None:
    """``fedctl sites -o json`` and ``fedctl status`` (as JSON and as tables) follow the pages
    to the last site."""
    listed = await asyncio.to_thread(fedctl, federation, "sites", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    assert [site["name"] for site in json.loads(listed.stdout)] == every_name()
    status = await asyncio.to_thread(fedctl, federation, "status", "-o", "json")
    assert status.returncode == 0, status.stderr
    assert [site["name"] for site in json.loads(status.stdout)["sites"]] == every_name()
    shown = await asyncio.to_thread(fedctl, federation, "status")
    assert shown.returncode == 0, shown.stderr
    assert stored_name(STORED - 1) in shown.stdout
    assert "big-c" in shown.stdout


async def pages_at_once(stub: admin_service_pb2_grpc.AdminServiceAsyncStub) -> None:
    """Asks for page after page without waiting; fails if none is refused."""
    token = ""
    while True:
        reply = await stub.ListSites(admin_service_pb2.ListSitesRequest(page_token=token))
        token = reply.next_page_token
        assert token, "every page was given at once"


async def test_fedctl_waits_out_the_byte_rate_between_pages(tmp_path: Path) -> None:
    """A coordinator whose operators may move 1 MiB a second (2 MiB at once) refuses pages past
    that with RESOURCE_EXHAUSTED and a retry delay; the listing waits as told and ends with
    every site."""
    config = tmp_path / "limits.toml"
    config.write_text("client_bytes_per_s = 1048576.0\nclient_byte_burst = 2097152.0\n")
    fed = LocalFederation(
        tmp_path, [], coordinator_args=["--missed-heartbeats", "100", "--config", str(config)]
    )
    try:
        await fed.start_coordinator()
        async with (
            large_sites(fed),
            channel_as(fed, fed.operator().tls) as channel,
        ):
            stub = admin(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await pages_at_once(stub)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (retry_delay_s(caught.value) or 0.0) > 0
            sites = await list_sites(stub)
        assert [site.name for site in sites] == list(LARGE)
    finally:
        fed.stop()
