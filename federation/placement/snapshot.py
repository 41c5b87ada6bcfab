"""An immutable, array-shaped picture of every site, built once per change of the views."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from federation.api.v1 import resources_pb2

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]
Bool = npt.NDArray[np.bool_]
Obj = npt.NDArray[np.object_]


@dataclass(frozen=True, slots=True)
class SiteInput:
    """What placement needs to know about one site besides its view."""

    view: resources_pb2.SiteView
    is_connected: bool
    is_cordoned: bool


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

    @property
    def n_sites(self) -> int:
        return len(self.site_ids)

    @property
    def n_nodes(self) -> int:
        return len(self.node_site)


# The same rule as the agents' packer: a device with no health report counts as usable.
USABLE_HEALTH = frozenset(
    {resources_pb2.DEVICE_HEALTH_HEALTHY, resources_pb2.DEVICE_HEALTH_UNSPECIFIED}
)


def _capacity(value: float) -> float:
    """A reported free amount as placement may use it: NaN, infinite or negative count as 0."""
    return value if math.isfinite(value) and value > 0 else 0.0


def build_snapshot(sites: Sequence[SiteInput]) -> Snapshot:
    """Flatten site views into arrays, sites sorted by name so order never matters."""
    ordered = sorted(sites, key=lambda s: s.view.site)
    node_site: list[int] = []
    cpu_free: list[float] = []
    mem_free: list[float] = []
    schedulable: list[bool] = []
    labels: list[dict[str, str]] = []
    dev_node: list[int] = []
    kind: list[int] = []
    vendor: list[str] = []
    model: list[str] = []
    dev_mem: list[float] = []
    available: list[bool] = []
    for site_index, site in enumerate(ordered):
        for node in site.view.nodes:
            node_index = len(node_site)
            node_site.append(site_index)
            cpu_free.append(_capacity(node.cpu_free))
            mem_free.append(_capacity(float(node.memory_free_mib)))
            schedulable.append(node.schedulable)
            labels.append(dict(node.labels))
            for dev in node.devices:
                dev_node.append(node_index)
                kind.append(dev.kind)
                vendor.append(dev.vendor.lower())
                model.append(dev.model)
                dev_mem.append(float(dev.memory_total_mib))
                available.append(not dev.allocated and dev.health in USABLE_HEALTH)
    return Snapshot(
        site_ids=tuple(s.view.site for s in ordered),
        domain=np.array([s.view.domain for s in ordered], dtype=np.int64),
        region=np.array([s.view.region for s in ordered], dtype=object),
        is_connected=np.array([s.is_connected for s in ordered], dtype=bool),
        is_cordoned=np.array([s.is_cordoned for s in ordered], dtype=bool),
        node_site=np.array(node_site, dtype=np.int64),
        node_cpu_free=np.array(cpu_free, dtype=np.float64),
        node_memory_free_mib=np.array(mem_free, dtype=np.float64),
        node_schedulable=np.array(schedulable, dtype=bool),
        node_labels=tuple(labels),
        device_node=np.array(dev_node, dtype=np.int64),
        device_kind=np.array(kind, dtype=np.int64),
        device_vendor=np.array(vendor, dtype=object),
        device_model=np.array(model, dtype=object),
        device_memory_mib=np.array(dev_mem, dtype=np.float64),
        device_available=np.array(available, dtype=bool),
    )
