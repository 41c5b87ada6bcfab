"""Links, measured: the monitor that measures and publishes this site's links to its peers.

The coordinator tells each agent which peers publish a probe endpoint (``ProbePeers``); the
agent's ``LinkMonitor`` measures round-trip time and throughput to each of them (see
``federation.common.probe``), now and then on a schedule, and publishes the results as ``Link``
messages with the time of the measurement, so readers can tell how old they are. Operators
may declare links an agent cannot measure; a declared link replaces any measurement of the
same peer and is marked ``declared``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import Any

import structlog

from federation.agent.config import AgentConfig
from federation.api.v1 import resources_pb2
from federation.api.v1 import site_link_service_pb2 as pb
from federation.common.probe import (
    LinkProbeError,
    MeasureFn,
    Measurement,
    ProbeServer,
    measure_link,
    split_endpoint,
)
from federation.config import ConfigError

__all__ = [
    "LinkMonitor",
    "LinkProbeError",
    "Measurement",
    "ProbeServer",
    "declared_links",
    "link_settings",
    "measure_link",
]

log = structlog.get_logger()

DEFAULT_PAYLOAD_BYTES = 4 * 1024 * 1024
DEFAULT_TIMEOUT_S = 30.0
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


# Settings --------------------------------------------------------------------------------


def link_settings(config: AgentConfig, *, source: str) -> list[resources_pb2.Link]:
    """Check the agent's probe settings and return its declared links.

    Raises:
        ConfigError: naming ``source`` and the key, e.g. ``links[1].rtt_ms``.
    """
    for key in ("probe_listen", "probe_advertise"):
        value = getattr(config, key)
        if key == "probe_listen" or value:
            try:
                host, _ = split_endpoint(value)
            except ValueError:
                raise ConfigError(f"{source}: {key} must be host:port, not {value!r}") from None
            if host in WILDCARD_HOSTS and not config.probe_advertise:
                raise ConfigError(
                    f"{source}: probe_listen {value!r} listens on every address, which peers "
                    "cannot dial. To fix: set probe_advertise to the host:port peers should use"
                )
            if key == "probe_advertise" and not _is_ip(host):
                # The coordinator sends peers only to the address a site connects from.
                raise ConfigError(
                    f"{source}: probe_advertise {value!r} must be an IP address, the one this "
                    "agent reaches the coordinator from (peers are sent nowhere else)"
                )
    return declared_links(config.links, source=source)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


def declared_links(raw: Sequence[Mapping[str, object]], *, source: str) -> list[resources_pb2.Link]:
    """Check the ``[[links]]`` tables of an agent config and turn them into ``Link``s.

    Raises:
        ConfigError: naming ``source`` and the key path, e.g. ``links[1].rtt_ms``.
    """
    links: dict[str, resources_pb2.Link] = {}
    for i, entry in enumerate(raw):
        where = f"{source}: links[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where} must be a table with peer, bandwidth_mbps and rtt_ms")
        unknown = set(entry) - {"peer", "bandwidth_mbps", "rtt_ms"}
        if unknown:
            raise ConfigError(f"{where}: unknown setting(s) {', '.join(sorted(unknown))}")
        peer = entry.get("peer")
        if not isinstance(peer, str) or not peer:
            raise ConfigError(f"{where}.peer is missing: name the peer site")
        if peer in links:
            raise ConfigError(f"{where}.peer: {peer!r} is declared twice")
        figures = {}
        for key in ("bandwidth_mbps", "rtt_ms"):
            value = entry.get(key)
            if (
                not isinstance(value, int | float)
                or isinstance(value, bool)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ConfigError(f"{where}.{key} must be a positive number, not {value!r}")
            figures[key] = float(value)
        links[peer] = resources_pb2.Link(peer_site=peer, declared=True, **figures)
    return list(links.values())


# The monitor -----------------------------------------------------------------------------


class LinkMonitor:
    """Measures the links to peer sites and publishes them, with declared ones on top."""

    def __init__(
        self,
        *,
        site: str,
        declared: Iterable[resources_pb2.Link] = (),
        on_change: Callable[[], None] = lambda: None,
        interval_s: float = 60.0,
        payload_bytes: int = DEFAULT_PAYLOAD_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        measure: MeasureFn = measure_link,
    ) -> None:
        """Hold the links of ``site``; nothing is measured until peers are set.

        Args:
            site: This agent's site, never measured even if listed as a peer.
            declared: Links the operator declared (``declared_links``).
            on_change: Called whenever what ``links()`` returns changes.
            interval_s: Time between two rounds of measurements.
            payload_bytes: Size of each throughput probe.
            timeout_s: Deadline for measuring one peer.
            measure: The measuring function (tests pass a fake).
        """
        self._site = site
        self._declared = {link.peer_site: link for link in declared}
        self._on_change = on_change
        self._interval_s = interval_s
        self._payload_bytes = payload_bytes
        self._timeout_s = timeout_s
        self._measure = measure
        self._peers: dict[str, str] = {}  # site -> probe endpoint
        self._measured: dict[str, Measurement] = {}
        self._coordinator_endpoint = ""
        self._coordinator: Measurement | None = None
        self._lock = asyncio.Lock()  # one measurement at a time: probes would share the uplink
        self._tasks: set[asyncio.Task[None]] = set()

    def links(self) -> list[resources_pb2.Link]:
        """The links to publish, sorted by peer: measured ones, then declared ones on top."""
        merged = {
            peer: resources_pb2.Link(
                peer_site=peer,
                bandwidth_mbps=m.bandwidth_mbps,
                rtt_ms=m.rtt_ms,
                declared=False,
                measured_at=m.measured_at,
            )
            for peer, m in self._measured.items()
        }
        # The operator's word wins: a declared link replaces a measurement of the same peer.
        for peer, link in self._declared.items():
            merged[peer] = resources_pb2.Link(
                peer_site=peer,
                bandwidth_mbps=link.bandwidth_mbps,
                rtt_ms=link.rtt_ms,
                declared=True,
                measured_at=0.0,
            )
        return [merged[peer] for peer in sorted(merged)]

    def coordinator_link(self) -> resources_pb2.Link | None:
        """The link to the coordinator as last measured (``peer_site`` empty), or None."""
        m = self._coordinator
        if m is None:
            return None
        return resources_pb2.Link(
            bandwidth_mbps=m.bandwidth_mbps, rtt_ms=m.rtt_ms, measured_at=m.measured_at
        )

    def set_coordinator(self, endpoint: str) -> None:
        """Where the coordinator's probe is (its welcome says); measured now and each round."""
        if endpoint == self._coordinator_endpoint:
            return
        self._coordinator_endpoint = endpoint
        if endpoint:
            self._spawn(self._measure_coordinator())

    async def _measure_coordinator(self) -> None:
        endpoint = self._coordinator_endpoint
        if not endpoint:
            return
        async with self._lock:
            measurement = await self._measure_one("coordinator", endpoint)
        if measurement is not None and endpoint == self._coordinator_endpoint:
            before = self._snapshot()
            self._coordinator = measurement
            self._notify_if_changed(before)

    def set_peers(self, peers: Iterable[pb.ProbePeers.Peer]) -> None:
        """Replace the peer list and measure new or moved peers now, in the background."""
        before = self._snapshot()
        wanted = {
            p.site: p.endpoint for p in peers if p.site and p.endpoint and p.site != self._site
        }
        fresh = [site for site, endpoint in wanted.items() if self._peers.get(site) != endpoint]
        self._peers = wanted
        for site in list(self._measured):
            if site not in wanted:
                del self._measured[site]  # a peer that left takes its link with it
        self._notify_if_changed(before)
        if fresh:
            self._spawn(self.refresh(fresh))

    def start(self) -> None:
        """Start measuring every peer each ``interval_s``."""
        self._spawn(self._periodic())

    async def close(self) -> None:
        """Stop the schedule and any measurement in flight."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def refresh(self, sites: Iterable[str] | None = None) -> None:
        """Measure the given peers (default: all) now, one after another.

        A failure is logged and keeps the peer's previous measurement with its old time,
        so its age shows that it is stale. Peers with a declared link are not measured.
        """
        for site in list(self._peers) if sites is None else list(sites):
            endpoint = self._peers.get(site)
            if endpoint is None or site in self._declared:
                continue
            async with self._lock:
                measurement = await self._measure_one(site, endpoint)
            # The peer may have left or moved while we measured: keep only a current answer.
            if measurement is not None and self._peers.get(site) == endpoint:
                before = self._snapshot()
                self._measured[site] = measurement
                self._notify_if_changed(before)

    async def _measure_one(self, site: str, endpoint: str) -> Measurement | None:
        try:
            m = await self._measure(
                endpoint, payload_bytes=self._payload_bytes, timeout_s=self._timeout_s
            )
        except LinkProbeError as err:
            stale = self._measured.get(site)
            log.warning(
                "link_probe_failed",
                peer=site,
                endpoint=endpoint,
                error=str(err),
                kept_age_s=None if stale is None else round(time.time() - stale.measured_at, 1),
            )
            return None
        except Exception:
            log.exception("link_probe_crashed", peer=site, endpoint=endpoint)
            return None
        log.debug("link_measured", peer=site, rtt_ms=m.rtt_ms, bandwidth_mbps=m.bandwidth_mbps)
        return m

    async def _periodic(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self._measure_coordinator()
                await self.refresh()
            except Exception:  # the schedule must outlive any surprise
                log.exception("link_refresh_crashed")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _snapshot(self) -> list[bytes]:
        links = [*self.links(), self.coordinator_link() or resources_pb2.Link()]
        return [link.SerializeToString(deterministic=True) for link in links]

    def _notify_if_changed(self, before: list[bytes]) -> None:
        if self._snapshot() != before:
            try:
                self._on_change()
            except Exception:
                log.exception("link_change_callback_failed")
