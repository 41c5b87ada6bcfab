"""Declared hardware: nodes an inventory file describes, for machines this agent lacks.

Edge boxes behind the agent, or hardware simulated on a laptop, are declared in YAML (or TOML)
and become plain ``Node`` protos. Parsing is strict: an unknown key or a bad value is an
``InventoryError`` naming the file and the field path.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
import yaml

from federation.api.v1 import resources_pb2
from federation.common.node_types import DEFAULT_DELAY_S, MAX_LAUNCHABLE, NodeType
from federation.common.view_limits import (
    MAX_DEVICE_MEMORY_MIB,
    MAX_DEVICE_PARTITIONS,
    MAX_FIGURE,
    MAX_NODE_DEVICES,
    MAX_NODE_MEMORY_MIB,
)

log = structlog.get_logger()

KIND_NAMES = ("GPU", "NPU", "MLU", "FPGA", "DPU")
VENDORS = ("amd", "cambricon", "huawei", "intel", "nvidia", "xilinx")
"""The vendors the agent knows: NVIDIA's NVML and the discovery plugins' (``vendors.py``).
Packing and device visibility go by vendor, so a misspelt one would silently match nothing."""
_MAX_PARTITION_SLOTS = 2**32 - 1
"""Most slots of one profile: what ``PartitionProfile.total`` (uint32) holds."""


class InventoryError(ValueError):
    """An inventory file is malformed; the message names the file and the field."""


_NODE_KEYS = {"name", "arch", "cpu_cores", "memory_mib", "labels", "devices", "schedulable"}
_DEVICE_KEYS = {
    "kind",
    "vendor",
    "model",
    "memory_mib",
    "count",
    "tflops_fp32",
    "tflops_fp16",
    "tflops_int8",
    "power_tdp_watts",
    "interconnect_group",
    "attributes",
    "shareable",
    "partitions",
}
_PARTITION_KEYS = {"profile", "count", "memory_mib", "instances"}


class _Reader:
    """Typed access to one parsed inventory, raising errors that name file and field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, field: str, problem: str) -> InventoryError:
        return InventoryError(
            f"{self.path}: {field}: {problem}" if field else f"{self.path}: {problem}"
        )

    def mapping(self, value: Any, field: str, allowed: set[str]) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise self.fail(field, f"expected a mapping, got {type(value).__name__}")
        for key in value:
            if key not in allowed:
                raise self.fail(
                    f"{field}.{key}" if field else str(key),
                    f"unknown key (expected one of {', '.join(sorted(allowed))})",
                )
        return value

    def string(self, value: Any, field: str) -> str:
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise self.fail(field, f"expected a string, got {type(value).__name__}")
        return str(value)

    def number(
        self, value: Any, field: str, *, integer: bool = False, most: float = MAX_FIGURE
    ) -> float:
        kind = "integer" if integer else "number"
        ok_types = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_types):
            raise self.fail(field, f"expected a non-negative {kind}, got {value!r}")
        if not math.isfinite(value):
            raise self.fail(field, f"expected a finite number, got {value!r}")
        if value < 0:
            raise self.fail(field, f"must be non-negative, got {value!r}")
        if value > most:
            # The coordinator refuses a site view with more (and protobuf cannot hold some).
            raise self.fail(field, f"must be at most {most:.15g}, got {value!r}")
        return float(value)

    def boolean(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            raise self.fail(field, f"expected true or false, got {value!r}")
        return value

    def strings(self, value: Any, field: str) -> dict[str, str]:
        if not isinstance(value, Mapping):
            raise self.fail(field, f"expected a mapping, got {type(value).__name__}")
        return {str(k): self.string(v, f"{field}.{k}") for k, v in value.items()}


def _parse_partitions(
    reader: _Reader, entries: Any, device_memory_mib: int, devices: int, field: str
) -> list[resources_pb2.PartitionProfile]:
    """Profiles a device can be cut into: ``count`` is how many of that profile fit on it,
    ``instances`` the names of those made (MIG: ``MIG-<uuid>``), for an entry of one device."""
    if not isinstance(entries, list):
        raise reader.fail(field, f"expected a list, got {type(entries).__name__}")
    if len(entries) > MAX_DEVICE_PARTITIONS:
        raise reader.fail(field, f"at most {MAX_DEVICE_PARTITIONS} profiles, got {len(entries)}")
    profiles: list[resources_pb2.PartitionProfile] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(entries):
        path = f"{field}[{i}]"
        entry = reader.mapping(raw, path, _PARTITION_KEYS)
        for key in ("profile", "count"):
            if key not in entry:
                raise reader.fail(f"{path}.{key}", "is required")
        profile = reader.string(entry["profile"], f"{path}.profile")
        if not profile:
            raise reader.fail(f"{path}.profile", "must not be empty")
        if profile in seen:
            raise reader.fail(
                f"{path}.profile", f"duplicate profile {profile!r} (also {field}[{seen[profile]}])"
            )
        seen[profile] = i
        count = int(
            reader.number(entry["count"], f"{path}.count", integer=True, most=_MAX_PARTITION_SLOTS)
        )
        if not count:
            raise reader.fail(f"{path}.count", "must be positive, got 0")
        memory_mib = int(
            reader.number(
                entry.get("memory_mib", 0),
                f"{path}.memory_mib",
                integer=True,
                most=MAX_DEVICE_MEMORY_MIB,
            )
        )
        if device_memory_mib and memory_mib > device_memory_mib:
            raise reader.fail(
                f"{path}.memory_mib",
                f"{memory_mib} exceeds the device's memory_mib {device_memory_mib}",
            )
        instances = _parse_instances(reader, entry.get("instances", []), count, devices, path)
        profiles.append(
            resources_pb2.PartitionProfile(
                profile=profile,
                total=count,
                free=count,
                memory_mib=memory_mib,
                instances=instances,
            )
        )
    return profiles


def _parse_instances(
    reader: _Reader, entries: Any, count: int, devices: int, path: str
) -> list[str]:
    field = f"{path}.instances"
    if not isinstance(entries, list):
        raise reader.fail(field, f"expected a list, got {type(entries).__name__}")
    names = [reader.string(name, f"{field}[{i}]") for i, name in enumerate(entries)]
    if names and devices != 1:
        raise reader.fail(field, "names one device's instances: give that device count 1")
    if len(names) > count:
        raise reader.fail(field, f"at most count ({count}) instances, got {len(names)}")
    if len(set(names)) != len(names) or not all(names):
        raise reader.fail(field, "must be distinct, non-empty names")
    return names


def _parse_devices(
    reader: _Reader, entries: Any, node_name: str, field: str
) -> list[resources_pb2.Device]:
    if not isinstance(entries, list):
        raise reader.fail(field, f"expected a list, got {type(entries).__name__}")
    devices: list[resources_pb2.Device] = []
    next_index: dict[str, int] = {}  # per kind, so *_VISIBLE_DEVICES indices stay dense
    for i, raw in enumerate(entries):
        path = f"{field}[{i}]"
        entry = reader.mapping(raw, path, _DEVICE_KEYS)
        if "kind" not in entry:
            raise reader.fail(f"{path}.kind", "is required")
        kind = reader.string(entry["kind"], f"{path}.kind").upper()
        if kind not in KIND_NAMES:
            raise reader.fail(
                f"{path}.kind",
                f"unknown kind {entry['kind']!r} (expected one of {', '.join(KIND_NAMES)})",
            )
        count = int(reader.number(entry.get("count", 1), f"{path}.count", integer=True))
        if len(devices) + count > MAX_NODE_DEVICES:
            raise reader.fail(
                f"{path}.count",
                f"the node would have {len(devices) + count} devices, "
                f"more than the {MAX_NODE_DEVICES} a site view may hold",
            )
        memory_mib = int(
            reader.number(
                entry.get("memory_mib", 0),
                f"{path}.memory_mib",
                integer=True,
                most=MAX_DEVICE_MEMORY_MIB,
            )
        )
        vendor = reader.string(entry.get("vendor", ""), f"{path}.vendor")
        if vendor and vendor.lower() not in VENDORS:
            raise reader.fail(
                f"{path}.vendor",
                f"unknown vendor {vendor!r} (expected one of {', '.join(VENDORS)})",
            )
        template = resources_pb2.Device(
            kind=resources_pb2.DeviceKind.Value(f"DEVICE_KIND_{kind}"),
            vendor=vendor.lower(),
            model=reader.string(entry.get("model", ""), f"{path}.model"),
            memory_total_mib=memory_mib,
            memory_free_mib=memory_mib,
            tflops_fp32=reader.number(entry.get("tflops_fp32", 0), f"{path}.tflops_fp32"),
            tflops_fp16=reader.number(entry.get("tflops_fp16", 0), f"{path}.tflops_fp16"),
            tflops_int8=reader.number(entry.get("tflops_int8", 0), f"{path}.tflops_int8"),
            power_tdp_watts=reader.number(
                entry.get("power_tdp_watts", 0), f"{path}.power_tdp_watts"
            ),
            interconnect_group=reader.string(
                entry.get("interconnect_group", ""), f"{path}.interconnect_group"
            ),
            health=resources_pb2.DEVICE_HEALTH_HEALTHY,
            provenance=resources_pb2.PROVENANCE_DECLARED,
            attributes=reader.strings(entry.get("attributes", {}), f"{path}.attributes"),
            shareable=reader.boolean(entry.get("shareable", False), f"{path}.shareable"),
            free_fraction=1.0,
            partitions=_parse_partitions(
                reader, entry.get("partitions", []), memory_mib, count, f"{path}.partitions"
            ),
        )
        for _ in range(count):
            device = resources_pb2.Device()
            device.CopyFrom(template)
            device.index = next_index.get(kind, 0)
            next_index[kind] = device.index + 1
            device.id = f"{node_name}-{kind.lower()}{device.index}"
            devices.append(device)
    return devices


def _parse_node(reader: _Reader, raw: Any, field: str) -> resources_pb2.Node:
    entry = reader.mapping(raw, field, _NODE_KEYS)
    if "name" not in entry:
        raise reader.fail(f"{field}.name", "is required")
    name = reader.string(entry["name"], f"{field}.name")
    if not name:
        raise reader.fail(f"{field}.name", "must not be empty")
    cpu_cores = reader.number(entry.get("cpu_cores", 0), f"{field}.cpu_cores")
    memory_mib = int(
        reader.number(
            entry.get("memory_mib", 0),
            f"{field}.memory_mib",
            integer=True,
            most=MAX_NODE_MEMORY_MIB,
        )
    )
    schedulable = reader.boolean(entry.get("schedulable", True), f"{field}.schedulable")
    return resources_pb2.Node(
        name=name,
        arch=reader.string(entry.get("arch", ""), f"{field}.arch"),
        cpu_cores=cpu_cores,
        cpu_free=cpu_cores,
        memory_mib=memory_mib,
        memory_free_mib=memory_mib,
        devices=_parse_devices(reader, entry.get("devices", []), name, f"{field}.devices"),
        labels=reader.strings(entry.get("labels", {}), f"{field}.labels"),
        schedulable=schedulable,
        provenance=resources_pb2.PROVENANCE_DECLARED,
    )


def load_inventory(path: Path) -> list[resources_pb2.Node]:
    """Loads declared nodes from a YAML inventory, or TOML when the name ends in ``.toml``.

    Args:
        path: The inventory file.

    A device entry may say ``shareable: true`` (tasks may take fractions of it) and list
    ``partitions: [{profile: "1g.10gb", count: 7, memory_mib: 10240}]``: the hardware profiles
    it can be cut into, ``count`` being how many of that profile fit on it. A ``vendor``, when
    given, is one of ``VENDORS`` (any case). Device ids are not declared: each is
    ``<node>-<kind><index>``, so they never repeat within a node.

    Returns:
        Declared nodes; each device entry with ``count: n`` becomes n devices, each free:
        ``free_fraction`` 1 and every partition profile's ``free`` equal to its ``total``.

    Raises:
        InventoryError: The file cannot be read or parsed, or a field is invalid.
    """
    reader, top = _read(path)
    entries = top.get("nodes", [])
    if not isinstance(entries, list):
        raise reader.fail("nodes", f"expected a list, got {type(entries).__name__}")
    nodes: list[resources_pb2.Node] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(entries):
        node = _parse_node(reader, raw, f"nodes[{i}]")
        if node.name in seen:
            raise reader.fail(
                f"nodes[{i}].name",
                f"duplicate node name {node.name!r} (also nodes[{seen[node.name]}])",
            )
        seen[node.name] = i
        nodes.append(node)
    log.info("inventory_loaded", path=str(path), nodes=len(nodes))
    return nodes


def _read(path: Path) -> tuple[_Reader, Mapping[str, Any]]:
    reader = _Reader(path)
    try:
        text = path.read_text(encoding="utf-8")
        document = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except OSError as exc:
        raise reader.fail("", f"cannot read: {exc.strerror or exc}") from exc
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise reader.fail("", f"cannot parse: {exc}") from exc
    if document is None:  # an empty file declares nothing
        return reader, {}
    return reader, reader.mapping(document, "", {"nodes", "node_types"})


_NODE_TYPE_KEYS = (_NODE_KEYS - {"schedulable"}) | {
    "max",
    "price_per_hour",
    "spot_price_per_hour",
    "delay_s",
    "spot",
}


def load_node_types(path: Path) -> list[NodeType]:
    """The node types an elastic site may launch (``node_types`` of the inventory): each a
    node's fields (``name`` is the type's) with ``max`` (how many may run; default 1),
    ``price_per_hour`` and ``spot_price_per_hour`` (USD per node-hour), ``delay_s`` (the
    expected launch delay; default 60) and ``spot`` (launched as spot capacity, charged the
    spot price, which it must then declare; default false)."""
    reader, top = _read(path)
    entries = top.get("node_types", [])
    if not isinstance(entries, list):
        raise reader.fail("node_types", f"expected a list, got {type(entries).__name__}")
    types: list[NodeType] = []
    for i, raw in enumerate(entries):
        field = f"node_types[{i}]"
        entry = reader.mapping(raw, field, _NODE_TYPE_KEYS)
        node = _parse_node(reader, {k: v for k, v in entry.items() if k in _NODE_KEYS}, field)
        if any(t.name == node.name for t in types):
            raise reader.fail(f"{field}.name", f"duplicate node type {node.name!r}")
        count = reader.number(entry.get("max", 1), f"{field}.max", integer=True)
        if not 1 <= count <= MAX_LAUNCHABLE:
            raise reader.fail(f"{field}.max", f"must be 1 to {MAX_LAUNCHABLE}, got {count:g}")
        price, spot, delay_s = (
            reader.number(entry.get(key, default), f"{field}.{key}")
            for key, default in (
                ("price_per_hour", 0),
                ("spot_price_per_hour", 0),
                ("delay_s", DEFAULT_DELAY_S),
            )
        )
        is_spot = reader.boolean(entry.get("spot", False), f"{field}.spot")
        if is_spot and "spot_price_per_hour" not in entry:
            raise reader.fail(
                f"{field}.spot_price_per_hour", "a spot node type must declare its spot price"
            )
        node.name = ""
        types.append(
            NodeType(str(entry["name"]), node, int(count), price, spot, delay_s, spot=is_spot)
        )
    return types


def check_node_names(nodes: Sequence[resources_pb2.Node], source: Path) -> None:
    """Refuses a site whose nodes share a name: the discovered host and those ``source`` declares.

    Args:
        nodes: The site's nodes, discovered ones and then the inventory's in its order, as the
            agent combines them.
        source: The inventory file, for the message.

    Raises:
        InventoryError: Naming the inventory's node (``nodes[i].name``) that repeats a name.
    """
    seen: dict[str, int | None] = {}  # name -> position in the inventory; None: discovered
    declared = 0
    for node in nodes:
        position = None
        if node.provenance == resources_pb2.PROVENANCE_DECLARED:
            position, declared = declared, declared + 1
        if node.name not in seen:
            seen[node.name] = position
            continue
        first = seen[node.name]
        reader = _Reader(source)
        if first is not None and position is not None:
            raise reader.fail(
                f"nodes[{position}].name",
                f"duplicate node name {node.name!r} (also nodes[{first}])",
            )
        at = first if position is None else position
        raise reader.fail(
            f"nodes[{at}].name" if at is not None else "",
            f"node name {node.name!r} is the discovered host's: rename the node, or set "
            "host_node_name in the agent's config",
        )
