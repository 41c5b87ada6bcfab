"""Discovery that keeps looking: the host is discovered again on an interval and on demand.

A device that disappears, turns unhealthy or comes back changes the site's view (the packer
never places on a device that is not healthy), and what the host and its devices use now is
published beside what tasks booked. Allocations are held by a device's position in its node,
so positions never change: a device that is gone stays in the list, unhealthy, and a new one
is added at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from federation.api.v1 import resources_pb2
from federation.metrics import (
    DEVICE_BOOKED,
    DEVICE_MEMORY_USED,
    DEVICE_POWER,
    DEVICE_TEMPERATURE,
    DEVICE_USE,
    NODE_CPU_USE,
    NODE_MEMORY_USED,
)

log = structlog.get_logger()

GONE = "not found when the host was discovered again"


@dataclass(frozen=True, slots=True)
class Pace:
    """How often and how finely measured readings go to the coordinator: a change in a compute
    share of ``compute_step``, or in memory use of ``memory_step`` of the total, is worth
    sending, at most once per ``min_interval_s``. Health and devices that come or go are sent
    at once, whatever the pace."""

    min_interval_s: float
    compute_step: float
    memory_step: float


PACES = (
    (100.0, Pace(min_interval_s=0.0, compute_step=0.05, memory_step=0.02)),
    (10.0, Pace(min_interval_s=15.0, compute_step=0.10, memory_step=0.05)),
    (0.0, Pace(min_interval_s=60.0, compute_step=0.20, memory_step=0.10)),
)
"""(slowest link in Mbit/s, pace): a thin link to the coordinator (an edge site's) carries
fewer, coarser updates; an unmeasured link gets the fastest pace."""
FAST = PACES[0][1]


def readings_pace(link: resources_pb2.Link | None) -> Pace:
    """The pace for readings over ``link``, the measured link to the coordinator."""
    if link is None or not link.measured_at:
        return FAST
    return next(pace for slowest, pace in PACES if link.bandwidth_mbps >= slowest)


_NODE_LABELS = ("health", "health_reason", "driver", "cuda")
"""Node labels discovery derives from what it found."""


def merge_rediscovered(current: resources_pb2.Node, found: resources_pb2.Node) -> list[str]:
    """Bring ``current`` up to date with ``found`` (a fresh discovery of the same machine), in
    place, keeping every device's position.

    Returns:
        What changed in the devices' health or presence, for people; readings that moved are
        not listed (``worth_publishing`` says whether they matter).
    """
    fresh = {device.id: device for device in found.devices}
    changes = []
    for device in current.devices:
        now = fresh.pop(device.id, None)
        if now is None:
            if (
                device.health != resources_pb2.DEVICE_HEALTH_UNHEALTHY
                or device.health_reason != GONE
            ):
                changes.append(f"device {device.id} is gone")
            device.health, device.health_reason = resources_pb2.DEVICE_HEALTH_UNHEALTHY, GONE
            device.ClearField("measured")
            continue
        if (device.health, device.health_reason) != (now.health, now.health_reason):
            state = resources_pb2.DeviceHealth.Name(now.health).removeprefix("DEVICE_HEALTH_")
            why = f" ({now.health_reason})" if now.health_reason else ""
            changes.append(f"device {device.id} is {state.lower()}{why}")
        device.health, device.health_reason = now.health, now.health_reason
        device.power_watts, device.temperature_c = now.power_watts, now.temperature_c
        device.memory_free_mib = now.memory_free_mib
        device.measured.CopyFrom(now.measured)
        device.attributes.clear()
        device.attributes.update(now.attributes)
    for device in fresh.values():
        changes.append(f"device {device.id} ({device.model}) is new")
        current.devices.append(device)
    for key in _NODE_LABELS:
        if key in found.labels:
            current.labels[key] = found.labels[key]
        else:
            current.labels.pop(key, None)
    current.measured.CopyFrom(found.measured)
    return changes


def worth_publishing(
    before: resources_pb2.Node, after: resources_pb2.Node, pace: Pace = FAST
) -> bool:
    """Whether readings moved enough to send at ``pace``, for the node or any device."""
    pairs = [(before.measured, after.measured, after.memory_mib)]
    pairs += [
        (old.measured, new.measured, new.memory_total_mib)
        for old, new in zip(before.devices, after.devices, strict=False)
    ]
    return len(before.devices) != len(after.devices) or any(
        abs(old.compute - new.compute) >= pace.compute_step
        or abs(int(old.memory_used_mib) - int(new.memory_used_mib)) >= pace.memory_step * total
        for old, new, total in pairs
    )


def export_gauges(site: str, nodes: list[resources_pb2.Node]) -> None:
    """The site's nodes as Prometheus gauges: measured use beside the share tasks booked."""
    for node in nodes:
        if node.measured.measured_at:
            NODE_CPU_USE.labels(site, node.name).set(node.measured.compute)
            NODE_MEMORY_USED.labels(site, node.name).set(node.measured.memory_used_mib << 20)
        for device in node.devices:
            name = device.id or str(device.index)
            shared = 1.0 - device.free_fraction if device.shareable else 0.0
            DEVICE_BOOKED.labels(site, node.name, name).set(1.0 if device.allocated else shared)
            if device.measured.measured_at:
                DEVICE_USE.labels(site, node.name, name).set(device.measured.compute)
                memory = device.measured.memory_used_mib << 20
                DEVICE_MEMORY_USED.labels(site, node.name, name).set(memory)
                DEVICE_POWER.labels(site, node.name, name).set(device.power_watts)
                DEVICE_TEMPERATURE.labels(site, node.name, name).set(device.temperature_c)


class HostWatcher:
    """Discovers the host again every ``interval_s`` and on SIGUSR1, and hands what it found
    to ``apply`` (the core's ``refresh``)."""

    def __init__(
        self,
        discover: Callable[[], resources_pb2.Node],
        apply: Callable[[resources_pb2.Node], None],
        interval_s: float,
    ) -> None:
        self._discover = discover
        self._apply = apply
        self._interval_s = interval_s
        self._now = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGUSR1, self._now.set)
        self._task = asyncio.create_task(self._run())

    def now(self) -> None:
        """Discover again at once (what SIGUSR1 does)."""
        self._now.set()

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._now.wait(), self._interval_s)
            self._now.clear()
            try:
                # Vendor tools may take seconds: never on the event loop.
                found = await asyncio.to_thread(self._discover)
                self._apply(found)
            except Exception:
                log.exception("rediscovery_failed")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
