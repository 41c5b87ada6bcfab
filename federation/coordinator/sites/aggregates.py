"""The coordinator's federation-wide gauges: sums kept by difference as the sites' views
change, made into series only when Prometheus scrapes.

A site's hello or whole view is counted whole. A delta costs the nodes it names, not the site:
what those nodes held before it is taken out of the site's sums and the federation's, and what
they hold after it is put in, counting only the devices that changed. No gauge is set as views
change: ``metrics.AGGREGATES`` asks the current term's ``FederationAggregates`` for its series at
each scrape, in the metrics server's thread (it copies each dict and list it reads, so a view
that changes meanwhile costs at most a sum read half moved). A site costs its sums, not the
dozen labelled gauge children that kept its series (about 40 KB).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import Metric

from federation.api.v1 import resources_pb2
from federation.coordinator.sites.live_view import NodeChange
from federation.jobspec import short_name
from federation.metrics import (
    AGGREGATE_FAMILIES,
    AGGREGATES,
    CPU_CORES,
    CPU_STATES,
    DEVICE_STATES,
    DEVICE_USE_MEAN,
    DEVICES,
    SITE_CPU_CORES,
    SITE_CPU_USE_MEAN,
    SITE_DEVICE_USE_MEAN,
    SITE_DEVICES,
    SITE_QUEUE_WAIT,
    SITE_TASKS,
    TASK_STATES,
    TASKS,
)

_USABLE = (resources_pb2.DEVICE_HEALTH_HEALTHY, resources_pb2.DEVICE_HEALTH_UNSPECIFIED)
"""Health fit for work, as placement reads it."""
_KINDS = {
    kind: short_name(resources_pb2.DeviceKind, kind, "DEVICE_KIND_")
    for kind in resources_pb2.DeviceKind.values()
}
_DeviceKey = tuple[str, str]
"""(kind, model)."""
_MEASURED, _USE = 3, 4
"""Where a device sum keeps how many devices have a reading, and the sum of those readings."""


def _zeros() -> list[float]:
    """Per (kind, model): the DEVICE_STATES in order, then the sum of the measured use."""
    return [0.0] * (len(DEVICE_STATES) + 1)


def _shared_out(device: resources_pb2.Device) -> float:
    """The share of a shareable device that tasks hold as fractions."""
    return min(1.0, max(0.0, 1.0 - device.free_fraction)) if device.shareable else 0.0


@dataclass(slots=True)
class _Sums:
    """What some nodes add up to: a site's view, the federation's, or what a delta moved."""

    devices: dict[_DeviceKey, list[float]] = field(default_factory=dict)
    """Per (kind, model), as ``_zeros`` lays them out."""
    cpu: list[float] = field(default_factory=lambda: [0.0] * len(CPU_STATES))
    """The CPU_STATES in order."""
    nodes: int = 0
    measured_nodes: int = 0

    def count(self, nodes: Iterable[resources_pb2.Node]) -> None:
        """Add what ``nodes`` hold."""
        for node in nodes:
            self.count_node(node, node.devices)

    def count_node(self, node: resources_pb2.Node, devices: Iterable[resources_pb2.Device]) -> None:
        """Add what ``node`` holds of CPU, and what ``devices`` (some of its own) hold."""
        cpu = self.cpu
        cores = node.cpu_cores
        self.nodes += 1
        cpu[0] += cores
        cpu[1] += max(0.0, cores - node.cpu_free)
        # HasField first: reading an unset submessage of a node the view keeps leaves a stub
        # with it for good (about 340 bytes a node, 34 MiB at 1,000 sites of 100 nodes).
        if node.HasField("measured") and node.measured.measured_at:
            self.measured_nodes += 1
            cpu[2] += cores
            cpu[3] += node.measured.compute * cores
        sums_of = self.devices
        for device in devices:
            kind = _KINDS.get(device.kind) or short_name(
                resources_pb2.DeviceKind, device.kind, "DEVICE_KIND_"
            )
            sums = sums_of.get((kind, device.model))
            if sums is None:
                sums = sums_of[kind, device.model] = _zeros()
            sums[0] += 1
            sums[1] += device.health in _USABLE
            sums[2] += 1.0 if device.allocated else _shared_out(device)
            if device.HasField("measured") and device.measured.measured_at:
                sums[_MEASURED] += 1
                sums[_USE] += device.measured.compute

    def add(self, other: _Sums, sign: int = 1) -> None:
        """Add ``other`` in (``sign`` 1) or take it out (-1). What no node or device holds
        any more is zero, not what rounding left of it: a kind and model without devices
        goes, and so do the CPU sums of no node, and the measured ones of no reading."""
        self.nodes += sign * other.nodes
        self.measured_nodes += sign * other.measured_nodes
        cpu = self.cpu
        for i, value in enumerate(other.cpu):
            cpu[i] += sign * value
        if not self.nodes:
            cpu[:] = [0.0] * len(CPU_STATES)
        elif not self.measured_nodes:
            cpu[2] = cpu[3] = 0.0
        for key, moved in other.devices.items():
            sums = self.devices.get(key)
            if sums is None:
                sums = self.devices[key] = _zeros()
            for i, value in enumerate(moved):
                sums[i] += sign * value
            if sums[0] < 0.5:
                del self.devices[key]
            elif sums[_MEASURED] < 0.5:
                sums[_MEASURED] = sums[_USE] = 0.0


def _moved(changes: Iterable[NodeChange]) -> _Sums:
    """What a delta moves: per node it named, what it held before and holds after, of its
    devices only those that changed. Each side is counted on its own and the one taken from
    the other, so that what did not change moves nothing, not a rounding."""
    old, new = _Sums(), _Sums()
    for change in changes:
        if change.was is not None:
            old.count_node(change.was, change.gone)
        if change.now is not None:
            new.count_node(change.now, change.came)
    new.nodes -= old.nodes
    new.measured_nodes -= old.measured_nodes
    for i, value in enumerate(old.cpu):
        new.cpu[i] -= value
    for key, sums in old.devices.items():
        into = new.devices.get(key)
        if into is None:
            into = new.devices[key] = _zeros()
        for i, value in enumerate(sums):
            into[i] -= value
    return new


@dataclass(slots=True)
class _Site:
    """What one connected site's view adds up to."""

    sums: _Sums = field(default_factory=_Sums)
    tasks: tuple[float, float] = (0.0, 0.0)
    """Pending, running."""
    wait_s: float = 0.0


class FederationAggregates:
    """The coordinator's federation-wide gauges, kept from the views of the connected sites.

    A whole view costs what the site holds; a delta, what the nodes it names hold. Nothing
    walks every site but a scrape. A new instance (a new term of leadership) starts from
    nothing and is the one scrapes read from then on.
    """

    def __init__(self) -> None:
        self._sites: dict[str, _Site] = {}
        self._all = _Sums()
        self._tasks = [0.0, 0.0]
        self._counted = False
        """Whether a site was ever counted: until then the federation's sums have no series."""
        AGGREGATES.source = self.families

    def site_view(
        self,
        site: str,
        nodes: Iterable[resources_pb2.Node],
        queue: resources_pb2.QueueState,
    ) -> None:
        """A connected site's whole view: its hello, or a full view mid-session."""
        entry = self._sites.get(site)
        if entry is None:
            entry = self._sites[site] = _Site()
        new = _Sums()
        new.count(nodes)
        self._all.add(entry.sums, -1)
        self._all.add(new)
        entry.sums = new
        self._queue(entry, queue)
        self._counted = True

    def site_delta(
        self, site: str, changes: Iterable[NodeChange], queue: resources_pb2.QueueState | None
    ) -> None:
        """A connected site's delta: what it changed of the nodes it named (read before it
        was applied), and the site's queue if that changed."""
        entry = self._sites.get(site)
        if entry is None:
            return
        moved = _moved(changes)
        entry.sums.add(moved)
        self._all.add(moved)
        if queue is not None:
            self._queue(entry, queue)

    def site_gone(self, site: str) -> None:
        """The site has no session any more: it counts no longer."""
        entry = self._sites.pop(site, None)
        if entry is not None:
            self._all.add(entry.sums, -1)
            self._queue(entry, None)

    def _queue(self, entry: _Site, queue: resources_pb2.QueueState | None) -> None:
        """The site's task counts and wait become ``queue``'s (none: the site is gone)."""
        now = (queue.pending_tasks, queue.running_tasks) if queue is not None else (0.0, 0.0)
        for i, was in enumerate(entry.tasks):
            self._tasks[i] += now[i] - was
        entry.tasks = now
        entry.wait_s = queue.estimated_wait_s if queue is not None else 0.0

    def families(self) -> list[Metric]:
        """Every series, from the sums as they are (called by a scrape, in its thread)."""
        out = {spec: spec.family() for spec in AGGREGATE_FAMILIES}
        for (kind, model), kept in list(self._all.devices.items()):
            sums = list(kept)
            for state, value in zip(DEVICE_STATES, sums, strict=False):
                out[DEVICES].add_metric([kind, model, state], max(0.0, value))
            if sums[_MEASURED] >= 0.5:
                out[DEVICE_USE_MEAN].add_metric([kind, model], sums[_USE] / sums[_MEASURED])
        if self._counted:
            for state, value in zip(CPU_STATES, list(self._all.cpu), strict=True):
                out[CPU_CORES].add_metric([state], max(0.0, value))
            for state, value in zip(TASK_STATES, list(self._tasks), strict=True):
                out[TASKS].add_metric([state], value)
        for name, entry in list(self._sites.items()):
            columns = [list(sums) for sums in list(entry.sums.devices.values())]
            totals = [math.fsum(column) for column in zip(_zeros(), *columns, strict=True)]
            for state, value in zip(DEVICE_STATES, totals, strict=False):
                out[SITE_DEVICES].add_metric([name, state], value)
            if totals[_MEASURED] > 0:
                out[SITE_DEVICE_USE_MEAN].add_metric([name], totals[_USE] / totals[_MEASURED])
            cores = list(entry.sums.cpu)
            for state, value in zip(CPU_STATES, cores, strict=True):
                out[SITE_CPU_CORES].add_metric([name, state], value)
            if cores[2] > 0:
                out[SITE_CPU_USE_MEAN].add_metric([name], cores[3] / cores[2])
            for state, value in zip(TASK_STATES, entry.tasks, strict=True):
                out[SITE_TASKS].add_metric([name, state], value)
            out[SITE_QUEUE_WAIT].add_metric([name], entry.wait_s)
        return list(out.values())
