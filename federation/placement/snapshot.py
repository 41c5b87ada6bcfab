"""An immutable, array-shaped picture of every site, put together once per change of the views
from per-site parts that are built again only for the sites whose nodes changed.

Sites, nodes, devices and partition profiles are parallel arrays, so a placement decision looks
at the whole federation in a few vectorised passes. Devices that look alike (kind, vendor,
model, memory, attributes) share a *class*, so per-device predicates such as CEL selectors are
evaluated once per class, not once per device.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from federation.api.v1 import resources_pb2
from federation.placement.compat import node_labels
from federation.placement.devices import device_attributes

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Bool = npt.NDArray[np.bool_]
Obj = npt.NDArray[np.object_]

# Assumed for a pair of sites with no measured or declared link (shown as such in Explain).
UNKNOWN_BANDWIDTH_MBPS = 100.0
UNKNOWN_RTT_MS = 100.0


class Memo(OrderedDict[object, object]):
    """A bounded cache: per-request results (estimates, node room) are large at 10,000 sites,
    so only the most recently used few are kept."""

    def __init__(self, max_entries: int = 256) -> None:
        super().__init__()
        self.max_entries = max_entries

    def __getitem__(self, key: object) -> object:
        value = super().__getitem__(key)
        self.move_to_end(key)
        return value

    def get(self, key: object, default: object = None) -> object:
        if key not in self:
            return default
        return self[key]

    def __setitem__(self, key: object, value: object) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        while len(self) > self.max_entries:
            self.popitem(last=False)


@dataclass(frozen=True, slots=True)
class SiteInput:
    """What placement needs to know about one site besides its view."""

    view: resources_pb2.SiteView
    is_connected: bool
    is_cordoned: bool
    part: SitePart | None = None
    """The site's nodes as arrays, when the caller keeps them (the coordinator's live views
    build one per change); None: built from ``view``'s nodes."""


@dataclass(frozen=True, slots=True)
class DeviceClass:
    """What the devices of one class share; ``attributes`` is what CEL selectors see."""

    kind: int
    vendor: str
    model: str
    memory_mib: float
    attributes: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Sites, nodes and devices as parallel arrays; index i of a site array is site i."""

    site_ids: tuple[str, ...]
    domain: I64
    region: Obj
    is_connected: Bool
    is_cordoned: Bool
    # Nodes, with the index of their site.
    node_site: I64
    node_cpu_free: F64
    node_memory_free_mib: F64
    node_schedulable: Bool
    node_labels: tuple[dict[str, str], ...]
    # Devices, with the index of their node.
    device_node: I64
    device_kind: I64
    device_vendor: Obj
    device_model: Obj
    device_memory_mib: F64
    device_available: Bool
    # Defaults keep hand-built snapshots in tests short; build_snapshot fills them all.
    device_class: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    node_names: tuple[str, ...] = ()
    """Per node, its name (a site's nodes are in name order where views are live)."""
    node_provision_s: F64 = field(default_factory=lambda: np.zeros(0))
    """Per node, how long until its capacity is there (``launch_delay_s``); empty: none."""
    node_price_per_hour: F64 = field(default_factory=lambda: np.zeros(0))
    """Per node of an elastic site, USD per node-hour from its launch; 0 elsewhere."""
    device_shareable: Bool = field(default_factory=lambda: np.zeros(0, bool))
    device_free_fraction: F64 = field(default_factory=lambda: np.zeros(0))
    device_memory_free_mib: F64 = field(default_factory=lambda: np.zeros(0))
    """Memory shares may still book (``Device.memory_free_mib``)."""
    device_group: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    """Interconnect group, unique across the federation; a device with none is its own."""
    device_tflops_fp16: F64 = field(default_factory=lambda: np.zeros(0))
    device_power_watts: F64 = field(default_factory=lambda: np.zeros(0))
    classes: tuple[DeviceClass, ...] = ()
    # Free whole devices per (node, class) pair, grouped by node (so by site): the hot path
    # for whole-device requests reads these instead of every device.
    pair_node: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    pair_class: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    pair_free: F64 = field(default_factory=lambda: np.zeros(0))
    # Partition profiles: one row per (device, profile).
    partition_device: I64 = field(default_factory=lambda: np.zeros(0, np.int64))
    partition_profile: Obj = field(default_factory=lambda: np.zeros(0, object))
    partition_free: F64 = field(default_factory=lambda: np.zeros(0))
    # Per site.
    queue_wait_s: F64 = field(default_factory=lambda: np.zeros(0))
    price_per_device_hour: F64 = field(default_factory=lambda: np.zeros(0))
    datasets: tuple[dict[str, int], ...] = ()
    bandwidth_mbps: F64 = field(default_factory=lambda: np.zeros((0, 0)))
    """(from, to) matrix; pairs with no link hold UNKNOWN_BANDWIDTH_MBPS."""
    rtt_ms: F64 = field(default_factory=lambda: np.zeros((0, 0)))
    link_known: Bool = field(default_factory=lambda: np.zeros((0, 0), bool))
    uplink_mbps: F64 = field(default_factory=lambda: np.zeros(0))
    """Per site, its measured link to the coordinator (``SiteView.coordinator_link``): what
    an image pull from outside is assumed to get; UNKNOWN_BANDWIDTH_MBPS where unmeasured."""
    uplink_rtt_ms: F64 = field(default_factory=lambda: np.zeros(0))
    uplink_known: Bool = field(default_factory=lambda: np.zeros(0, bool))
    images: tuple[dict[str, int], ...] = ()
    """Per site, image reference -> bytes a pull of it moves, for the images its schedulable
    nodes hold (``site_images``)."""
    image_refusal: tuple[str, ...] = ()
    """Per site, why it runs no image ("": it runs them)."""
    image_registries: tuple[tuple[str, ...], ...] = ()
    """Per site, the registries it pulls from (empty: any)."""
    memo: Memo = field(default_factory=Memo, compare=False, repr=False)
    """Per-snapshot cache for plugins (estimates, selector masks): dies with the snapshot."""

    @property
    def n_sites(self) -> int:
        return len(self.site_ids)

    @property
    def n_nodes(self) -> int:
        return len(self.node_site)

    @property
    def device_site(self) -> I64:
        return self.node_site[self.device_node]

    @property
    def pair_site(self) -> I64:
        cached = self.memo.get("pair_site")
        if not isinstance(cached, np.ndarray):
            cached = self.memo["pair_site"] = self.node_site[self.pair_node]
        return cached

    def holders(self, dataset: str) -> list[int]:
        """Indices of the sites that report holding ``dataset``."""
        index = self.memo.get("dataset_holders")
        if not isinstance(index, dict):
            built: dict[str, list[int]] = {}
            for i, held in enumerate(self.datasets):
                for name in held:
                    built.setdefault(name, []).append(i)
            self.memo["dataset_holders"] = index = built
        found: list[int] = index.get(dataset, [])
        return found

    def image_holders(self, image: str) -> list[int]:
        """Indices of the sites where a schedulable node holds ``image`` (by any of its
        references)."""
        index = self.memo.get("image_holders")
        if not isinstance(index, dict):
            built: dict[str, list[int]] = {}
            for i, held in enumerate(self.images):
                for reference in held:
                    built.setdefault(reference, []).append(i)
            self.memo["image_holders"] = index = built
        found: list[int] = index.get(image, [])
        return found

    def device_models(self, kind: int, site: str) -> set[str]:
        """The models of ``site``'s devices of ``kind`` on schedulable nodes."""
        cached = self.memo.get(("device_models", kind))
        if not isinstance(cached, dict):
            built: dict[str, set[str]] = {}
            for device in np.flatnonzero(self.device_kind == kind):
                node = self.device_node[device]
                if self.node_schedulable[node]:
                    name = self.site_ids[self.node_site[node]]
                    built.setdefault(name, set()).add(str(self.device_model[device]))
            self.memo[("device_models", kind)] = cached = built
        models: set[str] = cached.get(site, set())
        return models

    def site_index(self, site: str) -> int | None:
        position = int(np.searchsorted(np.array(self.site_ids, dtype=object), site))
        if position < self.n_sites and self.site_ids[position] == site:
            return position
        return None


# The same rule as the agents' packer: a device with no health report counts as usable.
USABLE_HEALTH = frozenset(
    {resources_pb2.DEVICE_HEALTH_HEALTHY, resources_pb2.DEVICE_HEALTH_UNSPECIFIED}
)


def _capacity(value: float) -> float:
    """A reported free amount as placement may use it: NaN, infinite or negative count as 0."""
    return value if math.isfinite(value) and value > 0 else 0.0


def _in_shared_use(dev: resources_pb2.Device) -> bool:
    """Whether shares or partition slots of the device are handed out: then it cannot be
    given whole (the agents' rule: one mode per device at a time)."""
    shares_out = dev.shareable and dev.free_fraction < 1.0 - 1e-9
    slots_out = any(p.free < p.total for p in dev.partitions)
    return shares_out or slots_out


def _class_key(dev: resources_pb2.Device) -> tuple[object, ...]:
    return (
        dev.kind,
        dev.vendor.lower(),
        dev.model,
        dev.memory_total_mib,
        dev.tflops_fp32,
        dev.tflops_fp16,
        dev.tflops_int8,
        dev.power_tdp_watts,
        dev.provenance,
        tuple(sorted(dev.attributes.items())),
    )


def _device_class(dev: resources_pb2.Device) -> DeviceClass:
    memory_mib = float(dev.memory_total_mib)
    return DeviceClass(dev.kind, dev.vendor.lower(), dev.model, memory_mib, device_attributes(dev))


@dataclass(frozen=True, slots=True)
class SitePart:
    """One site's nodes, devices, free (node, class) pairs and partition profiles as arrays
    indexed within the site: the part of a snapshot that costs (a Python pass over every
    device), built once per change of the site's view and shared by every snapshot until then.
    Classes are local too: ``device_class`` and ``pair_class`` index ``class_keys``."""

    node_cpu_free: F64
    node_memory_free_mib: F64
    node_schedulable: Bool
    node_labels: tuple[dict[str, str], ...]
    node_names: tuple[str, ...]
    node_provision_s: F64
    node_price_per_hour: F64
    device_node: I64
    device_kind: I64
    device_vendor: Obj
    device_model: Obj
    device_memory_mib: F64
    device_available: Bool
    device_class: I64
    device_shareable: Bool
    device_free_fraction: F64
    device_memory_free_mib: F64
    device_group: I64
    n_groups: int
    device_tflops_fp16: F64
    device_power_watts: F64
    class_keys: tuple[tuple[object, ...], ...]
    classes: tuple[DeviceClass, ...]
    pair_node: I64
    pair_class: I64
    pair_free: F64
    partition_device: I64
    partition_profile: Obj
    partition_free: F64
    images: dict[str, int] = field(default_factory=dict)
    """The images the schedulable nodes hold (``site_images``)."""


def site_images(nodes: Iterable[resources_pb2.Node]) -> dict[str, int]:
    """Image reference -> bytes a pull of it moves, for the images schedulable ``nodes``
    hold: its manifest's (``pull_bytes``), else its unpacked size, which is more (a node that
    loaded it, not pulled it, knows no manifest); the largest where nodes differ."""
    held: dict[str, int] = {}
    for node in nodes:
        if not node.schedulable:
            continue
        for image in node.images:
            size = image.pull_bytes or image.size_bytes
            for reference in image.references:
                held[reference] = max(held.get(reference, 0), size)
    return held


def launch_delay_s(node: resources_pb2.Node) -> float:
    """How long until the node's capacity is there: its p50 launch delay while it could be
    launched or is launching, else 0."""
    waiting = (resources_pb2.NodeLaunch.STATE_LAUNCHABLE, resources_pb2.NodeLaunch.STATE_LAUNCHING)
    if node.HasField("launch") and node.launch.state in waiting:
        return _capacity(node.launch.delay_p50_s)
    return 0.0


def launch_price_per_hour(node: resources_pb2.Node) -> float:
    """What a launched node of the site is charged an hour: its spot price when it is launched
    as spot capacity, else its on-demand price."""
    launch = node.launch
    return launch.spot_price_per_hour if launch.spot else launch.price_per_hour


def site_part(nodes: Iterable[resources_pb2.Node]) -> SitePart:
    """The arrays of one site's nodes (see ``SitePart``)."""
    cpu_free: list[float] = []
    mem_free: list[float] = []
    schedulable: list[bool] = []
    labels: list[dict[str, str]] = []
    names: list[str] = []
    provision: list[float] = []
    price: list[float] = []
    dev: dict[str, list[Any]] = {
        k: []
        for k in (
            "node",
            "kind",
            "vendor",
            "model",
            "memory",
            "available",
            "class",
            "shareable",
            "fraction",
            "memory_free",
            "group",
            "tflops",
            "power",
        )
    }
    part_device: list[int] = []
    part_profile: list[str] = []
    part_free: list[float] = []
    class_ids: dict[tuple[object, ...], int] = {}
    classes: list[DeviceClass] = []
    groups: dict[tuple[int, str], int] = {}
    pair_node: list[int] = []
    pair_class: list[int] = []
    pair_free: list[float] = []
    nodes = list(nodes)
    for node in nodes:
        node_index = len(cpu_free)
        free_by_class: dict[int, int] = {}
        cpu_free.append(_capacity(node.cpu_free))
        mem_free.append(_capacity(float(node.memory_free_mib)))
        schedulable.append(node.schedulable)
        labels.append(node_labels(node))
        names.append(node.name)
        provision.append(launch_delay_s(node))
        price.append(_capacity(launch_price_per_hour(node)) if node.HasField("launch") else 0.0)
        for d in node.devices:
            device_index = len(dev["node"])
            key = _class_key(d)
            if key not in class_ids:
                class_ids[key] = len(classes)
                classes.append(_device_class(d))
            group_key = (node_index, d.interconnect_group or f"#{device_index}")
            healthy = d.health in USABLE_HEALTH
            whole_free = not d.allocated and healthy and not _in_shared_use(d)
            dev["node"].append(node_index)
            dev["kind"].append(d.kind)
            dev["vendor"].append(d.vendor.lower())
            dev["model"].append(d.model)
            dev["memory"].append(float(d.memory_total_mib))
            dev["available"].append(whole_free)
            dev["class"].append(class_ids[key])
            free_by_class[class_ids[key]] = free_by_class.get(class_ids[key], 0) + int(whole_free)
            dev["shareable"].append(d.shareable and healthy and not d.allocated)
            dev["fraction"].append(min(1.0, _capacity(d.free_fraction)))
            dev["memory_free"].append(_capacity(float(d.memory_free_mib)))
            dev["group"].append(groups.setdefault(group_key, len(groups)))
            dev["tflops"].append(_capacity(d.tflops_fp16))
            dev["power"].append(_capacity(d.power_tdp_watts or d.power_watts))
            for part in d.partitions:
                if healthy and not d.allocated:
                    part_device.append(device_index)
                    part_profile.append(part.profile)
                    part_free.append(float(part.free))
        for class_id, free in sorted(free_by_class.items()):
            pair_node.append(node_index)
            pair_class.append(class_id)
            pair_free.append(float(free))
    return SitePart(
        node_cpu_free=np.array(cpu_free, dtype=np.float64),
        node_memory_free_mib=np.array(mem_free, dtype=np.float64),
        node_schedulable=np.array(schedulable, dtype=bool),
        node_labels=tuple(labels),
        node_names=tuple(names),
        node_provision_s=np.array(provision, dtype=np.float64),
        node_price_per_hour=np.array(price, dtype=np.float64),
        device_node=np.array(dev["node"], dtype=np.int64),
        device_kind=np.array(dev["kind"], dtype=np.int64),
        device_vendor=np.array(dev["vendor"], dtype=object),
        device_model=np.array(dev["model"], dtype=object),
        device_memory_mib=np.array(dev["memory"], dtype=np.float64),
        device_available=np.array(dev["available"], dtype=bool),
        device_class=np.array(dev["class"], dtype=np.int64),
        device_shareable=np.array(dev["shareable"], dtype=bool),
        device_free_fraction=np.array(dev["fraction"], dtype=np.float64),
        device_memory_free_mib=np.array(dev["memory_free"], dtype=np.float64),
        device_group=np.array(dev["group"], dtype=np.int64),
        n_groups=len(groups),
        device_tflops_fp16=np.array(dev["tflops"], dtype=np.float64),
        device_power_watts=np.array(dev["power"], dtype=np.float64),
        class_keys=tuple(class_ids),
        classes=tuple(classes),
        pair_node=np.array(pair_node, dtype=np.int64),
        pair_class=np.array(pair_class, dtype=np.int64),
        pair_free=np.array(pair_free, dtype=np.float64),
        partition_device=np.array(part_device, dtype=np.int64),
        partition_profile=np.array(part_profile, dtype=object),
        partition_free=np.array(part_free, dtype=np.float64),
        images=site_images(nodes),
    )


def _joined(arrays: list[npt.NDArray[Any]], dtype: type) -> npt.NDArray[Any]:
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)


def build_snapshot(
    sites: Sequence[SiteInput], measured: Mapping[tuple[str, str], float] | None = None
) -> Snapshot:
    """Flatten site views into arrays, sites sorted by name so order never matters.

    Each site's nodes and devices come from its ``SitePart`` (given, or built from its view),
    placed after the previous sites' with their node, device and group numbers shifted and
    their classes numbered federation-wide in order of first appearance. ``measured``: Mbit/s
    per (holder, receiver) that real transfers gave, over any probe's figure for that way.
    """
    ordered = sorted(sites, key=lambda s: s.view.site)
    index = {s.view.site: i for i, s in enumerate(ordered)}
    parts = [s.part if s.part is not None else site_part(s.view.nodes) for s in ordered]
    class_ids: dict[tuple[object, ...], int] = {}
    classes: list[DeviceClass] = []
    remaps = []
    for part in parts:
        for key, device_class in zip(part.class_keys, part.classes, strict=True):
            if key not in class_ids:
                class_ids[key] = len(classes)
                classes.append(device_class)
        remaps.append(np.array([class_ids[key] for key in part.class_keys], dtype=np.int64))
    nodes = np.cumsum([0] + [len(p.node_cpu_free) for p in parts])
    devices = np.cumsum([0] + [len(p.device_node) for p in parts])
    groups = np.cumsum([0] + [p.n_groups for p in parts])

    def joined(name: str, dtype: type, shift: npt.NDArray[Any] | None = None) -> Any:
        arrays = [getattr(p, name) for p in parts]
        if shift is not None:
            arrays = [a + shift[i] for i, a in enumerate(arrays)]
        return _joined(arrays, dtype)

    def classes_of(name: str) -> I64:
        return _joined([remaps[i][getattr(p, name)] for i, p in enumerate(parts)], np.int64)

    n = len(ordered)
    bandwidth = np.full((n, n), UNKNOWN_BANDWIDTH_MBPS)
    rtt = np.full((n, n), UNKNOWN_RTT_MS)
    known = np.zeros((n, n), dtype=bool)
    for i, site in enumerate(ordered):
        for link in site.view.links:
            j = index.get(link.peer_site)
            bw = _capacity(link.bandwidth_mbps)
            if j is None or j == i or bw <= 0:
                continue
            bandwidth[i, j] = bw
            rtt[i, j] = _capacity(link.rtt_ms)
            known[i, j] = True
    for (source, receiver), mbps in (measured or {}).items():
        holder, to = index.get(source), index.get(receiver)
        if holder is None or to is None or holder == to or mbps <= 0:
            continue
        bandwidth[holder, to] = mbps
        if not known[holder, to]:
            rtt[holder, to] = rtt[to, holder] if known[to, holder] else 0.0
        known[holder, to] = True
    # A link measured one way stands for the other way until that is measured too.
    fill = ~known & known.T
    bandwidth[fill] = bandwidth.T[fill]
    rtt[fill] = rtt.T[fill]
    known |= fill
    uplinks = [s.view.coordinator_link for s in ordered]
    uplink_bw = np.array([_capacity(link.bandwidth_mbps) for link in uplinks])
    uplink_known = uplink_bw > 0
    np.fill_diagonal(bandwidth, np.inf)
    np.fill_diagonal(rtt, 0.0)
    np.fill_diagonal(known, True)
    return Snapshot(
        site_ids=tuple(s.view.site for s in ordered),
        domain=np.array([s.view.domain for s in ordered], dtype=np.int64),
        region=np.array([s.view.region for s in ordered], dtype=object),
        is_connected=np.array([s.is_connected for s in ordered], dtype=bool),
        is_cordoned=np.array([s.is_cordoned for s in ordered], dtype=bool),
        node_site=np.repeat(np.arange(len(parts), dtype=np.int64), np.diff(nodes)),
        node_cpu_free=joined("node_cpu_free", np.float64),
        node_memory_free_mib=joined("node_memory_free_mib", np.float64),
        node_schedulable=joined("node_schedulable", bool),
        node_labels=tuple(labels for p in parts for labels in p.node_labels),
        node_names=tuple(name for p in parts for name in p.node_names),
        node_provision_s=joined("node_provision_s", np.float64),
        node_price_per_hour=joined("node_price_per_hour", np.float64),
        device_node=joined("device_node", np.int64, nodes),
        device_kind=joined("device_kind", np.int64),
        device_vendor=joined("device_vendor", object),
        device_model=joined("device_model", object),
        device_memory_mib=joined("device_memory_mib", np.float64),
        device_available=joined("device_available", bool),
        device_class=classes_of("device_class"),
        device_shareable=joined("device_shareable", bool),
        device_free_fraction=joined("device_free_fraction", np.float64),
        device_memory_free_mib=joined("device_memory_free_mib", np.float64),
        device_group=joined("device_group", np.int64, groups),
        device_tflops_fp16=joined("device_tflops_fp16", np.float64),
        device_power_watts=joined("device_power_watts", np.float64),
        classes=tuple(classes),
        pair_node=joined("pair_node", np.int64, nodes),
        pair_class=classes_of("pair_class"),
        pair_free=joined("pair_free", np.float64),
        partition_device=joined("partition_device", np.int64, devices),
        partition_profile=joined("partition_profile", object),
        partition_free=joined("partition_free", np.float64),
        queue_wait_s=np.array([_capacity(s.view.queue.estimated_wait_s) for s in ordered]),
        price_per_device_hour=np.array([_capacity(s.view.price_per_device_hour) for s in ordered]),
        datasets=tuple(dict(s.view.datasets) for s in ordered),
        bandwidth_mbps=bandwidth,
        rtt_ms=rtt,
        link_known=known,
        uplink_mbps=np.where(uplink_known, uplink_bw, UNKNOWN_BANDWIDTH_MBPS),
        uplink_rtt_ms=np.where(
            uplink_known, [_capacity(u.rtt_ms) for u in uplinks], UNKNOWN_RTT_MS
        ).astype(np.float64),
        uplink_known=uplink_known,
        images=tuple(p.images for p in parts),
        image_refusal=tuple(s.view.image_refusal for s in ordered),
        image_registries=tuple(tuple(s.view.image_registries) for s in ordered),
    )
