"""Which ``--gres`` to ask Slurm for, given what a task asks of its devices.

Slurm knows GRES names and types (``gpu:a100``), not models, vendors, memory or CEL selectors:
the core matches those against the devices of its view, one GRES type at a time, and asks
Slurm only for the types that fit (any type, untyped, when every type fits).
"""

from __future__ import annotations

from collections.abc import Iterable

from datacenter_agent.slurm.view import GRES_KINDS
from federation.agent.packing import describe_request, selectors
from federation.api.v1 import jobs_pb2, resources_pb2
from federation.placement.devices import device_attributes

_MIB_PER_GIB = 1024.0


def matches(device: resources_pb2.Device, acc: jobs_pb2.AcceleratorRequest) -> bool:
    """Whether ``device`` is of the kind, vendor, model, memory and selector asked for."""
    if acc.kind not in (resources_pb2.DEVICE_KIND_UNSPECIFIED, device.kind):
        return False
    if acc.vendor and acc.vendor.lower() != device.vendor.lower():
        return False
    if acc.models and device.model not in acc.models:
        return False
    if device.memory_total_mib < acc.min_memory_mib:
        return False
    if acc.selector:
        cel = selectors()
        try:
            return bool(cel.selector_matches(acc.selector, [device_attributes(device)])[0])
        except cel.SelectorError:
            return False  # a bad selector does not match
    return True


def gres_name(kind: resources_pb2.DeviceKind.ValueType) -> str:
    """The GRES name of a device kind (``gpu`` when unspecified)."""
    return next((name for name, k in GRES_KINDS.items() if k == kind), "gpu")


def gres_devices(nodes: Iterable[resources_pb2.Node], name: str) -> dict[str, resources_pb2.Device]:
    """One device of each GRES type named ``name`` (``gpu:a100`` -> an A100 of the view)."""
    by_type: dict[str, resources_pb2.Device] = {}
    for node in nodes:
        for device in node.devices:
            gres = device.attributes.get("slurm_gres", "")
            if gres.split(":")[0] == name:
                by_type.setdefault(gres, device)
    return by_type


def gres_options(
    acc: jobs_pb2.AcceleratorRequest, nodes: Iterable[resources_pb2.Node], partition: str
) -> list[str] | str:
    """The ``--gres`` values (without the count) to try, or why no device can match.

    Returns:
        ``[""]`` when no devices are asked for; ``["gpu"]`` when any type will do (or the
        partition shows none, so that Slurm itself answers); ``["gpu:a100", ...]`` for the
        fitting types; a reason when the partition has the GRES but no type fits.
    """
    if not acc.count:
        return [""]
    name = gres_name(acc.kind)
    by_type = gres_devices(nodes, name)
    if not by_type:
        return [name]
    fitting = sorted(gres for gres, device in by_type.items() if matches(device, acc))
    if not fitting:
        have = ", ".join(f"{g} ({d.model})" for g, d in sorted(by_type.items()))
        return f"no {name} type in partition {partition} is {describe_request(acc)}; it has {have}"
    return [name] if len(fitting) == len(by_type) else fitting
