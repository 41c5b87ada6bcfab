"""Capacity taken on a site's nodes: cpu, memory, whole devices, device shares, partition slots.

A device is used in one mode at a time:

* **whole**: one replica takes it and nothing else may use it;
* **fractions**: replicas take shares of a ``shareable`` device, summing to at most 1;
* **partitions**: replicas take slots of the hardware profiles it declares (MIG).

So a device with any share or slot handed out cannot be given whole, a device given whole cannot
be shared or partitioned, and a device with slots in use takes no shares (nor the other way
round) until the last one comes back. Published views say the same thing, so the coordinator
does not offer what the core would decline: such a device shows ``free_fraction`` 0 or its
partitions ``free`` 0.

Partition slots share their device: a slot of a profile the device can be cut into ``total``
of takes ``1/total`` of it, and a profile has as many slots free as still fit in what is left
(``floor(left * total)``). With one profile in use this counts its slots down; with several it
never hands out more than the whole device (a conservative reading of MIG's placement rules).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from fractions import Fraction

from federation.api.v1 import resources_pb2

EPSILON = 1e-9
"""Tolerance of share arithmetic, as the coordinator's CapacityFit counts (0.3 + 0.7 fits)."""

DeviceRef = tuple[str, int]
"""A device: its node's name and its position in ``Node.devices`` (ids may be empty or clash)."""


@dataclass(frozen=True, slots=True)
class Slot:
    """Capacity taken on one node for one replica.

    Devices are named by their position in ``Node.devices``, since ids may be empty or clash.
    """

    node: str
    cpu: float
    memory_mib: int
    device_positions: tuple[int, ...]
    fraction: float = 0.0
    """Share taken of the one device in ``device_positions``; 0 when devices are taken whole."""
    device_memory_mib: int = 0
    """Memory of that device the share takes; 0 when it asks for none."""
    partition: str = ""
    """Profile of the slot taken on the one device in ``device_positions``; "" when none."""
    instance: str = ""
    """The instance of that profile the slot takes (``PartitionProfile.instances``), where the
    device names its instances; "" otherwise."""


def shares_fit(free_fraction: float, fraction: float) -> int:
    """How many shares of ``fraction`` fit in ``free_fraction`` (the coordinator's formula)."""
    return math.floor(free_fraction / fraction + EPSILON)


@dataclass(slots=True)
class Usage:
    """Capacity taken on each node."""

    cpu: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    memory_mib: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    devices: set[DeviceRef] = field(default_factory=set)
    """Devices taken whole."""
    fractions: dict[DeviceRef, float] = field(default_factory=dict)
    """Sum of the shares taken per shared device."""
    device_memory: Counter[DeviceRef] = field(default_factory=Counter)
    """Device memory (MiB) the shares take, per shared device."""
    partitions: dict[DeviceRef, Counter[str]] = field(default_factory=dict)
    """Slots taken per profile, per partitioned device."""
    instances: dict[DeviceRef, set[str]] = field(default_factory=dict)
    """The named instances taken, per partitioned device."""

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
            defaultdict(float, self.cpu),
            defaultdict(int, self.memory_mib),
            set(self.devices),
            dict(self.fractions),
            Counter(self.device_memory),
            {ref: Counter(taken) for ref, taken in self.partitions.items()},
            {ref: set(taken) for ref, taken in self.instances.items()},
        )

    def add(self, slot: Slot) -> None:
        """Counts ``slot`` as taken."""
        self.cpu[slot.node] += slot.cpu
        self.memory_mib[slot.node] += slot.memory_mib
        refs = [(slot.node, pos) for pos in slot.device_positions]
        for ref in refs:
            if slot.fraction:
                self.fractions[ref] = self.fractions.get(ref, 0.0) + slot.fraction
                self.device_memory[ref] += slot.device_memory_mib
            elif slot.partition:
                self.partitions.setdefault(ref, Counter())[slot.partition] += 1
                if slot.instance:
                    self.instances.setdefault(ref, set()).add(slot.instance)
            else:
                self.devices.add(ref)

    def free_instance(self, ref: DeviceRef, profile: resources_pb2.PartitionProfile) -> str:
        """The first of ``profile``'s named instances on the device that no slot takes; ""
        where the device names none (or, past its count, none is left)."""
        taken = self.instances.get(ref, set())
        return next((name for name in profile.instances if name not in taken), "")

    def slots_taken(self, ref: DeviceRef) -> int:
        """Partition slots taken on the device, of any profile."""
        taken = self.partitions.get(ref)
        return taken.total() if taken else 0

    def is_whole_free(self, ref: DeviceRef) -> bool:
        """Whether nothing of the device is taken: no replica has it whole, a share or a slot."""
        return ref not in self.devices and not self.fractions.get(ref) and not self.slots_taken(ref)

    def free_fraction(self, ref: DeviceRef) -> float:
        """Share of the device that fractions may still take: 0 while taken whole or partitioned."""
        if ref in self.devices or self.slots_taken(ref):
            return 0.0
        return max(0.0, 1.0 - self.fractions.get(ref, 0.0))

    def partitions_free(
        self, ref: DeviceRef, profiles: Iterable[resources_pb2.PartitionProfile]
    ) -> dict[str, int]:
        """Free slots per profile of the device: none while it is taken whole or shared."""
        profiles = list(profiles)
        if ref in self.devices or self.fractions.get(ref):
            return {p.profile: 0 for p in profiles}
        total = {p.profile: p.total for p in profiles}
        taken = self.partitions.get(ref, Counter())
        used = sum(
            (Fraction(n, total[name]) for name, n in taken.items() if total.get(name)), Fraction(0)
        )
        left = max(Fraction(0), 1 - used)
        return {p.profile: math.floor(left * p.total) for p in profiles}


def apply_usage(node: resources_pb2.Node, usage: Usage) -> None:
    """Writes what ``usage`` counts into ``node``, as a site view publishes it.

    Sets the node's free cpu and memory and, per device, ``allocated`` (taken whole),
    ``free_fraction``, ``memory_free_mib`` (not booked by shares) and each partition profile's
    ``free``.
    """
    node.cpu_free = max(0.0, node.cpu_cores - usage.cpu[node.name])
    node.memory_free_mib = max(0, node.memory_mib - usage.memory_mib[node.name])
    for pos, device in enumerate(node.devices):
        ref = (node.name, pos)
        device.allocated = ref in usage.devices
        device.free_fraction = usage.free_fraction(ref)
        # What shares may still book (what the device uses now is in ``measured``).
        taken = device.memory_total_mib if device.allocated else usage.device_memory[ref]
        device.memory_free_mib = max(0, device.memory_total_mib - taken)
        free = usage.partitions_free(ref, device.partitions)
        for profile in device.partitions:
            profile.free = free[profile.profile]
