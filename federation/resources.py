"""The resources the federation counts (quotas, fair share, a site owner's share), by name:
``cpu`` cores, ``memory_mib``, devices by kind (``gpu``) and by kind and model
(``gpu/A100-80GB``). Sites and the coordinator both name them so."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from federation.api.v1 import resources_pb2

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


def resource_problem(resource: str) -> str | None:
    """Why ``resource`` is not a resource a quota or a site's owner share can name, or None."""
    if _RESOURCE_RE.fullmatch(resource):
        return None
    kinds = ", ".join(KINDS.values())
    return (
        f"unknown resource {resource[:64]!r}: use cpu, memory_mib, a device kind ({kinds}) "
        "or a kind and model such as gpu/A100-80GB"
    )


def add(into: dict[str, float], holds: Iterable[tuple[str, float]]) -> dict[str, float]:
    """Add ``holds`` (resource, amount) to ``into`` and return it."""
    for resource, amount in holds:
        into[resource] = into.get(resource, 0.0) + amount
    return into


def capacity(view_nodes: Iterable[resources_pb2.Node]) -> dict[str, float]:
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


def owner_share_refusal(
    share: resources_pb2.OwnerShare,
    tenant: str,
    taking: Mapping[str, float],
    guests: Mapping[str, float],
    total: Mapping[str, float],
) -> str | None:
    """Why a task of ``tenant`` that would hold ``taking`` at a site may not, by the site's
    owner ``share``: the other tenants' tasks (``guests`` hold so much now) may together hold
    only what the share leaves of the site's ``total``. None when it may."""
    if tenant in share.tenants:
        return None
    for resource, keep in sorted(share.keep.items()):
        want = taking.get(resource, 0.0)
        if not want:
            continue
        left = max(0.0, total.get(resource, 0.0) - keep)
        held = guests.get(resource, 0.0)
        if held + want > left + 1e-9:
            return (
                f"the site keeps {keep:g} {resource} for its owner's tenants: other tenants "
                f"hold {held:g} of the {left:g} left to them; this task needs {want:g}"
            )
    return None


def booked_share(device: resources_pb2.Device) -> float:
    """How much of the device tasks booked, in [0, 1]: whole, by shares or by MIG slots."""
    if device.allocated:
        return 1.0
    share = 1.0 - device.free_fraction if device.shareable else 0.0
    if share > 1e-9:
        # Shares are out, so the device's slots are closed to tasks (one mode at a time), not
        # taken: the shares alone say how much is booked.
        return min(share, 1.0)
    for profile in device.partitions:
        if profile.total:
            share = max(share, (profile.total - profile.free) / profile.total)
    return min(max(share, 0.0), 1.0)
