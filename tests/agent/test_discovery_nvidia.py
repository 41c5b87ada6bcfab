"""The parts of NVIDIA discovery that need no GPU: NVLink groups, health from readings, and
an NVML that cannot start.

The NVML path itself is tested in ``test_discovery.py`` where a GPU exists.
"""

from __future__ import annotations

import pynvml
import pytest

from federation.agent.discovery.nvidia import (
    HealthReadings,
    gpu_health,
    interconnect_groups,
    scan_nvidia_gpus,
)
from federation.agent.discovery.plugin import Scan
from federation.api.v1 import resources_pb2


def _matrix(n: int, pairs: list[tuple[int, int]]) -> list[list[bool]]:
    linked = [[False] * n for _ in range(n)]
    for i, j in pairs:
        linked[i][j] = linked[j][i] = True
    return linked


def test_nvswitch_joins_every_gpu() -> None:
    """On an NVSwitch board (HGX) every pair reaches each other: one group."""
    pairs = [(i, j) for i in range(8) for j in range(i + 1, 8)]
    assert interconnect_groups(_matrix(8, pairs)) == ["nvlink-0"] * 8


def test_bridged_pairs_form_one_group_each() -> None:
    """PCIe cards joined two by two with NVLink bridges form one group per pair."""
    groups = interconnect_groups(_matrix(4, [(0, 1), (2, 3)]))
    assert groups == ["nvlink-0", "nvlink-0", "nvlink-1", "nvlink-1"]


def test_groups_follow_links_over_several_hops() -> None:
    """GPUs joined through others (a cube mesh) share a group; groups count in GPU order."""
    groups = interconnect_groups(_matrix(5, [(3, 4), (0, 2), (2, 4)]))
    assert groups == ["nvlink-0", "", "nvlink-0", "nvlink-0", "nvlink-0"]


def test_gpus_without_nvlink_have_no_group() -> None:
    """A GPU NVLink joins to nothing is its own group (empty), as are all GPUs of a PCIe box."""
    assert interconnect_groups(_matrix(3, [])) == ["", "", ""]
    assert interconnect_groups([]) == []


@pytest.mark.parametrize(
    ("readings", "health", "words"),
    [
        (HealthReadings(), resources_pb2.DEVICE_HEALTH_HEALTHY, ""),
        (
            HealthReadings(retired_pages_pending=True),
            resources_pb2.DEVICE_HEALTH_DEGRADED,
            "pages pending retirement",
        ),
        (
            HealthReadings(row_remap_pending=True),
            resources_pb2.DEVICE_HEALTH_DEGRADED,
            "rows pending remapping",
        ),
        (
            HealthReadings(failed_queries=("Temperature: GPU is lost",)),
            resources_pb2.DEVICE_HEALTH_DEGRADED,
            "NVML query failed: Temperature: GPU is lost",
        ),
        (
            HealthReadings(row_remap_pending=True, row_remap_failed=True),
            resources_pb2.DEVICE_HEALTH_UNHEALTHY,
            "row remapping failed",
        ),
    ],
)
def test_health_follows_readings(
    readings: HealthReadings, health: resources_pb2.DeviceHealth.ValueType, words: str
) -> None:
    """Pending retirement or remapping and failing queries degrade; a failed remap is fatal."""
    got, reason = gpu_health(readings)
    assert got == health
    assert words in reason
    assert bool(reason) == (health != resources_pb2.DEVICE_HEALTH_HEALTHY)


def test_every_reason_is_kept() -> None:
    """Several problems are all named, in one reason."""
    _, reason = gpu_health(HealthReadings(retired_pages_pending=True, failed_queries=("Ecc: x",)))
    assert "pages pending retirement" in reason
    assert "Ecc: x" in reason


@pytest.mark.parametrize(
    ("error", "problems"),
    [
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, ()),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, ()),
        (
            pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH,
            ("NVML cannot start: RM has detected an NVML/RM version mismatch.",),
        ),
    ],
)
def test_nvml_that_cannot_start(
    monkeypatch: pytest.MonkeyPatch, error: int, problems: tuple[str, ...]
) -> None:
    """No driver means no GPUs and nothing wrong; a driver NVML cannot use is a problem."""

    def fail() -> None:
        raise pynvml.NVMLError(error)

    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    assert scan_nvidia_gpus() == Scan(problems=problems)
