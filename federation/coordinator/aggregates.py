"""The coordinator's federation-wide gauges, kept by difference as the sites' views change.

A site's hello or whole view is counted whole. A delta costs the nodes it names, not the site:
what those nodes held before it is taken out of the site's sums and the federation's, and what
they hold after it is put in. Only the series whose values moved are set again, through series
looked up once (a labelled lookup costs more than the sum it shows).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import Gauge

from federation.api.v1 import resources_pb2
from federation.coordinator.live_view import NodeChange
from federation.jobspec import short_name
from federation.metrics import (
    AGGREGATE_GAUGES,
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
        if node.measured.measured_at:
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
            if device.measured.measured_at:
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

    def cpu_moved(self) -> bool:
        """For a difference: whether it moves some CPU sum (or the counts that zero them)."""
        return bool(self.nodes or self.measured_nodes or any(self.cpu))


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


class _Mean:
    """A series that shows part / whole, present only while whole > 0."""

    __slots__ = ("_child", "_gauge", "_labels")

    def __init__(self, gauge: Gauge, *labels: str) -> None:
        self._gauge = gauge
        self._labels = labels
        self._child: Gauge | None = None

    def show(self, part: float, whole: float) -> None:
        if whole > 0:
            if self._child is None:
                self._child = self._gauge.labels(*self._labels)
            self._child.set(part / whole)
        elif self._child is not None:
            self.drop()

    def drop(self) -> None:
        self._gauge.remove(*self._labels)
        self._child = None


class _DeviceSeries:
    """The federation's series of one kind and model."""

    __slots__ = ("_key", "_mean", "_states")

    def __init__(self, key: _DeviceKey) -> None:
        self._key = key
        self._states = [DEVICES.labels(*key, state) for state in DEVICE_STATES]
        self._mean = _Mean(DEVICE_USE_MEAN, *key)

    def show(self, sums: list[float]) -> None:
        for child, value in zip(self._states, sums, strict=False):
            child.set(max(0.0, value))
        self._mean.show(sums[_USE], sums[_MEASURED])

    def drop(self) -> None:
        for state in DEVICE_STATES:
            DEVICES.remove(*self._key, state)
        self._mean.drop()


@dataclass(slots=True)
class _Site:
    """One connected site: its sums and its own series."""

    name: str
    sums: _Sums = field(default_factory=_Sums)
    tasks: tuple[float, float] = (0.0, 0.0)
    """Pending, running."""
    devices: list[Gauge] = field(init=False)
    cpu: list[Gauge] = field(init=False)
    task_series: list[Gauge] = field(init=False)
    wait: Gauge = field(init=False)
    device_mean: _Mean = field(init=False)
    cpu_mean: _Mean = field(init=False)

    def __post_init__(self) -> None:
        site = self.name
        self.devices = [SITE_DEVICES.labels(site, state) for state in DEVICE_STATES]
        self.cpu = [SITE_CPU_CORES.labels(site, state) for state in CPU_STATES]
        self.task_series = [SITE_TASKS.labels(site, state) for state in TASK_STATES]
        self.wait = SITE_QUEUE_WAIT.labels(site)
        self.device_mean = _Mean(SITE_DEVICE_USE_MEAN, site)
        self.cpu_mean = _Mean(SITE_CPU_USE_MEAN, site)

    def show_devices(self) -> None:
        columns = self.sums.devices.values()
        totals = [math.fsum(column) for column in zip(_zeros(), *columns, strict=True)]
        for child, value in zip(self.devices, totals, strict=False):
            child.set(value)
        self.device_mean.show(totals[_USE], totals[_MEASURED])

    def show_cpu(self) -> None:
        cpu = self.sums.cpu
        for child, value in zip(self.cpu, cpu, strict=True):
            child.set(value)
        self.cpu_mean.show(cpu[3], cpu[2])

    def show_queue(self, queue: resources_pb2.QueueState) -> None:
        self.tasks = (queue.pending_tasks, queue.running_tasks)
        for child, value in zip(self.task_series, self.tasks, strict=True):
            child.set(value)
        self.wait.set(queue.estimated_wait_s)

    def drop(self) -> None:
        site = self.name
        for state in DEVICE_STATES:
            SITE_DEVICES.remove(site, state)
        for state in CPU_STATES:
            SITE_CPU_CORES.remove(site, state)
        for state in TASK_STATES:
            SITE_TASKS.remove(site, state)
        SITE_QUEUE_WAIT.remove(site)
        self.device_mean.drop()
        self.cpu_mean.drop()


class FederationAggregates:
    """The coordinator's federation-wide gauges, kept from the views of the connected sites.

    A whole view costs what the site holds; a delta, what the nodes it names hold. Nothing
    walks every site. A new instance (a new term of leadership) starts from nothing.
    """

    def __init__(self) -> None:
        for gauge in AGGREGATE_GAUGES:
            gauge.clear()
        self._sites: dict[str, _Site] = {}
        self._all = _Sums()
        self._tasks = [0.0, 0.0]
        self._devices: dict[_DeviceKey, _DeviceSeries] = {}
        self._cpu: list[Gauge] = []
        self._task_series: list[Gauge] = []
        """Looked up at the first site: until then the federation's sums have no series."""

    def site_view(
        self,
        site: str,
        nodes: Iterable[resources_pb2.Node],
        queue: resources_pb2.QueueState,
    ) -> None:
        """A connected site's whole view: its hello, or a full view mid-session."""
        entry = self._sites.get(site)
        if entry is None:
            entry = self._sites[site] = _Site(site)
        new = _Sums()
        new.count(nodes)
        old, entry.sums = entry.sums, new
        self._all.add(old, -1)
        self._all.add(new)
        self._show(old.devices.keys() | new.devices.keys(), cpu=True)
        entry.show_devices()
        entry.show_cpu()
        self._queue(entry, queue)

    def site_delta(
        self, site: str, changes: Iterable[NodeChange], queue: resources_pb2.QueueState | None
    ) -> None:
        """A connected site's delta: what it changed of the nodes it named (read before it
        was applied), and the site's queue if that changed."""
        entry = self._sites.get(site)
        if entry is None:
            return
        moved = _moved(changes)
        devices = [key for key, sums in moved.devices.items() if any(sums)]
        cpu = moved.cpu_moved()
        if devices or cpu:
            entry.sums.add(moved)
            self._all.add(moved)
            self._show(devices, cpu=cpu)
            if devices:
                entry.show_devices()
            if cpu:
                entry.show_cpu()
        if queue is not None:
            self._queue(entry, queue)

    def site_gone(self, site: str) -> None:
        """The site has no session any more: it counts no longer."""
        entry = self._sites.pop(site, None)
        if entry is None:
            return
        self._all.add(entry.sums, -1)
        self._show(entry.sums.devices.keys(), cpu=True)
        self._queue(entry, None)
        entry.drop()

    def _queue(self, entry: _Site, queue: resources_pb2.QueueState | None) -> None:
        """The site's task counts become ``queue``'s (none: the site is gone)."""
        was = entry.tasks
        if queue is not None:
            entry.show_queue(queue)
        now = entry.tasks if queue is not None else (0.0, 0.0)
        if not self._task_series:
            self._task_series = [TASKS.labels(state) for state in TASK_STATES]
        for i, child in enumerate(self._task_series):
            self._tasks[i] += now[i] - was[i]
            child.set(self._tasks[i])

    def _show(self, keys: Iterable[_DeviceKey], *, cpu: bool) -> None:
        """Set the federation's series of these kinds and models (and its CPU's)."""
        for key in keys:
            sums = self._all.devices.get(key)
            series = self._devices.get(key)
            if sums is None:
                if series is not None:
                    del self._devices[key]
                    series.drop()
                continue
            if series is None:
                series = self._devices[key] = _DeviceSeries(key)
            series.show(sums)
        if cpu:
            if not self._cpu:
                self._cpu = [CPU_CORES.labels(state) for state in CPU_STATES]
            for child, value in zip(self._cpu, self._all.cpu, strict=True):
                child.set(max(0.0, value))
