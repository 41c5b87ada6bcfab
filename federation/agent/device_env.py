"""What a replica's environment says about the devices it holds.

``FEDERATION_DEVICES`` names them (``node:KIND:index``, with ``/profile`` for a partition slot);
the vendor's visibility variables confine the runtime to them; a share adds
``FEDERATION_DEVICE_FRACTION`` (and, on NVIDIA GPUs, the MPS thread limit) and a partition slot
adds ``FEDERATION_PARTITION``.
"""

from __future__ import annotations

import math

from federation.agent.discovery import device_kind_name
from federation.agent.usage import EPSILON, Slot
from federation.api.v1 import resources_pb2

SHARING_VARS = ("FEDERATION_DEVICE_FRACTION", "FEDERATION_PARTITION")
"""Set only for a share or a slot: a task's own env must not set them for whole devices."""

# Variables that confine a vendor's runtime to the replica's devices.
_VISIBILITY_VARS = {
    ("nvidia", resources_pb2.DEVICE_KIND_GPU): ("CUDA_VISIBLE_DEVICES",),
    ("amd", resources_pb2.DEVICE_KIND_GPU): ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"),
    ("huawei", resources_pb2.DEVICE_KIND_NPU): ("ASCEND_RT_VISIBLE_DEVICES",),
    ("cambricon", resources_pb2.DEVICE_KIND_MLU): ("MLU_VISIBLE_DEVICES",),
}


def device_labels(node: resources_pb2.Node, slot: Slot) -> list[str]:
    """The slot's devices as ``"node:KIND:index"``, or ``"node:KIND:index/profile"``."""
    suffix = f"/{slot.partition}" if slot.partition else ""
    return [
        f"{node.name}:{device_kind_name(node.devices[pos].kind)}:{node.devices[pos].index}{suffix}"
        for pos in slot.device_positions
    ]


def visibility_env(node: resources_pb2.Node, slot: Slot) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES`` and its kin for the slot's devices (whole, shared or cut).

    A variable is set, possibly empty, for every runtime whose devices the node has, so a
    replica cannot use devices it was not given just by leaving the variable out.
    """
    held = [node.devices[pos] for pos in slot.device_positions]
    env: dict[str, str] = {}
    for (vendor, kind), names in _VISIBILITY_VARS.items():
        if any(d.vendor.lower() == vendor and d.kind == kind for d in node.devices):
            indices = [str(d.index) for d in held if d.vendor.lower() == vendor and d.kind == kind]
            if slot.instance and indices:
                indices = [slot.instance]  # the runtime then sees that instance alone
            env.update(dict.fromkeys(names, ",".join(indices)))
    return env


def mps_thread_percentage(fraction: float) -> int:
    """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` for a share: fraction x 100 rounded down, >= 1."""
    return max(1, math.floor(fraction * 100 + EPSILON))


def sharing_env(node: resources_pb2.Node, slot: Slot) -> dict[str, str]:
    """``FEDERATION_DEVICE_FRACTION`` (and ``FEDERATION_DEVICE_MEMORY_MIB``) and the MPS
    limits for a share; ``FEDERATION_PARTITION``.

    Empty for whole devices. The MPS limits cap the share of SMs and the device memory a client
    of an MPS server may use; they have no effect without one, and are set for NVIDIA GPUs only.
    """
    if slot.partition:
        return {"FEDERATION_PARTITION": slot.partition}
    if not slot.fraction:
        return {}
    env = {"FEDERATION_DEVICE_FRACTION": f"{slot.fraction:g}"}
    if slot.device_memory_mib:
        env["FEDERATION_DEVICE_MEMORY_MIB"] = str(slot.device_memory_mib)
    held = [node.devices[pos] for pos in slot.device_positions]
    if any(d.vendor.lower() == "nvidia" and d.kind == resources_pb2.DEVICE_KIND_GPU for d in held):
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(mps_thread_percentage(slot.fraction))
        if slot.device_memory_mib:
            # Per visible device, as MPS reads it: the share sees its device as 0.
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={slot.device_memory_mib}M"
    return env


def device_env(node: resources_pb2.Node, slot: Slot) -> dict[str, str]:
    """Every device variable of one replica: its labels, visibility and share or slot."""
    env = {"FEDERATION_DEVICES": ",".join(device_labels(node, slot))}
    env.update(visibility_env(node, slot))
    env.update(sharing_env(node, slot))
    return env
