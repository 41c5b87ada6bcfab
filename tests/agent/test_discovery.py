"""Discovery of the host this test runs on, and of its NVIDIA GPUs when it has any."""

from __future__ import annotations

import platform
import re
import socket

import psutil
import pynvml
import pytest

from federation.agent.discovery import canonical_model, discover_host_node, discover_nvidia_gpus
from federation.api.v1 import resources_pb2


def _nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_host_node_matches_psutil() -> None:
    """CPU, memory, arch and labels are the host's, as psutil and platform see them."""
    node = discover_host_node("box")
    assert node.name == "box"
    assert node.cpu_cores == psutil.cpu_count(logical=True)
    assert node.cpu_free == node.cpu_cores
    assert node.memory_mib == psutil.virtual_memory().total // (1024 * 1024)
    assert node.memory_free_mib == node.memory_mib
    assert node.arch == platform.machine()
    assert node.labels["os"] == platform.system().lower()
    assert node.labels["kernel"] == platform.release()
    assert node.labels["python"] == platform.python_version()
    assert node.schedulable
    assert node.provenance == resources_pb2.PROVENANCE_DISCOVERED


def test_host_node_defaults_to_host_name() -> None:
    """Without a name the node is named after the host."""
    assert discover_host_node().name == socket.gethostname()


def test_no_gpus_without_nvidia_driver() -> None:
    """Without an NVIDIA driver discovery finds no GPUs rather than failing."""
    if _nvml_works():
        pytest.skip("this machine has an NVIDIA driver")
    assert discover_nvidia_gpus() == []
    node = discover_host_node()
    assert not [d for d in node.devices if d.vendor == "nvidia"]
    assert "driver" not in node.labels


def test_nvidia_gpus_match_nvml() -> None:
    """Each GPU NVML reports becomes a device with canonical model, driver, CUDA, capability,
    health and NVLink group."""
    if not _nvml_works():
        pytest.skip("NVML has no NVIDIA driver on this machine")
    devices = discover_nvidia_gpus()
    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
        driver = pynvml.nvmlSystemGetDriverVersion()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        uuids = [pynvml.nvmlDeviceGetUUID(h) for h in handles]
        totals = [pynvml.nvmlDeviceGetMemoryInfo(h).total // (1024 * 1024) for h in handles]
    finally:
        pynvml.nvmlShutdown()
    assert len(devices) == count
    for index, device in enumerate(devices):
        assert device.index == index
        assert device.id == uuids[index]
        assert device.kind == resources_pb2.DEVICE_KIND_GPU
        assert device.vendor == "nvidia"
        assert device.model == canonical_model(device.attributes["nvml_name"])
        assert device.memory_total_mib == totals[index]
        assert 0 < device.memory_free_mib <= device.memory_total_mib
        # A GPU awaiting a reset (pending page retirement or row remap) is degraded, with why.
        assert device.health == resources_pb2.DEVICE_HEALTH_HEALTHY or (
            device.health == resources_pb2.DEVICE_HEALTH_DEGRADED and device.health_reason
        )
        assert re.fullmatch(r"(nvlink-\d+)?", device.interconnect_group)
        assert device.provenance == resources_pb2.PROVENANCE_DISCOVERED
        assert device.attributes["driver"] == driver
        assert re.fullmatch(r"\d+\.\d+", device.attributes["cuda"])
        assert re.fullmatch(r"\d+\.\d+", device.attributes["compute_capability"])
        assert device.power_tdp_watts > 0
    node = discover_host_node()
    assert len(node.devices) == count
    assert node.labels["driver"] == driver
    assert node.labels["cuda"] == devices[0].attributes["cuda"]
