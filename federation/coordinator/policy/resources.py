"""The resources a task holds while placed or running, as quotas count them."""

from __future__ import annotations

import re
from collections.abc import Mapping

from federation.api.v1 import jobs_pb2, resources_pb2

CPU = "cpu"
MEMORY = "memory_mib"
KINDS = {
    resources_pb2.DEVICE_KIND_GPU: "gpu",
    resources_pb2.DEVICE_KIND_NPU: "npu",
    resources_pb2.DEVICE_KIND_MLU: "mlu",
    resources_pb2.DEVICE_KIND_FPGA: "fpga",
    resources_pb2.DEVICE_KIND_DPU: "dpu",
}
_RESOURCE_RE = re.compile(rf"^(?:{CPU}|{MEMORY}|(?:{'|'.join(KINDS.values())})(?:/[\w.\-]+)?)$")

Demand = Mapping[str, float]


def resource_problem(resource: str) -> str | None:
    """Why ``resource`` is not a resource a quota can name, or None."""
    if _RESOURCE_RE.fullmatch(resource):
        return None
    kinds = ", ".join(KINDS.values())
    return (
        f"unknown resource {resource[:64]!r}: use cpu, memory_mib, a device kind ({kinds}) "
        "or a kind and model such as gpu/A100-80GB"
    )


def demand(task: jobs_pb2.TaskSpec) -> dict[str, float]:
    """What ``task`` holds with all its replicas: cores, memory, devices of its kind (a share
    counts as its fraction), and devices of its model when it accepts one model only."""
    replicas = task.replicas or 1
    res = task.resources
    out = {CPU: res.cpu * replicas, MEMORY: float(res.memory_mib * replicas)}
    acc = res.accelerator
    devices = acc.count or acc.fraction or (1.0 if acc.partition else 0.0)
    if devices and acc.kind in KINDS:
        kind = KINDS[acc.kind]
        out[kind] = devices * replicas
        if len(acc.models) == 1:
            out[f"{kind}/{acc.models[0]}"] = devices * replicas
    return out


def capacity(view_nodes: list[resources_pb2.Node]) -> dict[str, float]:
    """What nodes have of each resource: what dominant shares are shares of."""
    out: dict[str, float] = {}
    for node in view_nodes:
        out[CPU] = out.get(CPU, 0.0) + node.cpu_cores
        out[MEMORY] = out.get(MEMORY, 0.0) + node.memory_mib
        for device in node.devices:
            if device.kind in KINDS:
                kind = KINDS[device.kind]
                out[kind] = out.get(kind, 0.0) + 1
                model = f"{kind}/{device.model}"
                out[model] = out.get(model, 0.0) + 1
    return out
