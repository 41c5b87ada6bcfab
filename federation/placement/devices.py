"""What placement and the sites' packers both read of a device, with no numpy: what a CEL
selector sees of it (``device_attributes``) and how fast it runs a workload class
(``device_speeds``). An agent's packer imports this alone."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from importlib import resources
from typing import Any

import yaml

from federation.api.v1 import resources_pb2

REFERENCE_TFLOPS_FP16 = 312.0  # the A100's, which the speed table calls 1.0


@functools.lru_cache(maxsize=1)
def speed_table() -> dict[str, dict[str, float]]:
    text = resources.files("federation.placement").joinpath("data/speed.yaml").read_text()
    doc: dict[str, dict[str, float]] = yaml.safe_load(text)
    return doc


def device_speeds(
    workload_class: str, overrides: Iterable[tuple[str, float]] = ()
) -> Callable[[str, float], float]:
    """Speed of a device (its model, its fp16 TFLOPS) for a workload class (1.0 = A100-80GB):
    the speed table's row, the task's overrides, else TFLOPS against the reference. The
    coordinator's estimates and the sites' packers both read speeds through this."""
    table = {**speed_table().get(workload_class, speed_table()["training"]), **dict(overrides)}

    def speed(model: str, tflops_fp16: float) -> float:
        fallback = tflops_fp16 / REFERENCE_TFLOPS_FP16 if tflops_fp16 > 0 else 1.0
        return float(table.get(model, fallback))

    return speed


def device_attributes(dev: resources_pb2.Device) -> dict[str, Any]:
    """What a CEL selector sees as ``device``: the coordinator's and the agents' single source.

    Args:
        dev: A device as a site view publishes it.

    Returns:
        The keys of ``selectors.SAMPLE_DEVICE``; ``attributes`` is a fresh dict.
    """
    kind_name = resources_pb2.DeviceKind.Name(dev.kind).removeprefix("DEVICE_KIND_")
    memory_mib = float(dev.memory_total_mib)
    return {
        "kind": kind_name,
        "vendor": dev.vendor.lower(),
        "model": dev.model,
        "memory_mib": memory_mib,
        "memory_gib": memory_mib / 1024.0,
        "tflops_fp32": dev.tflops_fp32,
        "tflops_fp16": dev.tflops_fp16,
        "tflops_int8": dev.tflops_int8,
        "power_tdp_watts": dev.power_tdp_watts,
        "declared": dev.provenance == resources_pb2.PROVENANCE_DECLARED,
        "attributes": dict(dev.attributes),
    }
