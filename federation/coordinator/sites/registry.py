"""Every site the federation knows: its record, its latest view and its live session."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog

from federation.api.v1 import admin_service_pb2, resources_pb2, site_link_service_pb2
from federation.coordinator.data.transfers import TransferLinks
from federation.coordinator.sites.aggregates import FederationAggregates
from federation.coordinator.sites.live_view import LiveView, PlannedDelta, hardware_came
from federation.errors import (
    FailedPreconditionError,
    FieldViolation,
    InvalidArgumentError,
    SiteNotFoundError,
    UnavailableError,
)
from federation.jobspec import domain_name, short_name
from federation.metrics import SITES_CONNECTED, SITES_UNREACHABLE
from federation.placement.snapshot import SiteInput, SitePart, Snapshot, build_snapshot
from federation.resources import capacity
from federation.store import Op, Put, Store

log = structlog.get_logger()

SITES = "/sites/"


def cancel_request(
    job_id: str, task: str, epoch: int, reason: str
) -> site_link_service_pb2.CoordinatorMessage:
    """Tell a site to stop its copy of a task at ``epoch``."""
    return site_link_service_pb2.CoordinatorMessage(
        cancel=site_link_service_pb2.CancelTask(
            job_id=job_id, task=task, epoch=epoch, reason=reason
        )
    )


class SessionClosedError(UnavailableError):
    reason = "SITE_DISCONNECTED"


@dataclass(eq=False)
class SiteSession:
    """One agent's open Connect stream: an outbox and the requests awaiting answers."""

    site: str
    peer: str = ""
    """Where the stream comes from, as gRPC names it (``ipv4:10.0.0.7:51234``)."""
    probe_endpoint: str = ""
    """The site's probe endpoint, once checked to be on ``peer``'s address; empty for none."""
    outbox: asyncio.Queue[site_link_service_pb2.CoordinatorMessage | None] = field(
        default_factory=asyncio.Queue
    )
    pending: dict[str, asyncio.Future[site_link_service_pb2.AgentMessage]] = field(
        default_factory=dict
    )
    protocol: int = 1
    """The site-link protocol agreed with the agent (``federation.site_protocol``)."""
    closed: bool = False
    said_goodbye: bool = False
    """The agent ended the session on purpose: the site is DISCONNECTED, not UNREACHABLE."""
    ended_by: UnavailableError | None = None
    """Why the coordinator ended the session (``end``): the status the agent's stream gets."""
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def send(self, message: site_link_service_pb2.CoordinatorMessage) -> None:
        """Queue a message; every message gets a correlation id, for the agent's logs."""
        if self.closed:
            raise SessionClosedError(f"site {self.site} is not connected")
        if not message.correlation_id:
            message.correlation_id = f"{self.site}-{next(self._ids)}"
        self.outbox.put_nowait(message)

    async def request_many(
        self, messages: Sequence[site_link_service_pb2.CoordinatorMessage], timeout_s: float
    ) -> list[site_link_service_pb2.AgentMessage | SessionClosedError | TimeoutError]:
        """Send requests and wait, ``timeout_s`` in all, for the agent's answers (each
        matched by its correlation id); a request without one gets the reason instead."""
        if not messages:
            return []
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[site_link_service_pb2.AgentMessage]] = []
        for message in messages:
            message.correlation_id = f"{self.site}-{next(self._ids)}"
            futures.append(loop.create_future())
            self.pending[message.correlation_id] = futures[-1]
        try:
            for message in messages:
                self.send(message)
            await asyncio.wait(futures, timeout=timeout_s)
        except SessionClosedError as err:
            return [err] * len(messages)
        finally:
            for message in messages:
                self.pending.pop(message.correlation_id, None)
        out: list[site_link_service_pb2.AgentMessage | SessionClosedError | TimeoutError] = []
        for future in futures:
            if not future.done():
                future.cancel()
                out.append(TimeoutError())
            elif isinstance(error := future.exception(), SessionClosedError):
                out.append(error)
            else:
                out.append(future.result())
        return out

    def resolve(self, reply: site_link_service_pb2.AgentMessage) -> bool:
        """Hand an answer to its waiting request; False when nobody waits for it."""
        future = self.pending.get(reply.correlation_id)
        if future is None or future.done():
            return False
        future.set_result(reply)
        return True

    def end(self, why: UnavailableError) -> None:
        """End the session from this side with ``why``: the agent reconnects and says hello
        with every task it holds, which settles what it was not heard to answer."""
        if not self.closed:
            self.ended_by = why
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.outbox.put_nowait(None)
        for future in self.pending.values():
            if not future.done():
                future.set_exception(SessionClosedError(f"site {self.site} disconnected"))


@dataclass
class SiteEntry:
    record: admin_service_pb2.Site
    view: LiveView | None = None
    generation: int = 0
    last_seen: float = 0.0
    session: SiteSession | None = None
    unreachable_since: float | None = None
    """Monotonic time the site became unreachable; None while connected or disconnected."""
    offline_since: float | None = None
    """Monotonic time its last session ended (or this term began); None while connected."""


@dataclass(frozen=True, slots=True)
class OfflineSite:
    """A site without a session, for the lost-site monitor."""

    name: str
    since: float
    """Monotonic time its session ended (or this coordinator's term began)."""
    is_unreachable: bool
    """Gone without a goodbye; False after a goodbye (DISCONNECTED)."""
    is_cordoned: bool


class SiteRegistry:
    """Site records in the store plus live views in memory, with a cached snapshot."""

    def __init__(self, store: Store, on_change: Callable[[], None]) -> None:
        self._store = store
        self._on_change = on_change
        self._sites: dict[str, SiteEntry] = {}
        self._version = 0
        self._snapshot: tuple[int, Snapshot] | None = None
        self._capacity: tuple[int, dict[str, float]] | None = None
        self._site_capacity: dict[str, tuple[int, dict[str, float]]] = {}
        self._shares: tuple[int, dict[str, resources_pb2.OwnerShare]] | None = None
        self._aggregates = FederationAggregates()
        self._freed: set[str] = set()
        """Sites with room that they had not when the scheduler last asked (``take_freed``)."""
        self._transfers = TransferLinks()
        self._arrived = False
        """A site said hello, sent a whole view or a node with hardware it had not, since the
        scheduler last asked (``take_arrived``)."""

    async def load(self) -> None:
        now = time.monotonic()
        for kv in await self._store.range(SITES):
            record = admin_service_pb2.Site.FromString(kv.value)
            self._sites[record.name] = SiteEntry(record, offline_since=now)

    def presume_unreachable(self, names: Iterable[str]) -> None:
        """Mark sites that hold tasks but have not connected in this term UNREACHABLE, from now.

        Called as a term begins: until such a site says hello, nobody knows whether it is up.
        """
        now = time.monotonic()
        for name in names:
            entry = self._sites.get(name)
            if entry is not None and entry.session is None and entry.unreachable_since is None:
                entry.unreachable_since = now
                entry.offline_since = entry.offline_since or now
        self._count_sessions()

    def _changed(self) -> None:
        self._version += 1
        self._on_change()

    @property
    def version(self) -> int:
        """Grows with every change of a view or a site's state."""
        return self._version

    def take_freed(self) -> set[str]:
        """The sites whose views showed room they had not since the last call: a node that
        came, came back, or has devices, cores or memory free that were booked."""
        freed, self._freed = self._freed, set()
        return freed

    def take_arrived(self) -> bool:
        """Whether a site said hello (came, or came back), sent a whole view, or a node with
        devices, health or labels it had not (``hardware_came``) since the last call: hardware
        that no site had may be there now."""
        arrived, self._arrived = self._arrived, False
        return arrived

    def get(self, name: str) -> SiteEntry:
        entry = self._sites.get(name)
        if entry is None:
            raise SiteNotFoundError(name)
        return entry

    def session(self, name: str) -> SiteSession | None:
        entry = self._sites.get(name)
        return entry.session if entry else None

    def record_put(self, record: admin_service_pb2.Site) -> Put:
        """The store write for a site record (done by the caller inside its commit)."""
        return Put(f"{SITES}{record.name}", record.SerializeToString())

    def registered(self, record: admin_service_pb2.Site) -> None:
        """Call after a record written with ``record_put`` is committed."""
        entry = self._sites.get(record.name)
        if entry is None:
            self._sites[record.name] = SiteEntry(record)
        else:
            entry.record = record
        self._changed()

    async def set_cordoned(
        self,
        name: str,
        cordoned: bool,
        also: Sequence[Op] = (),
        *,
        node: str = "",
        drain: admin_service_pb2.Drain | None = None,
    ) -> admin_service_pb2.Site:
        """Cordon or uncordon ``name``, or only its ``node``, writing ``also`` (its audit
        entry) in the same commit; with ``drain``, cordon and record that drain (one per site
        or node: a new one replaces it). Uncordoning the site uncordons its nodes too and
        ends every drain there; uncordoning a node ends that node's drain."""
        entry = self.get(name)
        if node and (entry.view is None or entry.view.node(node) is None):
            raise InvalidArgumentError(
                [FieldViolation("node", f"site {name} reports no node {node!r}")]
            )
        record = admin_service_pb2.Site()
        record.CopyFrom(entry.record)
        nodes = [n for n in record.cordoned_nodes if n != node]
        drains = [d for d in record.drains if d.node != node]
        if cordoned and node:
            nodes.append(node)
        elif cordoned:
            record.cordoned = True
        elif not node:
            record.cordoned, nodes, drains = False, [], []
        if drain is not None:
            drains.append(drain)
        record.cordoned_nodes[:] = sorted(nodes)
        del record.drains[:]
        record.drains.extend(sorted(drains, key=lambda d: d.node))
        await self._store.commit([self.record_put(record), *also])
        entry.record = record
        if not cordoned:
            self._freed.add(name)
        self._changed()
        event = (
            "site_drained"
            if drain is not None
            else ("site_cordoned" if cordoned else "site_uncordoned")
        )
        log.info(event, site=name, node=node or None)
        return self.describe(name)

    def drained(self) -> list[tuple[str, admin_service_pb2.Drain]]:
        """Every drain under way, with its site."""
        return [(e.record.name, d) for e in self._sites.values() for d in e.record.drains]

    def attach(
        self, session: SiteSession, hello: site_link_service_pb2.Hello
    ) -> SiteSession | None:
        """Make ``session`` the site's live session; returns the one it replaces, if any."""
        entry = self.get(session.site)
        previous = entry.session
        entry.session = session
        entry.unreachable_since = entry.offline_since = None
        self._count_sessions()
        entry.view = LiveView(hello.view, copy=False)  # connect lets go of the rest
        entry.generation = hello.generation
        entry.last_seen = time.monotonic()
        self._freed.add(session.site)
        self._arrived = True
        self._aggregate(entry)
        self._changed()
        return previous

    def detach(self, session: SiteSession) -> None:
        """The session ended: UNREACHABLE from now, or DISCONNECTED after a goodbye."""
        entry = self._sites.get(session.site)
        if entry is not None and entry.session is session:
            entry.session = None
            now = time.monotonic()
            entry.offline_since = now
            entry.unreachable_since = None if session.said_goodbye else now
            self._count_sessions()
            self._aggregate(entry)
            self._changed()

    def _count_sessions(self) -> None:
        entries = self._sites.values()
        SITES_CONNECTED.set(sum(e.session is not None for e in entries))
        SITES_UNREACHABLE.set(sum(e.unreachable_since is not None for e in entries))

    def offline(self) -> list[OfflineSite]:
        """Every site without a live session."""
        return [
            OfflineSite(
                name,
                e.offline_since if e.offline_since is not None else time.monotonic(),
                e.unreachable_since is not None,
                e.record.cordoned,
            )
            for name, e in sorted(self._sites.items())
            if e.session is None
        ]

    def connected(self, name: str) -> bool:
        """Whether ``name`` has a live session now."""
        return self.session(name) is not None

    def connected_count(self) -> int:
        """How many sites have a live session."""
        return sum(e.session is not None for e in self._sites.values())

    def close_sessions(self) -> None:
        """End every live session (on stepping down: the agents go to the new leader)."""
        for entry in self._sites.values():
            if entry.session is not None:
                entry.session.close()

    def seen(self, site: str) -> None:
        self.get(site).last_seen = time.monotonic()

    def apply_view(
        self,
        site: str,
        update: site_link_service_pb2.ViewUpdate,
        plan: PlannedDelta | None = None,
    ) -> None:
        """Apply a full view or the next delta (``plan``: what it changes, if read already
        with its write, ``plan_deltas``); a gap in generations needs a resync."""
        entry = self.get(site)
        if update.HasField("full"):
            entry.view = LiveView(update.full)
            self._freed.add(site)
            self._arrived = True
            self._aggregate(entry)
        else:
            if entry.view is None or update.generation != entry.generation + 1:
                raise FailedPreconditionError(
                    f"view delta {update.generation} does not follow {entry.generation}"
                )
            view, delta = entry.view, update.delta
            changes = plan.changes if plan is not None and plan.valid_for(view) else None
            if changes is None:
                changes = view.changes(delta)
            if not self._arrived and any(
                hardware_came(c.was, c.now, c.came) for c in changes if c.now is not None
            ):
                self._arrived = True
            if view.apply(delta, changes):
                self._freed.add(site)
            if entry.session is not None:
                self._aggregates.site_delta(
                    site, changes, view.header.queue if delta.has_queue else None
                )
        entry.generation = update.generation
        entry.last_seen = time.monotonic()
        self._changed()

    def _aggregate(self, entry: SiteEntry) -> None:
        """Keep the federation-wide gauges: a site counts, with its whole view, while it has
        a session (a delta moves them by what it changed, in ``apply_view``)."""
        name = entry.record.name
        if entry.session is None or entry.view is None:
            self._aggregates.site_gone(name)
        else:
            self._aggregates.site_view(name, entry.view.nodes(), entry.view.header.queue)

    def owner_shares(self) -> dict[str, resources_pb2.OwnerShare]:
        """Per site whose view keeps room for its owner's tenants, that owner share."""
        if self._shares is None or self._shares[0] != self._version:
            shares = {
                name: e.view.header.owner_share
                for name, e in self._sites.items()
                if e.view is not None and e.view.header.owner_share.keep
            }
            self._shares = (self._version, shares)
        return self._shares[1]

    def site_capacity(self, name: str) -> dict[str, float]:
        """What the site's view holds of each resource (``resources.capacity``)."""
        entry = self._sites.get(name)
        if entry is None or entry.view is None:
            return {}
        cached = self._site_capacity.get(name)
        if cached is None or cached[0] != self._version:
            cached = self._site_capacity[name] = (self._version, capacity(entry.view.nodes()))
        return cached[1]

    def domain_of(self, name: str) -> str:
        """The domain ``name`` joined with ("edge"), or "" for a site not known."""
        entry = self._sites.get(name)
        return domain_name(entry.record.domain) if entry is not None else ""

    def device_models(self, name: str, devices: Iterable[str]) -> list[str]:
        """The model of each of ``devices`` ("node:kind:index", as sites report what they
        gave a task) in the site's view; a device the view does not show is left out."""
        entry = self._sites.get(name)
        if entry is None or entry.view is None:
            return []
        out = []
        for device in devices:
            node_name, _, rest = device.partition(":")
            kind, _, index = rest.partition(":")
            index = index.partition("/")[0]  # "0/1g.10gb": a partition of device 0
            node = entry.view.node(node_name)
            found = node is not None and next(
                (
                    d.model
                    for d in node.devices
                    if _kind_name(d.kind) == kind and str(d.index) == index
                ),
                None,
            )
            if found:
                out.append(found)
        return out

    def snapshot(self) -> Snapshot:
        """The placement snapshot, rebuilt only when some view or state changed."""
        if self._snapshot is None or self._snapshot[0] != self._version:
            inputs = [
                SiteInput(e.view.header, e.session is not None, e.record.cordoned, _part(e))
                for e in self._sites.values()
                if e.view is not None
            ]
            self._snapshot = (
                self._version,
                build_snapshot(inputs, self._transfers.bandwidth()),
            )
        return self._snapshot[1]

    def observe_transfer(self, source: str, site: str, moved: int, active_s: float) -> None:
        """Learn a link's throughput from a stage-in (``TransferLinks``): the next snapshot's
        estimates of transfers from ``source`` to ``site`` use it."""
        if source in self._sites and self._transfers.observe(source, site, moved, active_s):
            self._version += 1  # the snapshot is built again; nothing else changed

    def capacity(self) -> dict[str, float]:
        """What the sites' views hold of each resource quotas count (``policy.resources``),
        computed again only when some view or state changed."""
        if self._capacity is None or self._capacity[0] != self._version:
            nodes = [n for e in self._sites.values() if e.view is not None for n in e.view.nodes()]
            self._capacity = (self._version, capacity(nodes))
        return self._capacity[1]

    def describe(self, name: str, *, with_view: bool = True) -> admin_service_pb2.Site:
        entry = self.get(name)
        site = admin_service_pb2.Site()
        site.CopyFrom(entry.record)
        site.state = _state(entry)
        if entry.unreachable_since is not None and entry.session is None:
            site.unreachable_s = time.monotonic() - entry.unreachable_since
        site.heartbeat_age_s = time.monotonic() - entry.last_seen if entry.last_seen else -1.0
        site.generation = entry.generation
        if with_view and entry.view is not None:
            entry.view.copy_to(site.view)
        return site

    def tell_trust_bundle(self, bundle_pem: bytes) -> int:
        """Send every connected site the trust bundle; how many were told."""
        told = 0
        for entry in self._sites.values():
            if entry.session is None:
                continue
            with contextlib.suppress(SessionClosedError):
                entry.session.send(  # one message each: sending sets its correlation id
                    site_link_service_pb2.CoordinatorMessage(
                        trust_bundle=site_link_service_pb2.TrustBundle(trust_bundle_pem=bundle_pem)
                    )
                )
                told += 1
        return told

    def announce_probe_peers(self) -> None:
        """Tell every connected site which peers it can measure its links to.

        Only endpoints checked against their session's address are announced: a site must not
        be able to send every other agent to a host of its choosing.
        """
        endpoints = {
            name: e.session.probe_endpoint
            for name, e in self._sites.items()
            if e.session is not None and e.session.probe_endpoint
        }
        for name, entry in self._sites.items():
            if entry.session is None:
                continue
            peers = [
                site_link_service_pb2.ProbePeers.Peer(site=peer, endpoint=endpoint)
                for peer, endpoint in sorted(endpoints.items())
                if peer != name
            ]
            with contextlib.suppress(SessionClosedError):
                entry.session.send(
                    site_link_service_pb2.CoordinatorMessage(
                        probe_peers=site_link_service_pb2.ProbePeers(peers=peers)
                    )
                )

    def known_datasets(self) -> set[str]:
        """Every dataset some site's latest view reports holding."""
        return {
            d for e in self._sites.values() if e.view is not None for d in e.view.header.datasets
        }

    def names(self) -> list[str]:
        return sorted(self._sites)

    def count_by_state(self) -> tuple[Counter[admin_service_pb2.SiteState.ValueType], int]:
        """How many sites are in each state, and how many are cordoned."""
        states = Counter(_state(e) for e in self._sites.values())
        return states, sum(e.record.cordoned for e in self._sites.values())


def _state(entry: SiteEntry) -> admin_service_pb2.SiteState.ValueType:
    """Connected while it has a session; else unreachable or disconnected."""
    if entry.session is not None:
        return admin_service_pb2.SITE_STATE_CONNECTED
    if entry.unreachable_since is not None:
        return admin_service_pb2.SITE_STATE_UNREACHABLE
    return admin_service_pb2.SITE_STATE_DISCONNECTED


def _kind_name(kind: int) -> str:
    """ "GPU": a device kind as sites name it in the devices they report."""
    return short_name(resources_pb2.DeviceKind, kind, "DEVICE_KIND_")


def _part(entry: SiteEntry) -> SitePart:
    """The site's placement arrays, its cordoned nodes not schedulable."""
    assert entry.view is not None
    part = entry.view.part()
    if not entry.record.cordoned_nodes:
        return part
    names = np.array(part.node_names, dtype=object)
    cordoned = np.isin(names, list(entry.record.cordoned_nodes))
    return dataclasses.replace(part, node_schedulable=part.node_schedulable & ~cordoned)
