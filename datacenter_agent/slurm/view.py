"""Slurm's own picture of a partition, turned into the federation's nodes and queue state.

Nodes, CPUs, memory and GRES devices come from ``scontrol show node -d -o``; what Slurm has
allocated (``CPUAlloc``, ``AllocMem``, ``GresUsed`` with device indices) becomes a ``Usage``
the core adds its own held reservations to. Drained, down or otherwise unusable nodes are left
out of the view: the federation should not count on them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from datacenter_agent.slurm.cli import (
    Record,
    parse_duration_s,
    parse_index_list,
    parse_time,
    split_outside,
)
from federation.agent.config import GresModel
from federation.agent.packing import Usage
from federation.api.v1 import resources_pb2

GRES_KINDS: dict[str, resources_pb2.DeviceKind.ValueType] = {
    "gpu": resources_pb2.DEVICE_KIND_GPU,
    "npu": resources_pb2.DEVICE_KIND_NPU,
    "mlu": resources_pb2.DEVICE_KIND_MLU,
    "fpga": resources_pb2.DEVICE_KIND_FPGA,
    "dpu": resources_pb2.DEVICE_KIND_DPU,
}
"""GRES names that are accelerators, and their kind; other GRES (shard, mps, nic) are not."""

UNUSABLE_NODE_STATES = frozenset(
    {
        "DOWN",
        "DRAIN",
        "DRAINED",
        "DRAINING",
        "FAIL",
        "FAILING",
        "FUTURE",
        "UNKNOWN",
        "NOT_RESPONDING",
        "NO_RESPOND",
        "MAINTENANCE",
        "MAINT",
        "RESERVED",
        "REBOOT_ISSUED",
        "REBOOT_REQUESTED",
        "INVALID",
        "INVALID_REG",
        "POWERED_DOWN",
        "POWERING_DOWN",
        "POWER_DOWN",
        "POWERING_UP",
    }
)
"""Node state words (base state or ``+FLAG``) that keep a node out of the view."""


@dataclass(frozen=True, slots=True)
class GresEntry:
    """One item of a node's ``Gres`` or ``GresUsed``: ``gpu:a100:2(IDX:0-1)``."""

    name: str
    type: str
    count: int
    indices: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Partition:
    """What the core needs to know about its partition."""

    name: str
    state: str
    max_time_s: float | None
    """``MaxTime`` in seconds; ``math.inf`` when unlimited, None when unset."""

    @property
    def is_up(self) -> bool:
        """Whether the partition starts jobs."""
        return self.state == "UP"


@dataclass(slots=True)
class ClusterView:
    """The usable nodes of the partition (whole capacity) and what Slurm holds on them."""

    nodes: list[resources_pb2.Node] = field(default_factory=list)
    usage: Usage = field(default_factory=Usage)
    hidden: dict[str, str] = field(default_factory=dict)
    """Nodes of the partition left out, with why (their Slurm state and reason)."""


def parse_gres(text: str) -> list[GresEntry]:
    """Reads ``Gres=`` or ``GresUsed=``: ``gpu:a100:2(S:0-1),gpu:1(IDX:3)``.

    Unreadable items and placeholders (``(null)``) are skipped.
    """
    entries = []
    for item in split_outside(text, "()"):
        spec, _, detail = item.partition("(")
        parts = spec.split(":")
        if len(parts) < 2 or not parts[-1].isdigit():
            continue
        name, count = parts[0], int(parts[-1])
        gres_type = parts[1] if len(parts) > 2 else ""
        indices: tuple[int, ...] = ()
        if detail.startswith("IDX:"):
            indices = tuple(parse_index_list(detail.removeprefix("IDX:").rstrip(")")))
        entries.append(GresEntry(name, gres_type, count, indices))
    return entries


def state_words(state: str) -> list[str]:
    """``"IDLE+DRAIN"`` → ``["IDLE", "DRAIN"]``; sinfo's suffixes such as ``*`` are dropped."""
    return [word.rstrip("*~#!%$@^-") for word in state.upper().split("+") if word]


def is_usable(state: str) -> bool:
    """Whether a node in ``state`` may take new work."""
    return not any(word in UNUSABLE_NODE_STATES for word in state_words(state))


def gres_model(models: dict[str, GresModel], name: str, gres_type: str) -> GresModel:
    """The configured description of ``name:type``, else a default one."""
    found = models.get(f"{name}:{gres_type}") or (models.get(gres_type) if name == "gpu" else None)
    if found is not None:
        return GresModel(
            model=found.model or gres_type or name,
            vendor=found.vendor or ("nvidia" if name == "gpu" else ""),
            memory_mib=found.memory_mib,
            attributes=found.attributes,
        )
    return GresModel(model=gres_type or name, vendor="nvidia" if name == "gpu" else "")


def parse_partition(record: Record) -> Partition:
    """The partition a ``scontrol show partition -o`` line describes."""
    return Partition(
        name=record.value("PartitionName"),
        state=record.value("State").upper(),
        max_time_s=parse_duration_s(record.get("MaxTime")),
    )


def cluster_view(
    records: list[Record], partition: str, models: dict[str, GresModel]
) -> ClusterView:
    """The usable nodes of ``partition`` with their devices, and Slurm's allocations on them.

    Args:
        records: ``scontrol show node -d -o`` lines.
        partition: Only nodes in this partition are described.
        models: GRES type → device description (config ``[slurm.gres]``).
    """
    view = ClusterView()
    for record in records:
        name = record.value("NodeName")
        if not name or partition not in record.value("Partitions").split(","):
            continue
        state = record.value("State")
        if not is_usable(state):
            reason = record.value("Reason")
            view.hidden[name] = f"{state}: {reason}" if reason else state
            continue
        node, used = _node(record, models)
        view.nodes.append(node)
        view.usage.cpu[name] += _number(record.value("CPUAlloc"))
        view.usage.memory_mib[name] += int(_number(record.value("AllocMem")))
        view.usage.devices.update((name, pos) for pos in used)
    return view


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def _node(record: Record, models: dict[str, GresModel]) -> tuple[resources_pb2.Node, list[int]]:
    """One node with its devices, and the positions of the devices Slurm has allocated."""
    name = record.value("NodeName")
    cpus = _number(record.value("CPUEfctv")) or _number(record.value("CPUTot"))
    memory_mib = int(_number(record.value("RealMemory")))
    labels = {"slurm_partitions": record.value("Partitions")}
    if features := record.value("AvailableFeatures"):
        labels["slurm_features"] = features
    node = resources_pb2.Node(
        name=name,
        arch=record.value("Arch"),
        cpu_cores=cpus,
        cpu_free=cpus,
        memory_mib=memory_mib,
        memory_free_mib=memory_mib,
        labels=labels,
        schedulable=True,
        provenance=resources_pb2.PROVENANCE_DISCOVERED,
    )
    used = {
        (entry.name, index)
        for entry in parse_gres(record.value("GresUsed"))
        for index in entry.indices
    }
    next_index: dict[str, int] = {}
    positions: list[int] = []
    for entry in parse_gres(record.value("Gres")):
        kind = GRES_KINDS.get(entry.name)
        if kind is None:
            continue
        described = gres_model(models, entry.name, entry.type)
        for _ in range(entry.count):
            index = next_index.get(entry.name, 0)
            next_index[entry.name] = index + 1
            if (entry.name, index) in used:
                positions.append(len(node.devices))
            node.devices.append(
                resources_pb2.Device(
                    id=f"{entry.name}{index}",
                    index=index,
                    kind=kind,
                    vendor=described.vendor,
                    model=described.model,
                    memory_total_mib=described.memory_mib,
                    memory_free_mib=described.memory_mib,
                    health=resources_pb2.DEVICE_HEALTH_HEALTHY,
                    provenance=resources_pb2.PROVENANCE_DISCOVERED,
                    attributes={
                        **described.attributes,
                        "slurm_gres": f"{entry.name}:{entry.type}" if entry.type else entry.name,
                    },
                )
            )
    for key, value in _shared_attributes(node.devices).items():
        node.labels.setdefault(key, value)
    return node, positions


def _shared_attributes(devices: Sequence[resources_pb2.Device]) -> dict[str, str]:
    """The attributes every device of a node declares alike (``cuda: "12.4"`` on each GRES
    type): the node's labels too, which requirements read (``requires: {cuda: ">=12.1"}``),
    as discovery labels an embedded site's nodes."""
    if not devices:
        return {}
    shared = dict(devices[0].attributes)
    for device in devices[1:]:
        shared = {k: v for k, v in shared.items() if device.attributes.get(k) == v}
    shared.pop("slurm_gres", None)
    return shared


def queue_state(
    jobs: list[Record], partition: str, start_lines: str, now: float
) -> resources_pb2.QueueState:
    """Pending and running jobs of the partition (every user's) and the expected wait.

    Args:
        jobs: ``scontrol show job -o`` lines.
        partition: The partition to count.
        start_lines: ``squeue --start -o '%i|%S'`` output for the partition's pending jobs.
        now: The current Unix time.

    Returns:
        The queue, its estimated wait being the latest expected start of a pending job.
    """
    pending = running = 0
    for job in jobs:
        if partition not in job.value("Partition").split(","):
            continue
        state = job.value("JobState")
        pending += state == "PENDING"
        running += state in ("RUNNING", "COMPLETING", "SUSPENDED")
    starts = []
    for line in start_lines.splitlines():
        _, _, start = line.partition("|")
        if (when := parse_time(start.strip())) is not None:
            starts.append(max(0.0, when - now))
    return resources_pb2.QueueState(
        pending_tasks=pending, running_tasks=running, estimated_wait_s=max(starts, default=0.0)
    )
