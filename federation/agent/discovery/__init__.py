"""What a site agent knows about its hardware: the host it runs on, and an inventory file.

The host is discovered (psutil, NVML); an inventory (``federation.agent.inventory``, re-exported
here) declares nodes this machine lacks, such as edge boxes behind the agent or hardware
simulated on a laptop. Both yield plain ``Node`` protos.
"""

from __future__ import annotations

import math
import platform
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import psutil
import structlog

from federation.agent.inventory import KIND_NAMES, InventoryError, load_inventory
from federation.api.v1 import resources_pb2

__all__ = [
    "KIND_NAMES",
    "InventoryError",
    "device_kind_name",
    "discover_host_node",
    "discover_nvidia_gpus",
    "load_inventory",
]

log = structlog.get_logger()

_MIB = 1024 * 1024
_T = TypeVar("_T")


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
    device.partitions.extend(_mig_profiles(handle))
    return device


def _mig_profiles(handle: Any) -> list[resources_pb2.PartitionProfile]:
    """The MIG profiles of a GPU whose MIG mode is on; empty when it is off or unsupported.

    ``total`` is how many instances of a profile the GPU holds when cut into that profile
    alone. The embedded core only counts slots and names the profile to the task
    (``FEDERATION_PARTITION``); it does not create GPU instances, so confining a task to one
    still needs instances made by an operator or a MIG manager.
    """
    import pynvml

    current, _pending = _optional((0, 0), pynvml.nvmlDeviceGetMigMode, handle)
    if current != pynvml.NVML_DEVICE_MIG_ENABLE:
        return []
    profiles: dict[str, resources_pb2.PartitionProfile] = {}
    for profile_id in range(getattr(pynvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0)):
        info = _optional(None, pynvml.nvmlDeviceGetGpuInstanceProfileInfo, handle, profile_id)
        if info is None or not info.instanceCount:
            continue  # a profile this GPU does not offer
        raw = info.name.decode(errors="replace") if isinstance(info.name, bytes) else ""
        # NVML names them "MIG 1g.10gb"; older drivers leave the name empty.
        name = raw.removeprefix("MIG ").strip() or (
            f"{info.sliceCount}g.{math.ceil(info.memorySizeMB / 1024)}gb"
        )
        profiles.setdefault(
            name,
            resources_pb2.PartitionProfile(
                profile=name,
                total=info.instanceCount,
                free=info.instanceCount,
                memory_mib=info.memorySizeMB,
            ),
        )
    return list(profiles.values())


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
