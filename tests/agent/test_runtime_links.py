"""The agent runtime publishes its probe endpoint and links, and follows ProbePeers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from federation.agent.config import AgentConfig
from federation.agent.embedded_core import EmbeddedCore
from federation.agent.enroll import credential_paths
from federation.agent.links import LinkMonitor, Measurement
from federation.agent.runtime import AgentRuntime
from federation.api.v1 import resources_pb2
from federation.api.v1 import site_link_service_pb2 as pb


class Harness:
    """A runtime over an embedded core, with a scripted link monitor and an outbox."""

    def __init__(self, tmp_path: Path, declared: list[resources_pb2.Link]) -> None:
        self.measured: list[str] = []
        self.changed = asyncio.Event()
        config = AgentConfig(
            site="edge-1",
            domain="edge",
            coordinator="127.0.0.1:1",
            ca=tmp_path / "ca.pem",
            state_dir=tmp_path,
        )
        self.core = EmbeddedCore(
            [resources_pb2.Node(name="n1", cpu_cores=4, memory_mib=1024, schedulable=True)],
            site=config.site,
            work_dir=tmp_path / "work",
            on_status=lambda report: None,
            on_change=lambda: None,
        )
        self.links = LinkMonitor(
            site=config.site, declared=declared, on_change=self._changed, measure=self._measure
        )
        self.runtime = AgentRuntime(
            config,
            credential_paths(tmp_path),
            self.core,
            links=self.links,
            probe_endpoint="edge-1.example.org:7400",
        )
        self.outbox: asyncio.Queue[pb.AgentMessage] = asyncio.Queue()

    async def _measure(self, endpoint: str, *, payload_bytes: int, timeout_s: float) -> Measurement:
        self.measured.append(endpoint)
        return Measurement(rtt_ms=2.0, bandwidth_mbps=800.0, measured_at=time.time())

    def _changed(self) -> None:
        self.runtime.on_links_change()
        self.changed.set()

    def probe_peers(self, **peers: str) -> None:
        """Deliver a ProbePeers message from the coordinator."""
        body = pb.ProbePeers(
            peers=[pb.ProbePeers.Peer(site=s, endpoint=e) for s, e in peers.items()]
        )
        self.runtime._dispatch(pb.CoordinatorMessage(probe_peers=body), self.outbox)


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    """A runtime whose link monitor measures with a script instead of the network."""
    far = resources_pb2.Link(peer_site="far", bandwidth_mbps=5, rtt_ms=80, declared=True)
    h = Harness(tmp_path, declared=[far])
    yield h
    await h.links.close()
    await h.core.close()


async def test_full_view_carries_probe_endpoint_and_links(harness: Harness) -> None:
    """The full view names the probe endpoint and carries the declared links."""
    view = harness.runtime.full_view()
    assert view.probe_endpoint == "edge-1.example.org:7400"
    assert [(link.peer_site, link.declared) for link in view.links] == [("far", True)]


async def test_probe_peers_leads_to_a_links_delta(harness: Harness) -> None:
    """ProbePeers makes the agent measure; the next delta replaces its links whole, once."""
    harness.runtime._mark_sent(harness.runtime.full_view())  # as the hello does
    harness.probe_peers(dc="10.1.0.1:7400")
    async with asyncio.timeout(10):
        await harness.changed.wait()
    assert harness.measured == ["10.1.0.1:7400"]
    first = harness.runtime._delta()
    assert first.delta.has_links
    assert [(link.peer_site, link.declared) for link in first.delta.links] == [
        ("dc", False),
        ("far", True),
    ]
    assert first.delta.links[0].measured_at > 0
    second = harness.runtime._delta()
    assert not second.delta.has_links
    assert not second.delta.links
    assert second.generation == first.generation + 1


async def test_unchanged_links_stay_out_of_deltas(harness: Harness) -> None:
    """A delta after the hello leaves links out when they did not change."""
    harness.runtime._mark_sent(harness.runtime.full_view())
    update = harness.runtime._delta()
    assert not update.delta.has_links


async def test_departed_peer_sends_empty_links(tmp_path: Path) -> None:
    """When the last link goes, the delta says so: has_links with no links."""
    h = Harness(tmp_path, declared=[])
    h.runtime._mark_sent(h.runtime.full_view())
    h.probe_peers(dc="10.1.0.1:7400")
    async with asyncio.timeout(10):
        await h.changed.wait()
    assert [link.peer_site for link in h.runtime._delta().delta.links] == ["dc"]
    h.probe_peers()
    update = h.runtime._delta()
    assert update.delta.has_links
    assert list(update.delta.links) == []
    await h.links.close()
    await h.core.close()
