"""Declared hardware: nodes an inventory file describes, for machines this agent lacks.

Edge boxes behind the agent, or hardware simulated on a laptop, are declared in YAML (or TOML)
and become plain ``Node`` protos. Parsing is strict: an unknown key or a bad value is an
``InventoryError`` naming the file and the field path.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog
import yaml

from federation.api.v1 import resources_pb2

log = structlog.get_logger()

KIND_NAMES = ("GPU", "NPU", "MLU", "FPGA", "DPU")


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
_PARTITION_KEYS = {"profile", "count", "memory_mib"}


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

    def number(self, value: Any, field: str, *, integer: bool = False) -> float:
        kind = "integer" if integer else "number"
        ok_types = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, ok_types):
            raise self.fail(field, f"expected a non-negative {kind}, got {value!r}")
        if value < 0:
            raise self.fail(field, f"must be non-negative, got {value!r}")
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
    reader: _Reader, entries: Any, device_memory_mib: int, field: str
) -> list[resources_pb2.PartitionProfile]:
    """Profiles a device can be cut into: ``count`` is how many of that profile fit on it."""
    if not isinstance(entries, list):
        raise reader.fail(field, f"expected a list, got {type(entries).__name__}")
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
        count = int(reader.number(entry["count"], f"{path}.count", integer=True))
        if not count:
            raise reader.fail(f"{path}.count", "must be positive, got 0")
        memory_mib = int(
            reader.number(entry.get("memory_mib", 0), f"{path}.memory_mib", integer=True)
        )
        if device_memory_mib and memory_mib > device_memory_mib:
            raise reader.fail(
                f"{path}.memory_mib",
                f"{memory_mib} exceeds the device's memory_mib {device_memory_mib}",
            )
        profiles.append(
            resources_pb2.PartitionProfile(
                profile=profile, total=count, free=count, memory_mib=memory_mib
            )
        )
    return profiles


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
        memory_mib = int(
            reader.number(entry.get("memory_mib", 0), f"{path}.memory_mib", integer=True)
        )
        template = resources_pb2.Device(
            kind=resources_pb2.DeviceKind.Value(f"DEVICE_KIND_{kind}"),
            vendor=reader.string(entry.get("vendor", ""), f"{path}.vendor").lower(),
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
                reader, entry.get("partitions", []), memory_mib, f"{path}.partitions"
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
    memory_mib = int(reader.number(entry.get("memory_mib", 0), f"{field}.memory_mib", integer=True))
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
    it can be cut into, ``count`` being how many of that profile fit on it.

    Returns:
        Declared nodes; each device entry with ``count: n`` becomes n devices, each free:
        ``free_fraction`` 1 and every partition profile's ``free`` equal to its ``total``.

    Raises:
        InventoryError: The file cannot be read or parsed, or a field is invalid.
    """
    reader = _Reader(path)
    try:
        text = path.read_text(encoding="utf-8")
        document = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except OSError as exc:
        raise reader.fail("", f"cannot read: {exc.strerror or exc}") from exc
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise reader.fail("", f"cannot parse: {exc}") from exc
    if document is None:  # an empty file declares nothing
        return []
    top = reader.mapping(document, "", {"nodes"})
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
