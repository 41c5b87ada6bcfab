"""What a site agent knows about its hardware: the host it runs on, and an inventory file.

The host is discovered (psutil, NVML); an inventory declares nodes this machine lacks, such as
edge boxes behind the agent or hardware simulated on a laptop. Both yield plain ``Node`` protos.
"""

from __future__ import annotations

import platform
import socket
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import psutil
import structlog
import yaml

from federation.api.v1 import resources_pb2

log = structlog.get_logger()

_MIB = 1024 * 1024
_T = TypeVar("_T")

KIND_NAMES = ("GPU", "NPU", "MLU", "FPGA", "DPU")


def device_kind_name(kind: resources_pb2.DeviceKind.ValueType) -> str:
    """Short upper-case name of a device kind, e.g. ``"GPU"``."""
    return resources_pb2.DeviceKind.Name(kind).removeprefix("DEVICE_KIND_")


def discover_host_node(name: str | None = None) -> resources_pb2.Node:
    """Describes the machine this process runs on, NVIDIA GPUs included.

    Args:
        name: Node name; the host name when omitted.

    Returns:
        A schedulable, discovered node whose free capacity equals its total: the local core
        subtracts what it has handed out.
    """
    cpu_cores = float(psutil.cpu_count(logical=True) or 1)
    memory_mib = psutil.virtual_memory().total // _MIB
    node = resources_pb2.Node(
        name=name or socket.gethostname(),
        arch=platform.machine(),
        cpu_cores=cpu_cores,
        cpu_free=cpu_cores,
        memory_mib=memory_mib,
        memory_free_mib=memory_mib,
        labels={
            "os": platform.system().lower(),
            "kernel": platform.release(),
            "python": platform.python_version(),
        },
        schedulable=True,
        provenance=resources_pb2.PROVENANCE_DISCOVERED,
    )
    gpus = discover_nvidia_gpus()
    node.devices.extend(gpus)
    if gpus:
        # Driver and CUDA are per host, so every GPU carries the same values.
        for key in ("driver", "cuda"):
            if value := gpus[0].attributes.get(key):
                node.labels[key] = value
    return node


def _optional(default: _T, call: Callable[..., _T], *args: Any) -> _T:
    """Result of an NVML query that some devices do not support (power on MIG, temperature)."""
    import pynvml

    try:
        return call(*args)
    except pynvml.NVMLError:
        return default


def _nvidia_gpu(index: int, driver: str, cuda: str) -> resources_pb2.Device:
    """One GPU from NVML; a GPU that NVML cannot describe is reported unhealthy."""
    import pynvml

    device = resources_pb2.Device(
        id=str(index),
        index=index,
        kind=resources_pb2.DEVICE_KIND_GPU,
        vendor="nvidia",
        health=resources_pb2.DEVICE_HEALTH_HEALTHY,
        provenance=resources_pb2.PROVENANCE_DISCOVERED,
        attributes={"driver": driver, **({"cuda": cuda} if cuda else {})},
    )
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        device.id = str(pynvml.nvmlDeviceGetUUID(handle))
        device.model = str(pynvml.nvmlDeviceGetName(handle))
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        device.memory_total_mib = int(memory.total) // _MIB
        device.memory_free_mib = int(memory.free) // _MIB
    except pynvml.NVMLError as exc:
        log.warning("nvidia_gpu_unreadable", index=index, error=str(exc))
        device.health = resources_pb2.DEVICE_HEALTH_UNHEALTHY
        device.health_reason = f"NVML: {exc}"
        return device
    # NVML reports milliwatts.
    device.power_watts = _optional(0, pynvml.nvmlDeviceGetPowerUsage, handle) / 1000
    device.power_tdp_watts = _optional(0, pynvml.nvmlDeviceGetEnforcedPowerLimit, handle) / 1000
    device.temperature_c = _optional(
        0, pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU
    )
    major, minor = _optional((0, 0), pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    if major:
        device.attributes["compute_capability"] = f"{major}.{minor}"
    return device


def discover_nvidia_gpus() -> list[resources_pb2.Device]:
    """NVIDIA GPUs on this machine via NVML; empty when there is no driver.

    Returns:
        One discovered device per GPU, in NVML index order, with attributes ``driver``,
        ``cuda`` and ``compute_capability``.
    """
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.debug("nvml_unavailable", error=str(exc))
        return []
    try:
        driver = str(_optional("", pynvml.nvmlSystemGetDriverVersion))
        cuda_raw = int(_optional(0, pynvml.nvmlSystemGetCudaDriverVersion))
        # NVML encodes CUDA 12.4 as 12040.
        cuda = f"{cuda_raw // 1000}.{cuda_raw % 1000 // 10}" if cuda_raw else ""
        count = int(_optional(0, pynvml.nvmlDeviceGetCount))
        devices = [_nvidia_gpu(index, driver, cuda) for index in range(count)]
    finally:
        _optional(None, pynvml.nvmlShutdown)
    log.info("nvidia_gpus_discovered", count=len(devices), driver=driver, cuda=cuda)
    return devices


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
}


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

    def strings(self, value: Any, field: str) -> dict[str, str]:
        if not isinstance(value, Mapping):
            raise self.fail(field, f"expected a mapping, got {type(value).__name__}")
        return {str(k): self.string(v, f"{field}.{k}") for k, v in value.items()}


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
    schedulable = entry.get("schedulable", True)
    if not isinstance(schedulable, bool):
        raise reader.fail(f"{field}.schedulable", f"expected true or false, got {schedulable!r}")
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

    Returns:
        Declared nodes; each device entry with ``count: n`` becomes n devices.

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
