"""A site's view as its deltas change it, at the cost of what each delta changes.

A delta usually replaces one node of a hundred. Building a new ``SiteView`` for it copied every
node; changing the view in place is no better, since protobuf (upb) frees a message's memory
only with the whole message, so every replaced node would stay in the view's memory for good.
Here the nodes are kept by name: a delta drops the replaced node and keeps the new one in a
message of its own. Those cost about twice the memory of nodes inside one view, and replaced or
removed nodes of that view stay in its memory, so once changes reach a quarter of the nodes
they are gathered into one message again (amortised, a few node copies per delta). A full view
that arrives mid-session is copied: keeping parts of the received message would keep all of
the stream message it came in (upb frees nothing of a message until all of it goes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from federation.api.v1 import resources_pb2, site_link_service_pb2
from federation.placement.snapshot import SitePart, site_part

COMPACT_SHARE = 4
"""Nodes are gathered into one message again once more than 1/COMPACT_SHARE have changed."""


@dataclass(frozen=True, slots=True)
class NodeChange:
    """One node a delta names: as it was and as it is (None: not there, or not any more),
    and of its devices, those that changed (``device_changes``)."""

    was: resources_pb2.Node | None
    now: resources_pb2.Node | None
    gone: Sequence[resources_pb2.Device]
    """The devices of ``was`` that changed or went."""
    came: Sequence[resources_pb2.Device]
    """The devices of ``now`` that changed or came."""
    came_at: Sequence[int]
    """Where each of ``came`` is among ``now``'s devices."""


@dataclass(frozen=True, slots=True)
class PlannedDelta:
    """What a delta of a stream write changes, read before any of the write is applied (so
    its checks and its application compare each device once): valid while ``view`` is the
    site's view and has applied ``applied`` deltas."""

    view: LiveView | None
    """None: read against a full view sent earlier in the same write."""
    applied: int
    changes: list[NodeChange]

    def valid_for(self, view: LiveView) -> bool:
        return view is self.view and view.applied == self.applied


class LiveView:
    """A site's view: its fields apart from the nodes (``header``), its nodes by name, and
    the placement arrays of those nodes (``part``) until they change."""

    def __init__(self, full: resources_pb2.SiteView, *, copy: bool = True) -> None:
        """``copy=False`` keeps ``full`` itself, and so the message it arrived in: for a hello,
        which comes first in its stream message and little comes with it."""
        own = full
        if copy:
            own = resources_pb2.SiteView()
            own.CopyFrom(full)
        self.header = _without_nodes(own)
        """The view without its nodes: read it, never change it (it is replaced whole)."""
        self._nodes = {node.name: node for node in own.nodes}
        self._changes = 0
        """Nodes upserted or removed since the nodes were last gathered into one message."""
        self._sorted: list[resources_pb2.Node] | None = None
        self._part: SitePart | None = None
        self.applied = 0
        """Deltas applied so far."""

    def apply(
        self, delta: resources_pb2.SiteViewDelta, changes: Sequence[NodeChange] | None = None
    ) -> bool:
        """Upserted nodes replace the old ones whole, removed ones go, and the queue, links and
        coordinator link are replaced when the delta says so. The delta is copied, not kept.
        ``changes``: what it changes (``changes``), when already read. Returns whether some
        node has room now that it had not (``room_grew``)."""
        if changes is None:
            changes = self.changes(delta)
        grew = any(c.now is not None and room_grew(c.was, c.now, c.came) for c in changes)
        for name in delta.removed_nodes:
            self._nodes.pop(name, None)
        for node in delta.upserted_nodes:
            own = resources_pb2.Node()
            own.CopyFrom(node)
            self._nodes[node.name] = own
        self.applied += 1
        if changed := len(delta.removed_nodes) + len(delta.upserted_nodes):
            self._changes += changed
            self._sorted = None
            self._part = None
        if delta.has_queue or delta.has_links or delta.has_coordinator_link:
            header = resources_pb2.SiteView()
            header.CopyFrom(self.header)  # small without nodes; the old one goes whole
            if delta.has_queue:
                header.queue.CopyFrom(delta.queue)
            if delta.has_links:
                del header.links[:]
                header.links.extend(delta.links)
            if delta.has_coordinator_link:
                header.coordinator_link.CopyFrom(delta.coordinator_link)
            self.header = header
        if self._changes * COMPACT_SHARE > len(self._nodes):
            compact = self.view()
            self._nodes = {node.name: node for node in compact.nodes}
            self._changes = 0
            self._sorted = list(compact.nodes)
        return grew

    def node(self, name: str) -> resources_pb2.Node | None:
        return self._nodes.get(name)

    def changes(self, delta: resources_pb2.SiteViewDelta) -> list[NodeChange]:
        """What ``delta`` changes of the nodes it names, read before it is applied."""
        return node_changes(delta, self._nodes.get)

    def nodes(self) -> list[resources_pb2.Node]:
        """The nodes in name order (read them, never change them)."""
        if self._sorted is None:
            self._sorted = sorted(self._nodes.values(), key=lambda node: node.name)
        return self._sorted

    def part(self) -> SitePart:
        """The nodes as placement arrays, built again only after the nodes change."""
        if self._part is None:
            self._part = site_part(self.nodes())
        return self._part

    def view(self) -> resources_pb2.SiteView:
        """The whole view as one new message, nodes in name order."""
        out = resources_pb2.SiteView()
        self.copy_to(out)
        return out

    def copy_to(self, out: resources_pb2.SiteView) -> None:
        """Make ``out`` the whole view, nodes in name order."""
        out.CopyFrom(self.header)
        out.nodes.extend(self.nodes())


def node_changes(
    delta: resources_pb2.SiteViewDelta, held: Callable[[str], resources_pb2.Node | None]
) -> list[NodeChange]:
    """What ``delta`` changes of the nodes it names, ``held`` giving each as it is before."""
    upserted = delta.upserted_nodes
    if len(upserted) == 1 and not delta.removed_nodes:  # what an agent sends most
        only = upserted[0]
        before = held(only.name)
        return [NodeChange(before, only, *device_changes(before, only))]
    after = {node.name: node for node in upserted}  # the last of a name wins
    out = []
    for name in dict.fromkeys([*delta.removed_nodes, *after]):
        was, now = held(name), after.get(name)
        out.append(NodeChange(was, now, *device_changes(was, now)))
    return out


def plan_deltas(
    view: LiveView | None, messages: Sequence[site_link_service_pb2.AgentMessage]
) -> dict[int, PlannedDelta]:
    """Per view delta among one stream write's ``messages`` (by place), what it changes, read
    against ``view`` as the messages before it will leave it (a full view among them starts
    over from its nodes)."""
    pending: dict[str, resources_pb2.Node | None] = {}
    """Nodes the write's earlier messages upserted (or removed: None)."""
    base, applied = view, view.applied if view is not None else 0
    out: dict[int, PlannedDelta] = {}

    def held(name: str) -> resources_pb2.Node | None:
        if name in pending:
            return pending[name]
        return base.node(name) if base is not None else None

    for i, message in enumerate(messages):
        if message.WhichOneof("body") != "view":
            continue
        update = message.view
        if update.HasField("full"):
            base, view = None, None
            pending = {node.name: node for node in update.full.nodes}
            continue
        changes = node_changes(update.delta, held)
        out[i] = PlannedDelta(view, applied, changes)
        applied += 1
        for change in changes:
            name = (change.now or change.was or _NAMELESS).name
            pending[name] = change.now
    return out


_NAMELESS = resources_pb2.Node()


def room_grew(
    old: resources_pb2.Node | None,
    new: resources_pb2.Node,
    came: Sequence[resources_pb2.Device] | None = None,
) -> bool:
    """Whether ``new`` has room to book that ``old`` (the same node before) had not: a task
    that did not fit there may fit now. Only what tasks book counts, not measured use.
    ``came``: ``new``'s devices that changed, when known (``device_changes``)."""
    if old is None:
        return True
    if new.schedulable and not old.schedulable:
        return True
    if new.cpu_free > old.cpu_free or new.memory_free_mib > old.memory_free_mib:
        return True
    if came is None:
        came = device_changes(old, new)[1]
    if not came:
        return False
    before = {device.id: device for device in old.devices}
    healthy = resources_pb2.DEVICE_HEALTH_HEALTHY
    for device in came:
        was = before.get(device.id)
        if was is None or (was.allocated and not device.allocated):
            return True
        if device.free_fraction > was.free_fraction:
            return True
        if device.health == healthy and was.health != healthy:
            return True
        if sum(p.free for p in device.partitions) > sum(p.free for p in was.partitions):
            return True
    return False


def hardware_came(
    old: resources_pb2.Node | None,
    new: resources_pb2.Node,
    came: Sequence[resources_pb2.Device] | None = None,
) -> bool:
    """Whether ``new`` has devices, health or labels that ``old`` (the same node before) had
    not: a task that no site had the hardware for may fit now, where room coming free never
    helps it (the scheduler's unfit tasks). ``came``: ``new``'s devices that changed, when
    known (``device_changes``)."""
    if old is None or (new.schedulable and not old.schedulable) or new.labels != old.labels:
        return True
    if came is None:
        came = device_changes(old, new)[1]
    if not came:
        return False
    before = {device.id: device for device in old.devices}
    healthy = resources_pb2.DEVICE_HEALTH_HEALTHY
    for device in came:
        was = before.get(device.id)
        if was is None or (device.health == healthy and was.health != healthy):
            return True
    return False


def device_changes(
    old: resources_pb2.Node | None, new: resources_pb2.Node | None
) -> tuple[Sequence[resources_pb2.Device], Sequence[resources_pb2.Device], Sequence[int]]:
    """The devices of ``old`` and of ``new`` (one node before and after a delta; None: it was
    not there, or is no longer), less each pair equal at the same place in both, and where
    those of ``new`` are. A delta that changes a reading or a booking changes a device or a
    few, and sends the rest as they were: what reads a delta need not read those again."""
    news = new.devices if new is not None else ()
    if old is None or new is None or len(old.devices) != len(news):
        return (old.devices if old is not None else ()), news, range(len(news))
    gone: list[resources_pb2.Device] = []
    came: list[resources_pb2.Device] = []
    at: list[int] = []
    for i, (was, now) in enumerate(zip(old.devices, news, strict=True)):
        if was != now:
            gone.append(was)
            came.append(now)
            at.append(i)
    return gone, came, at


def _without_nodes(view: resources_pb2.SiteView) -> resources_pb2.SiteView:
    """A copy of ``view`` without its nodes that holds none of their memory: clearing them from
    a full copy would keep them in that copy's memory, so the cleared copy is copied again."""
    scratch = resources_pb2.SiteView()
    scratch.CopyFrom(view)
    del scratch.nodes[:]
    header = resources_pb2.SiteView()
    header.CopyFrom(scratch)
    return header
