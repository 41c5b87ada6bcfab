"""Topology files: the simulated sites, their nodes and devices, and the links between them.

The format (YAML) is described in docs/simulator.md. Device models the simulator
knows (``KNOWN_MODELS``) need only a model name and a count; any other model states its kind,
vendor, memory, fp16 TFLOPS and power.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt
import yaml

from federation.api.v1 import queues_pb2, resources_pb2
from federation.common.node_types import (
    DEFAULT_DELAY_S,
    IDLE_RELEASE_S,
    MAX_LAUNCHABLE,
    NodeType,
)
from federation.coordinator.policy.priority import PriorityClass
from federation.jobspec import parse_domain
from federation.sim.fields import Fields, InputFileError, read_text
from federation.sim.links import (
    DeclaredLink,
    Link,
    LinkPlan,
    link_matrix,
    load_rtt_csv,
    load_throughput_csv,
)
from federation.sim.queue_config import parse_classes, parse_queues

F64 = npt.NDArray[np.float64]
KIND_NAMES = frozenset(resources_pb2.DeviceKind.keys())
MIN_SPEED_FACTOR = 0.001
"""The slowest a ``speed_factor`` may make a device (a factor of 0 would never finish)."""


@dataclass(frozen=True, slots=True)
class ModelDefaults:
    """What a device model is, when a topology names only the model."""

    kind: str
    vendor: str
    memory_mib: int
    tflops_fp16: float
    power_watts: float


# Public spec-sheet figures (dense fp16 tensor TFLOPS, board power). The speed table
# (federation/placement/data/speed.yaml) decides run times; TFLOPS only stand in for models
# missing there. K80 stands for the PAI fleet's "MISC" machines (K40m/K80/M60); it has no fp16
# units, and its 22 is the figure that puts its speed, by the table's fallback (TFLOPS / 312),
# at about half a P100's, as their fp32 figures (4.4 against 9.3 per GPU) have it.
KNOWN_MODELS: Mapping[str, ModelDefaults] = {
    "H200-141GB": ModelDefaults("GPU", "nvidia", 144384, 989.0, 700.0),
    "H100-80GB": ModelDefaults("GPU", "nvidia", 81920, 989.0, 700.0),
    "A100-80GB": ModelDefaults("GPU", "nvidia", 81920, 312.0, 400.0),
    "A100-40GB": ModelDefaults("GPU", "nvidia", 40960, 312.0, 400.0),
    "L40S": ModelDefaults("GPU", "nvidia", 49152, 362.0, 350.0),
    "V100-32GB": ModelDefaults("GPU", "nvidia", 32768, 125.0, 300.0),
    "V100": ModelDefaults("GPU", "nvidia", 16384, 125.0, 300.0),
    "P100": ModelDefaults("GPU", "nvidia", 16384, 18.7, 250.0),
    "T4": ModelDefaults("GPU", "nvidia", 16384, 65.0, 70.0),
    "K80": ModelDefaults("GPU", "nvidia", 12288, 22.0, 150.0),
    "Ascend-910B": ModelDefaults("NPU", "huawei", 65536, 320.0, 310.0),
    "Ascend-310P": ModelDefaults("NPU", "huawei", 24576, 70.0, 72.0),
    "MLU370-X8": ModelDefaults("MLU", "cambricon", 49152, 96.0, 250.0),
}


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """``count`` identical devices on one node."""

    kind: resources_pb2.DeviceKind.ValueType
    vendor: str
    model: str
    memory_mib: int
    tflops_fp16: float
    power_watts: float
    count: int
    shareable: bool = False


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """``count`` identical nodes."""

    cpu: float
    memory_mib: int
    devices: tuple[DeviceSpec, ...]
    count: int = 1
    labels: Mapping[str, str] | None = None
    """Node labels, as a site's nodes carry them; those naming a topology level (``rack``,
    ``block``) let the replay count the gangs that straddled a level."""

    def node(self, name: str) -> resources_pb2.Node:
        """One of these nodes as its site publishes it, idle."""
        node = resources_pb2.Node(
            name=name,
            cpu_cores=self.cpu,
            cpu_free=self.cpu,
            memory_mib=self.memory_mib,
            memory_free_mib=self.memory_mib,
            schedulable=True,
        )
        node.labels.update(self.labels or {})
        for device in self.devices:
            for _ in range(device.count):
                node.devices.add(
                    index=len(node.devices),
                    kind=device.kind,
                    vendor=device.vendor,
                    model=device.model,
                    memory_total_mib=device.memory_mib,
                    tflops_fp16=device.tflops_fp16,
                    power_tdp_watts=device.power_watts,
                    health=resources_pb2.DEVICE_HEALTH_HEALTHY,
                    shareable=device.shareable,
                    free_fraction=1.0,
                )
        return node


@dataclass(frozen=True, slots=True)
class SiteSpec:
    """One simulated site."""

    name: str
    domain: resources_pb2.Domain.ValueType
    region: str
    nodes: tuple[NodeSpec, ...]
    price_per_device_hour: float = 0.0
    egress_usd_per_gb: float = 0.0
    """Charged per GB that leaves this site (cloud egress)."""
    decline_rate: float = 0.0
    """Share of offers the site declines although it has room (busy with local work); 1 means
    it takes nothing (a site being drained)."""
    datasets: Mapping[str, int] | None = None
    speed_factor: float = 1.0
    """How fast its devices really run against their model's speed (the speed table's times
    the topology's ``speed_factors``): slower hardware or software at this site."""
    node_types: tuple[NodeType, ...] = ()
    """Nodes it launches when a task needs them (an elastic cloud site), as an agent's
    inventory declares them; they are not among ``nodes``."""
    idle_release_s: float = IDLE_RELEASE_S
    """A launched node that holds no task this long is released."""
    warm_min: int = 0
    """At least this many launched nodes stay running, busy or idle."""
    spot_reclaim_after_s: float = 0.0
    """The cloud takes each node of a ``spot`` type back this long after it runs (0: never),
    as the agent's simulated provider does."""
    spot_mean_lifetime_s: float = 0.0
    """Else, each such node's life after it runs is drawn from an exponential distribution
    of this mean (0: never taken back)."""

    @property
    def n_nodes(self) -> int:
        """Nodes at the site (running all the time: launchable ones are not counted)."""
        return sum(n.count for n in self.nodes)

    @property
    def n_launchable(self) -> int:
        """Nodes the site may launch, of all its node types."""
        return sum(t.max for t in self.node_types)

    @property
    def n_devices(self) -> int:
        """Accelerators at the site."""
        return sum(n.count * d.count for n in self.nodes for d in n.devices)


@dataclass(frozen=True, slots=True)
class Topology:
    """Sites sorted by name (the order placement uses) and the site x site link matrix."""

    sites: tuple[SiteSpec, ...]
    bandwidth_mbps: F64
    """(from, to) in Mbit/s; infinite on the diagonal."""
    rtt_ms: F64
    link_known: npt.NDArray[np.bool_]
    source: str = "<topology>"
    speed_factors: Mapping[str, float] = field(default_factory=dict)
    """Model -> how fast it really runs against the speed table (default 1): the true speeds
    the replay runs at, which the scheduler does not know (``--learn`` lets it learn them)."""
    queues: Mapping[str, queues_pb2.Queue] = field(default_factory=dict)
    """Queues by name, as ``fedctl queues create`` makes them (none: no quotas, no fair share)."""
    priority_classes: Mapping[str, PriorityClass] = field(default_factory=dict)
    """Priority classes by name, as the coordinator's config gives them."""

    @property
    def n_nodes(self) -> int:
        """Nodes in the federation."""
        return sum(s.n_nodes for s in self.sites)

    @property
    def n_devices(self) -> int:
        """Accelerators in the federation."""
        return sum(s.n_devices for s in self.sites)

    @property
    def n_launchable(self) -> int:
        """Nodes the sites may launch."""
        return sum(s.n_launchable for s in self.sites)

    @property
    def models(self) -> set[str]:
        """The device models of every node and node type."""
        declared = {d.model for s in self.sites for n in s.nodes for d in n.devices}
        return declared | {
            d.model for s in self.sites for t in s.node_types for d in t.template.devices
        }

    @property
    def levels(self) -> tuple[str, ...]:
        """The label keys any node declares (topology levels such as ``rack``), sorted."""
        return tuple(sorted({k for s in self.sites for n in s.nodes for k in (n.labels or {})}))

    def holders(self, dataset: str) -> list[str]:
        """Sites that hold ``dataset``."""
        return [s.name for s in self.sites if s.datasets and dataset in s.datasets]

    def true_speed_factor(self, site: int, model: str) -> float:
        """How fast ``model`` really runs at site number ``site`` against the speed table."""
        return self.sites[site].speed_factor * self.speed_factors.get(model, 1.0)


def load_topology(path: Path) -> Topology:
    """Read and check a topology file; relative data paths are relative to its folder."""
    text = read_text(path)
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise InputFileError(f"{path}: not valid YAML: {err}") from None
    return parse_topology(doc, str(path), path.parent)


def parse_topology(doc: object, source: str, base: Path) -> Topology:
    """A topology from a parsed document; ``base`` resolves relative data paths."""
    top = Fields(source, "", doc)
    sites = [_site(f) for f in top.items("sites", required=True)]
    names = [s.name for s in sites]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise top.fail("sites", f"duplicate site name(s) {', '.join(duplicates)}")
    links = top.child("links")
    plan = _links(links, base, set(names)) if links else LinkPlan()
    factors = _speed_factors(top, sites)
    queues, classes = parse_queues(top), parse_classes(top)
    top.done()
    ordered = tuple(sorted(sites, key=lambda s: s.name))
    bandwidth, rtt, known = link_matrix(
        [s.name for s in ordered],
        [s.region for s in ordered],
        [s.domain == resources_pb2.DOMAIN_EDGE for s in ordered],
        plan,
    )
    return Topology(ordered, bandwidth, rtt, known, source, factors, queues, classes)


def _speed_factors(top: Fields, sites: list[SiteSpec]) -> dict[str, float]:
    """The top level's ``speed_factors``: model -> factor, each model one the sites have."""
    given = top.child("speed_factors")
    if given is None:
        return {}
    models = {d.model for s in sites for n in s.nodes for d in n.devices}
    models |= {d.model for s in sites for t in s.node_types for d in t.template.devices}
    factors = {}
    for model in given.names():
        if model not in models:
            raise given.fail(model, "no site has this model")
        factors[model] = given.number(model, minimum=MIN_SPEED_FACTOR)
    given.done()
    return factors


def _site(f: Fields) -> SiteSpec:
    name = f.string("name")
    try:
        domain = parse_domain(f.string("domain", "datacenter"))
    except ValueError as err:
        raise f.fail("domain", str(err)) from None
    power = f.number("device_power_watts", 0.0)
    datasets: dict[str, int] = {}
    held = f.child("datasets")
    if held is not None:
        for dataset in held.names():
            datasets[dataset] = held.integer(dataset, minimum=0)
        held.done()
    node_types = tuple(_node_types(f, power))
    nodes = tuple(_node(n, power) for n in f.items("nodes", required=not node_types))
    idle_release_s, warm_min = _release(f, node_types)
    reclaim_after_s, mean_lifetime_s = _reclaims(f, node_types)
    site = SiteSpec(
        name=name,
        domain=domain,
        region=f.string("region", "default"),
        nodes=nodes,
        price_per_device_hour=f.number("price_per_device_hour", 0.0),
        egress_usd_per_gb=f.number("egress_usd_per_gb", 0.0),
        decline_rate=f.number("decline_rate", 0.0, maximum=1.0),
        datasets=datasets,
        speed_factor=f.number("speed_factor", 1.0, minimum=MIN_SPEED_FACTOR),
        node_types=node_types,
        idle_release_s=idle_release_s,
        warm_min=warm_min,
        spot_reclaim_after_s=reclaim_after_s,
        spot_mean_lifetime_s=mean_lifetime_s,
    )
    f.done()
    return site


def _node_types(f: Fields, site_power: float) -> list[NodeType]:
    """A site's ``node_types``: the fields of an agent inventory's node types (``name``,
    ``max``, ``price_per_hour``, ``spot_price_per_hour``, ``delay_s``, ``spot``, with its
    defaults and bounds) and the node's hardware as the topology's nodes give it (no ``count``)."""
    types: list[NodeType] = []
    for t in f.items("node_types"):
        name = t.string("name")
        if any(other.name == name for other in types):
            raise t.fail("name", f"duplicate node type {name!r}")
        if "/" in name:
            raise t.fail("name", f"{name!r}: a node type's name has no '/'")
        most = t.integer("max", 1, minimum=1)
        if most > MAX_LAUNCHABLE:
            raise t.fail("max", f"must be 1 to {MAX_LAUNCHABLE}, got {most}")
        price = t.number("price_per_hour", 0.0)
        spot = t.number("spot_price_per_hour", 0.0)
        delay_s = t.number("delay_s", DEFAULT_DELAY_S)
        is_spot = t.flag("spot", False)
        hardware = _node(t, site_power, counted=False)
        types.append(NodeType(name, hardware.node(""), most, price, spot, delay_s, is_spot))
    return types


def _reclaims(f: Fields, node_types: tuple[NodeType, ...]) -> tuple[float, float]:
    """A site's reclaim model for its spot nodes: ``spot_reclaim_after_s`` (each is taken back
    that long after it runs) or ``spot_mean_lifetime_s`` (the mean of exponential draws), one
    of them, and only with a ``spot`` node type."""
    keys = ("spot_reclaim_after_s", "spot_mean_lifetime_s")
    for key in keys:
        if f.has(key) and not any(t.spot for t in node_types):
            raise f.fail(key, "applies to spot nodes: declare a node type with spot: true")
    if all(f.has(key) for key in keys):
        raise f.fail(keys[1], "give spot_reclaim_after_s or spot_mean_lifetime_s, not both")
    after_s, mean_s = (f.number(key, 0.0) for key in keys)
    for key, value in zip(keys, (after_s, mean_s), strict=True):
        if f.has(key) and value <= 0:
            raise f.fail(key, f"must be > 0, got {f.raw(key)!r}")
    return after_s, mean_s


def _release(f: Fields, node_types: tuple[NodeType, ...]) -> tuple[float, int]:
    """A site's ``idle_release_s`` and ``warm_min``, which only node types have."""
    for key in ("idle_release_s", "warm_min"):
        if f.has(key) and not node_types:
            raise f.fail(key, "applies to launched nodes: declare node_types, or drop it")
    idle_release_s = f.number("idle_release_s", IDLE_RELEASE_S)
    if idle_release_s <= 0:
        raise f.fail("idle_release_s", f"must be > 0, got {f.raw('idle_release_s')!r}")
    warm_min = f.integer("warm_min", 0, minimum=0)
    launchable = sum(t.max for t in node_types)
    if node_types and warm_min > launchable:
        raise f.fail(
            "warm_min", f"must be at most the node types' max in all ({launchable}), got {warm_min}"
        )
    return idle_release_s, warm_min


def _node(f: Fields, site_power: float, *, counted: bool = True) -> NodeSpec:
    labels: dict[str, str] = {}
    declared = f.child("labels")
    if declared is not None:
        for key in declared.names():
            labels[key] = declared.string(key)
        declared.done()
    node = NodeSpec(
        cpu=f.number("cpu", minimum=0.0),
        memory_mib=f.integer("memory_mib", minimum=0),
        devices=tuple(_device(d, site_power) for d in f.items("devices")),
        count=f.integer("count", 1, minimum=1) if counted else 1,
        labels=labels,
    )
    f.done()
    return node


def _device(f: Fields, site_power: float) -> DeviceSpec:
    model = f.string("model")
    known = KNOWN_MODELS.get(model)
    if known is None and not all(f.has(k) for k in ("kind", "memory_mib", "tflops_fp16")):
        raise f.fail(
            "model",
            f"{model!r} is not a known model ({', '.join(sorted(KNOWN_MODELS))}); "
            "give kind, memory_mib and tflops_fp16 (and power_watts)",
        )
    kind_name = f.string("kind", known.kind if known else "GPU").upper()
    if "DEVICE_KIND_" + kind_name not in KIND_NAMES:
        raise f.fail("kind", f"unknown device kind {kind_name!r} (GPU, NPU, MLU, FPGA, DPU)")
    power_default = site_power or (known.power_watts if known else 0.0)
    device = DeviceSpec(
        kind=resources_pb2.DeviceKind.Value("DEVICE_KIND_" + kind_name),
        vendor=f.string("vendor", known.vendor if known else "").lower(),
        model=model,
        memory_mib=f.integer("memory_mib", known.memory_mib if known else None),
        tflops_fp16=f.number("tflops_fp16", known.tflops_fp16 if known else None),
        power_watts=f.number("power_watts", power_default),
        count=f.integer("count", 1, minimum=1),
        shareable=f.flag("shareable", False),
    )
    f.done()
    return device


def _link(f: Fields) -> Link:
    link = Link(f.number("bandwidth_mbps", minimum=1e-9), f.number("rtt_ms"))
    f.done()
    return link


def _data_path(f: Fields, key: str, base: Path) -> Path:
    path = Path(f.string(key)).expanduser()
    path = path if path.is_absolute() else base / path
    if not path.is_file():
        raise f.fail(key, f"no such file {path}")
    return path


def _links(f: Fields, base: Path, sites: set[str]) -> LinkPlan:
    default = f.child("default")
    same_region = f.child("same_region")
    bandwidth: dict[tuple[str, str], float] = {}
    rtt: dict[tuple[str, str], float] = {}
    edge_scale = 0.1
    measured = f.child("measured")
    if measured is not None:
        if measured.has("throughput"):
            bandwidth = load_throughput_csv(_data_path(measured, "throughput", base))
        if measured.has("rtt"):
            rtt = load_rtt_csv(_data_path(measured, "rtt", base))
        edge_scale = measured.number("edge_scale", 0.1)
        measured.done()
    declared = []
    for item in f.items("declared"):
        ends = (item.string("from"), item.string("to"))
        for key, name in zip(("from", "to"), ends, strict=True):
            if name not in sites:
                raise item.fail(key, f"unknown site {name!r}")
        both_ways = item.flag("both_ways", True)
        link = Link(item.number("bandwidth_mbps", minimum=1e-9), item.number("rtt_ms"))
        item.done()
        declared.append(DeclaredLink(ends[0], ends[1], link, both_ways))
    plan = LinkPlan(
        default=_link(default) if default else Link(100.0, 100.0),
        same_region=_link(same_region) if same_region else None,
        measured_bandwidth=bandwidth,
        measured_rtt=rtt,
        edge_scale=edge_scale,
        declared=tuple(declared),
    )
    f.done()
    return plan


def launchable_nodes(site: SiteSpec) -> list[resources_pb2.Node]:
    """The nodes of the site's node types, launchable, as its agent publishes them (named
    ``site/type-i``)."""
    nodes = []
    for node_type in site.node_types:
        for name in node_type.node_names():
            node = node_type.node(f"{site.name}/{name}")
            delay_s = node_type.delay_s
            node.launch.CopyFrom(
                node_type.launch(resources_pb2.NodeLaunch.STATE_LAUNCHABLE, delay_s, delay_s)
            )
            nodes.append(node)
    return nodes
