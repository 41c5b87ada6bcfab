"""Bin-packing of task replicas onto a site's nodes and devices, for the embedded core.

Pure functions over ``Node`` protos and a ``Usage`` tally; nothing here holds state or runs.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from federation.agent.discovery import device_kind_name
from federation.api.v1 import jobs_pb2, resources_pb2

_EPS = 1e-9
_USABLE_HEALTH = frozenset(
    {resources_pb2.DEVICE_HEALTH_HEALTHY, resources_pb2.DEVICE_HEALTH_UNSPECIFIED}
)
# Variables that confine a vendor's runtime to the replica's devices.
_VISIBILITY_VARS = {
    ("nvidia", resources_pb2.DEVICE_KIND_GPU): ("CUDA_VISIBLE_DEVICES",),
    ("amd", resources_pb2.DEVICE_KIND_GPU): ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"),
    ("huawei", resources_pb2.DEVICE_KIND_NPU): ("ASCEND_RT_VISIBLE_DEVICES",),
    ("cambricon", resources_pb2.DEVICE_KIND_MLU): ("MLU_VISIBLE_DEVICES",),
}

# Devices, cpu and memory left over (or missing), then the node name to break ties.
_Rank = tuple[int, float, int, str]


@dataclass(frozen=True, slots=True)
class Slot:
    """Capacity held on one node for one replica.

    Devices are named by their position in ``Node.devices``, since ids may be empty or clash.
    """

    node: str
    cpu: float
    memory_mib: int
    device_positions: tuple[int, ...]


@dataclass(slots=True)
class Usage:
    """Capacity held on each node."""

    cpu: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    memory_mib: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    devices: set[tuple[str, int]] = field(default_factory=set)

    @classmethod
    def of(cls, slots: Iterable[Slot]) -> Usage:
        """The tally of ``slots``."""
        usage = cls()
        for slot in slots:
            usage.add(slot)
        return usage

    def copy(self) -> Usage:
        """An independent copy, for trying placements."""
        return Usage(
            defaultdict(float, self.cpu), defaultdict(int, self.memory_mib), set(self.devices)
        )

    def add(self, slot: Slot) -> None:
        """Counts ``slot`` as held."""
        self.cpu[slot.node] += slot.cpu
        self.memory_mib[slot.node] += slot.memory_mib
        self.devices.update((slot.node, pos) for pos in slot.device_positions)


def _usable(device: resources_pb2.Device) -> bool:
    return device.health in _USABLE_HEALTH


def _matches(device: resources_pb2.Device, acc: jobs_pb2.AcceleratorRequest) -> bool:
    return (
        _usable(device)
        and acc.kind in (resources_pb2.DEVICE_KIND_UNSPECIFIED, device.kind)
        and (not acc.vendor or acc.vendor.lower() == device.vendor.lower())
        and (not acc.models or device.model in acc.models)
        and device.memory_total_mib >= acc.min_memory_mib
    )


def describe_request(acc: jobs_pb2.AcceleratorRequest) -> str:
    """E.g. ``"4 NPU (huawei)"`` or ``"2 GPU (model H100 or A100, >= 40960 MiB)"``."""
    kind = device_kind_name(acc.kind) if acc.kind else "device"
    qualifiers = [acc.vendor] if acc.vendor else []
    if acc.models:
        qualifiers.append("model " + " or ".join(acc.models))
    if acc.min_memory_mib:
        qualifiers.append(f">= {acc.min_memory_mib} MiB")
    return f"{acc.count} {kind}" + (f" ({', '.join(qualifiers)})" if qualifiers else "")


def place(
    nodes: Iterable[resources_pb2.Node], spec: jobs_pb2.TaskSpec, usage: Usage
) -> tuple[Slot, ...] | str:
    """Places every replica of a gang at once, or says why it does not fit.

    Each replica goes to the schedulable node it fits on that would be left with the least free
    capacity (best fit), so partly used nodes fill up before empty ones are touched.

    Args:
        nodes: The site's nodes.
        spec: The task; ``replicas`` 0 means 1.
        usage: Capacity already held; not modified.

    Returns:
        One slot per replica, or the reason the gang was declined.
    """
    schedulable = [node for node in nodes if node.schedulable]
    if not schedulable:
        return "no schedulable nodes"
    replicas = spec.replicas or 1
    tentative = usage.copy()
    slots: list[Slot] = []
    for placed in range(replicas):
        outcomes = [_fit(node, spec.resources, tentative) for node in schedulable]
        fits = [(rank, slot) for rank, slot, _ in outcomes if slot is not None]
        if not fits:
            reason = min((shortfall, why) for shortfall, _, why in outcomes)[1]
            return f"only {placed} of {replicas} replicas fit; {reason}" if placed else reason
        slot = min(fits, key=lambda fit: fit[0])[1]
        tentative.add(slot)
        slots.append(slot)
    return tuple(slots)


def _fit(
    node: resources_pb2.Node, res: jobs_pb2.ResourceRequest, usage: Usage
) -> tuple[_Rank, Slot | None, str]:
    """Places one replica on ``node``.

    Returns:
        (rank, slot, "") when it fits, the lowest rank being the best fit; (shortfall, None,
        reason) when it does not, the lowest shortfall being the node that comes closest.
    """
    acc = res.accelerator
    free = [
        pos
        for pos, device in enumerate(node.devices)
        if _usable(device) and (node.name, pos) not in usage.devices
    ]
    matching = [pos for pos in free if _matches(node.devices[pos], acc)] if acc.count else []
    cpu_free = node.cpu_cores - usage.cpu[node.name]
    memory_free_mib = node.memory_mib - usage.memory_mib[node.name]
    shortfall: _Rank = (
        max(0, acc.count - len(matching)),
        res.cpu - cpu_free if res.cpu > cpu_free + _EPS else 0.0,
        max(0, res.memory_mib - memory_free_mib),
        node.name,
    )
    best = f"best node {node.name} has"
    if shortfall[0]:
        why = f"needs {describe_request(acc)} per replica; {best} {len(matching)} free"
        return shortfall, None, why
    if shortfall[1]:
        return shortfall, None, f"needs {res.cpu:g} CPU per replica; {best} {cpu_free:g} free"
    if shortfall[2]:
        why = f"needs {res.memory_mib} MiB memory per replica; {best} {memory_free_mib} MiB free"
        return shortfall, None, why
    # Fewer free devices first keeps CPU-only work off accelerator nodes.
    rank = (
        len(free) - acc.count,
        cpu_free - res.cpu,
        memory_free_mib - res.memory_mib,
        node.name,
    )
    chosen = _choose_devices(node, matching, acc.count, usage)
    return rank, Slot(node.name, res.cpu, res.memory_mib, chosen), ""


def _choose_devices(
    node: resources_pb2.Node, candidates: list[int], count: int, usage: Usage
) -> tuple[int, ...]:
    """Picks ``count`` devices among ``candidates``.

    A whole interconnect group that can hold them all comes first (one NVLink/HCCS domain per
    replica); then groups that already have allocations, the fullest first; then lowest index.
    """
    if not count:
        return ()
    group = {pos: node.devices[pos].interconnect_group for pos in candidates}
    free_in_group = Counter(group.values())
    in_use = {
        node.devices[pos].interconnect_group for name, pos in usage.devices if name == node.name
    }
    in_use.discard("")

    def preference(pos: int) -> tuple[bool, bool, int, str, int]:
        g = group[pos]
        fits_whole = bool(g) and free_in_group[g] >= count
        return (
            not fits_whole,
            g not in in_use,
            free_in_group[g] if fits_whole else 0,
            g,
            node.devices[pos].index,
        )

    return tuple(sorted(sorted(candidates, key=preference)[:count]))


def device_labels(node: resources_pb2.Node, slot: Slot) -> list[str]:
    """The slot's devices as ``"node:KIND:index"``."""
    return [
        f"{node.name}:{device_kind_name(node.devices[pos].kind)}:{node.devices[pos].index}"
        for pos in slot.device_positions
    ]


def visibility_env(node: resources_pb2.Node, slot: Slot) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` and its kin for the slot's devices.

    A variable is set, possibly empty, for every runtime whose devices the node has, so a
    replica cannot use devices it was not given just by leaving the variable out.
    """
    held = [node.devices[pos] for pos in slot.device_positions]
    env: dict[str, str] = {}
    for (vendor, kind), names in _VISIBILITY_VARS.items():
        if any(d.vendor.lower() == vendor and d.kind == kind for d in node.devices):
            indices = [str(d.index) for d in held if d.vendor.lower() == vendor and d.kind == kind]
            env.update(dict.fromkeys(names, ",".join(indices)))
    return env
