"""Links, measured: the probe server and client on real loopback sockets, and the monitor."""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from federation.agent.config import AgentConfig
from federation.agent.links import (
    LinkMonitor,
    LinkProbeError,
    Measurement,
    ProbeServer,
    declared_links,
    link_settings,
    measure_link,
)
from federation.agent.main import load_config, parse_args
from federation.api.v1 import resources_pb2
from federation.api.v1 import site_link_service_pb2 as pb
from federation.common.probe import MAX_PROBE_BYTES
from federation.config import ConfigError

MIB = 1024 * 1024


@pytest.fixture
async def probe_server() -> AsyncIterator[str]:
    """A probe server on a free loopback port; yields its endpoint."""
    server = ProbeServer("127.0.0.1:0")
    endpoint = await server.start()
    yield endpoint
    await server.close()


def peer(site: str, endpoint: str) -> pb.ProbePeers.Peer:
    return pb.ProbePeers.Peer(site=site, endpoint=endpoint)


async def read_until_closed(endpoint: str, send: bytes) -> bytes:
    """Send raw bytes to a probe server and return everything it says until it hangs up."""
    host, port = endpoint.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(send)
    await writer.drain()
    async with asyncio.timeout(10):
        answer = await reader.read()  # returns only once the server closes the connection
    writer.close()
    return answer


class Changes:
    """Counts ``on_change`` calls and lets a test wait for the next one."""

    def __init__(self) -> None:
        self.count = 0
        self._event = asyncio.Event()

    def __call__(self) -> None:
        self.count += 1
        self._event.set()

    async def wait(self, count: int) -> None:
        async with asyncio.timeout(10):
            while self.count < count:
                self._event.clear()
                await self._event.wait()


class FakeMeasure:
    """Stands in for ``measure_link``: records endpoints, answers from a script."""

    def __init__(self, answer: Callable[[str], Measurement]) -> None:
        self.calls: list[str] = []
        self._answer = answer

    async def __call__(self, endpoint: str, *, payload_bytes: int, timeout_s: float) -> Measurement:
        self.calls.append(endpoint)
        return self._answer(endpoint)


def fixed(rtt_ms: float = 1.0, bandwidth_mbps: float = 1000.0) -> Callable[[str], Measurement]:
    return lambda _: Measurement(rtt_ms, bandwidth_mbps, time.time())


# The probe server and client -------------------------------------------------------------


async def test_measure_gives_positive_finite_figures(probe_server: str) -> None:
    """A ping and throughput round trip on loopback gives positive, finite RTT and bandwidth."""
    before = time.time()
    m = await measure_link(probe_server, payload_bytes=MIB, timeout_s=10)
    assert 0 < m.rtt_ms < 1000
    assert math.isfinite(m.rtt_ms)
    assert m.bandwidth_mbps > 0
    assert math.isfinite(m.bandwidth_mbps)
    assert before <= m.measured_at <= time.time()


async def test_oversized_probe_is_refused_and_server_keeps_serving(probe_server: str) -> None:
    """A throughput probe over 256 MiB is hung up on unanswered; the next client is served."""
    with capture_logs() as logs:
        answer = await read_until_closed(
            probe_server, b"T" + (MAX_PROBE_BYTES + 1).to_bytes(8, "big")
        )
    assert answer == b""
    assert any(e["event"] == "probe_refused" and e["reason"] == "too large" for e in logs)
    assert (await measure_link(probe_server, payload_bytes=1024, timeout_s=10)).rtt_ms > 0


async def test_garbage_is_refused_and_server_keeps_serving(probe_server: str) -> None:
    """An unknown request byte closes the connection; pings before it are still answered."""
    assert await read_until_closed(probe_server, b"PPX") == b"PP"
    assert (await measure_link(probe_server, payload_bytes=1024, timeout_s=10)).rtt_ms > 0


async def test_server_limit_refuses_bigger_probe() -> None:
    """A client whose probe exceeds the server's limit gets a LinkProbeError, not a hang."""
    server = ProbeServer("127.0.0.1:0", max_probe_bytes=1024)
    endpoint = await server.start()
    try:
        with pytest.raises(LinkProbeError, match=endpoint):  # hung up on, or reset
            await measure_link(endpoint, payload_bytes=4 * MIB, timeout_s=10)
    finally:
        await server.close()


async def test_silent_client_is_dropped() -> None:
    """A connection that sends nothing is closed once the server's read timeout passes."""
    server = ProbeServer("127.0.0.1:0", io_timeout_s=0.05)
    endpoint = await server.start()
    try:
        assert await read_until_closed(endpoint, b"") == b""
    finally:
        await server.close()


async def test_unreachable_peer_raises() -> None:
    """Nothing listening on the port is a LinkProbeError naming the endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"  # bound, never listening: refused
        with pytest.raises(LinkProbeError, match=endpoint):
            await measure_link(endpoint, payload_bytes=1024, timeout_s=10)


async def test_silent_peer_times_out() -> None:
    """A peer that accepts but never answers is a LinkProbeError once the deadline passes."""
    held: list[asyncio.StreamWriter] = []

    async def mute(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(mute, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(LinkProbeError, match=r"no answer within 0\.2s"):
            await measure_link(f"127.0.0.1:{port}", payload_bytes=1024, timeout_s=0.2)
    finally:
        for writer in held:
            writer.close()
        server.close()


# The monitor -----------------------------------------------------------------------------


async def test_declared_link_wins_over_measured() -> None:
    """A declared peer is published with the operator's figures, marked declared, not probed."""
    fake = FakeMeasure(fixed(rtt_ms=0.1, bandwidth_mbps=9000))
    changes = Changes()
    declared = [resources_pb2.Link(peer_site="a", bandwidth_mbps=50, rtt_ms=40, declared=True)]
    monitor = LinkMonitor(site="me", declared=declared, on_change=changes, measure=fake)
    monitor.set_peers([peer("a", "10.0.0.1:1"), peer("b", "10.0.0.2:1")])
    await changes.wait(1)
    by_peer = {link.peer_site: link for link in monitor.links()}
    assert by_peer["a"] == resources_pb2.Link(
        peer_site="a", bandwidth_mbps=50, rtt_ms=40, declared=True, measured_at=0
    )
    assert not by_peer["b"].declared
    assert by_peer["b"].measured_at > 0
    assert by_peer["b"].bandwidth_mbps == 9000
    assert fake.calls == ["10.0.0.2:1"]
    await monitor.close()


async def test_declared_link_published_without_peers() -> None:
    """A declared link is published even when the peer offers nothing to measure."""
    declared = [resources_pb2.Link(peer_site="x", bandwidth_mbps=10, rtt_ms=5, declared=True)]
    monitor = LinkMonitor(site="me", declared=declared)
    assert [(link.peer_site, link.declared) for link in monitor.links()] == [("x", True)]


async def test_dead_peer_keeps_last_measurement() -> None:
    """When a peer dies its old measurement stays, with its old time, and the failure is logged."""
    changes = Changes()
    monitor = LinkMonitor(site="me", on_change=changes, payload_bytes=64 * 1024, timeout_s=5)
    server = ProbeServer("127.0.0.1:0")
    endpoint = await server.start()
    monitor.set_peers([peer("b", endpoint)])
    await changes.wait(1)
    [before] = monitor.links()
    await server.close()
    with capture_logs() as logs:
        await monitor.refresh()
    assert monitor.links() == [before]
    assert before.measured_at > 0
    assert changes.count == 1
    [failed] = [e for e in logs if e["event"] == "link_probe_failed"]
    assert failed["peer"] == "b"
    assert failed["kept_age_s"] is not None
    await monitor.close()


async def test_on_change_fires_when_links_change() -> None:
    """on_change fires for a new measurement and a departed peer, not for a repeated list."""
    fake = FakeMeasure(fixed())
    changes = Changes()
    monitor = LinkMonitor(site="me", on_change=changes, measure=fake)
    monitor.set_peers([peer("b", "h:1"), peer("me", "h:2")])
    await changes.wait(1)
    monitor.set_peers([peer("b", "h:1")])  # the same peer again: nothing new to measure
    assert (changes.count, fake.calls) == (1, ["h:1"])
    monitor.set_peers([])
    assert changes.count == 2
    assert monitor.links() == []
    await monitor.close()


async def test_moved_peer_is_measured_again() -> None:
    """A peer whose endpoint changed is measured again at once."""
    fake = FakeMeasure(fixed())
    changes = Changes()
    monitor = LinkMonitor(site="me", on_change=changes, measure=fake)
    monitor.set_peers([peer("b", "h:1")])
    await changes.wait(1)
    monitor.set_peers([peer("b", "h:2")])
    await changes.wait(2)
    assert fake.calls == ["h:1", "h:2"]
    await monitor.close()


async def test_schedule_survives_failures() -> None:
    """The periodic loop keeps measuring after a probe error and after an unexpected crash."""
    script: list[BaseException | None] = [LinkProbeError("down"), RuntimeError("bug"), None]

    def answer(_: str) -> Measurement:
        outcome = script.pop(0) if script else None
        if outcome is not None:
            raise outcome
        return Measurement(1.0, 100.0, time.time())

    changes = Changes()
    monitor = LinkMonitor(
        site="me", on_change=changes, interval_s=0.01, measure=FakeMeasure(answer)
    )
    with capture_logs() as logs:
        monitor.set_peers([peer("b", "h:1")])
        monitor.start()
        await changes.wait(1)
    await monitor.close()
    events = [e["event"] for e in logs]
    assert "link_probe_failed" in events
    assert "link_probe_crashed" in events
    assert [link.peer_site for link in monitor.links()] == ["b"]


# Settings --------------------------------------------------------------------------------


def write_config(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(
        f'site = "s"\ncoordinator = "c:1"\nca = "ca.pem"\nstate_dir = "state"\n{extra}\n'
    )
    return path


def load(path: Path) -> AgentConfig:
    return load_config(parse_args(["--config", str(path)], "fed-edge-agent", "edge"), "edge")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("[[links]]\nbandwidth_mbps = 1\nrtt_ms = 1", r"links\[0\]\.peer is missing"),
        (
            '[[links]]\npeer = "a"\nbandwidth_mbps = 1\nrtt_ms = 1\n'
            '[[links]]\npeer = "b"\nbandwidth_mbps = 0\nrtt_ms = 1',
            r"links\[1\]\.bandwidth_mbps must be a positive number",
        ),
        ('[[links]]\npeer = "a"\nbandwidth_mbps = 1\nrtt_ms = -2', r"links\[0\]\.rtt_ms"),
        ('[[links]]\npeer = "a"\nbandwidth_mbps = 1\nrtt_ms = nan', r"links\[0\]\.rtt_ms"),
        ('[[links]]\npeer = "a"\nbandwidth_mbps = 1\nrtt_ms = 1\nrtt = 3', r"links\[0\]: unk"),
        ('links = "a"', "links must be an array"),
        ("probe_payload_bytes = 1.5", "probe_payload_bytes must be an integer"),
        ("probe_payload_bytes = 0", "probe_payload_bytes must be in"),
        ("probe_interval_s = 0", "probe_interval_s must be positive"),
        ('probe_listen = "nowhere"', "probe_listen must be host:port"),
        ('probe_listen = "0.0.0.0:7400"', "set probe_advertise"),
        (
            'probe_listen = "0.0.0.0:7400"\nprobe_advertise = "edge.example.org:7400"',
            "probe_advertise .* must be an IP address",
        ),
    ],
)
def test_bad_link_settings_name_the_key(tmp_path: Path, extra: str, message: str) -> None:
    """A bad probe setting or declared link is refused with the file and the key path."""
    path = write_config(tmp_path, extra)
    with pytest.raises(ConfigError, match=message) as err:
        load(path)
    assert str(path) in str(err.value)


def test_declared_links_load(tmp_path: Path) -> None:
    """[[links]] tables load into declared Link messages, next to the probe settings."""
    path = write_config(
        tmp_path,
        'probe_listen = "0.0.0.0:7400"\nprobe_advertise = "192.0.2.7:7400"\n'
        '[[links]]\npeer = "dc"\nbandwidth_mbps = 100\nrtt_ms = 25.5',
    )
    config = load(path)
    assert config.probe_payload_bytes == 4 * MIB
    assert config.probe_interval_s == 60.0
    assert link_settings(config, source="t") == [
        resources_pb2.Link(peer_site="dc", bandwidth_mbps=100, rtt_ms=25.5, declared=True)
    ]


def test_duplicate_declared_peer_is_refused() -> None:
    """Declaring the same peer twice is an error naming the second entry."""
    entry: dict[str, object] = {"peer": "a", "bandwidth_mbps": 1, "rtt_ms": 1}
    with pytest.raises(ConfigError, match=r"links\[1\]\.peer: 'a' is declared twice"):
        declared_links([entry, entry], source="t")


async def test_the_coordinator_link_is_measured_but_not_published_as_a_peer(
    probe_server: str,
) -> None:
    """The coordinator's probe (told in the welcome) is measured like a peer's; its link is
    kept apart from the links to sites, and measuring it counts as a change."""
    changes = Changes()
    monitor = LinkMonitor(site="me", on_change=changes, payload_bytes=64 * 1024, timeout_s=5)
    assert monitor.coordinator_link() is None
    monitor.set_coordinator(probe_server)
    await changes.wait(1)
    link = monitor.coordinator_link()
    assert link is not None
    assert link.bandwidth_mbps > 0
    assert link.rtt_ms > 0
    assert link.measured_at > 0
    assert link.peer_site == ""
    assert monitor.links() == []
    await monitor.close()
