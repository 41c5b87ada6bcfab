"""The machine this agent runs on, as one discovered node: CPU and memory from psutil, NVIDIA
GPUs from NVML and every other vendor's accelerators from its command line tool."""

from __future__ import annotations

import ctypes
import platform
import socket
import time
from collections.abc import Mapping

import psutil
import structlog

from federation.agent.discovery.plugin import DEFAULT_TIMEOUT_S, Scan
from federation.agent.discovery.vendors import scan_vendors
from federation.api.v1 import resources_pb2

log = structlog.get_logger()

_MIB = 1024 * 1024
_MAX_REASON_CHARS = 1000
"""Longest ``health_reason`` label: enough for a few tools' errors, far below what views allow."""


def device_kind_name(kind: resources_pb2.DeviceKind.ValueType) -> str:
    """Short upper-case name of a device kind, e.g. ``"GPU"``."""
    return resources_pb2.DeviceKind.Name(kind).removeprefix("DEVICE_KIND_")


def measure_host() -> resources_pb2.MeasuredUse:
    """What this machine is using now: CPU since the previous reading (0 at the first), and
    memory not available to new processes."""
    memory = psutil.virtual_memory()
    return resources_pb2.MeasuredUse(
        measured_at=time.time(),
        compute=min(1.0, psutil.cpu_percent(interval=None) / 100),
        memory_used_mib=(memory.total - memory.available) // _MIB,
    )


def discover_host_node(
    name: str | None = None,
    *,
    model_names: Mapping[str, str] | None = None,
    tool_timeout_s: float = DEFAULT_TIMEOUT_S,
) -> resources_pb2.Node:
    """Describes the machine this process runs on, with the accelerators of every vendor.

    Args:
        name: Node name; the host name when omitted.
        model_names: The site's extra canonical model names, tool name → canonical name.
        tool_timeout_s: How long each vendor tool may take before it counts as hung.

    Returns:
        A schedulable, discovered node whose free capacity equals its total: the local core
        subtracts what it has handed out. Where a driver or vendor tool failed, the node is
        labelled ``health=degraded`` with the failures as ``health_reason``, and the devices
        that tool would have found are missing.
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
    node.measured.CopyFrom(measure_host())
    nvidia = _scan_nvidia(model_names)
    others = scan_vendors(model_names, tool_timeout_s)
    node.devices.extend(nvidia.devices)
    node.devices.extend(others.devices)
    if nvidia.devices:
        # Driver and CUDA are per host, so every GPU carries the same values.
        for key in ("driver", "cuda"):
            if value := nvidia.devices[0].attributes.get(key):
                node.labels[key] = value
    if problems := [*nvidia.problems, *others.problems]:
        node.labels["health"] = "degraded"
        node.labels["health_reason"] = "; ".join(problems)[:_MAX_REASON_CHARS]
        log.warning("host_discovery_degraded", problems=problems)
    return node


NVML_LIBRARY = "libnvidia-ml.so.1"
"""NVIDIA's driver library, what NVML's bindings load first."""


def _scan_nvidia(model_names: Mapping[str, str] | None) -> Scan:
    """NVML's scan where NVIDIA's driver library loads. Where it does not there is no NVIDIA
    GPU to find (NVML itself would say so: library not found), and its bindings (pynvml,
    2 to 3 MiB of ctypes declarations) are not loaded into the agent for nothing."""
    try:
        ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return Scan()
    from federation.agent.discovery.nvidia import scan_nvidia_gpus

    return scan_nvidia_gpus(model_names)
