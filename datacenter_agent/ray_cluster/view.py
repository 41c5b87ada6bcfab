"""Ray's nodes, turned into the federation's nodes: CPU, memory and named devices.

Ray counts devices (``GPU: 4``, ``GPU_A100: 2``) without naming them; the view names each one
``RESOURCE-INDEX`` on its node, as the Slurm view names GRES devices, and the core keeps which
of them its placement groups hold. A node is named and addressed in Ray by its IP (its
``node:IP`` resource), a node an elastic site launched by the site's name for it and its Ray
node id (the ``ray.io/node-id`` label: launched nodes may share an IP).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from federation.agent.config import RayDevice
from federation.agent.usage import Slot
from federation.api.v1 import jobs_pb2, resources_pb2

KINDS: dict[str, resources_pb2.DeviceKind.ValueType] = {
    "gpu": resources_pb2.DEVICE_KIND_GPU,
    "npu": resources_pb2.DEVICE_KIND_NPU,
    "mlu": resources_pb2.DEVICE_KIND_MLU,
    "fpga": resources_pb2.DEVICE_KIND_FPGA,
    "dpu": resources_pb2.DEVICE_KIND_DPU,
}
NODE_ID_LABEL = "ray.io/node-id"
"""Ray's label naming a node by its id, which a bundle's label selector can pin it to."""
RESOURCE_ATTRIBUTE = "ray_resource"
"""The device attribute naming the Ray resource that counts it."""
_MIB = 1024 * 1024


def ray_nodes(
    records: list[dict[str, Any]],
    devices: Mapping[str, RayDevice],
    names: Mapping[str, str] | None = None,
) -> list[resources_pb2.Node]:
    """The live nodes of ``ray.nodes()``, each with its devices named, all free; named by
    their IP, or as ``names`` (Ray node id → name) says."""
    nodes = []
    for record in records:
        if not record.get("Alive"):
            continue
        resources: dict[str, float] = record.get("Resources", {})
        address = record["NodeManagerAddress"]
        cpus = float(resources.get("CPU", 0.0))
        memory_mib = int(resources.get("memory", 0.0) // _MIB)
        node = resources_pb2.Node(
            name=(names or {}).get(record["NodeID"], address),
            cpu_cores=cpus,
            cpu_free=cpus,
            memory_mib=memory_mib,
            memory_free_mib=memory_mib,
            labels={"ray_node_id": record["NodeID"]},
            schedulable=True,
            provenance=resources_pb2.PROVENANCE_DISCOVERED,
        )
        for resource, described in sorted(devices.items()):
            for index in range(int(resources.get(resource, 0.0))):
                node.devices.append(
                    resources_pb2.Device(
                        id=f"{resource}-{index}",
                        index=index,
                        kind=KINDS[described.kind],
                        vendor=described.vendor,
                        model=described.model or resource,
                        memory_total_mib=described.memory_mib,
                        memory_free_mib=described.memory_mib,
                        health=resources_pb2.DEVICE_HEALTH_HEALTHY,
                        provenance=resources_pb2.PROVENANCE_DECLARED
                        if described.declared
                        else resources_pb2.PROVENANCE_DISCOVERED,
                        attributes={**described.attributes, RESOURCE_ATTRIBUTE: resource},
                    )
                )
        nodes.append(node)
    return nodes


def bundle(
    node: resources_pb2.Node,
    cpu: float,
    memory_mib: int,
    positions: tuple[int, ...],
    *,
    by_ip: bool = True,
) -> dict[str, float]:
    """One replica's Ray bundle, pinned to ``node`` (``by_ip``: through its ``node:IP``
    resource; else the caller pins it by its id) so Ray holds the devices the view names."""
    wanted: dict[str, float] = {f"node:{node.name}": 0.001} if by_ip else {}
    if cpu > 0:
        wanted["CPU"] = cpu
    if memory_mib > 0:
        wanted["memory"] = float(memory_mib * _MIB)
    for pos in positions:
        resource = node.devices[pos].attributes[RESOURCE_ATTRIBUTE]
        wanted[resource] = wanted.get(resource, 0.0) + 1.0
    return wanted


def requested_bundle(spec: jobs_pb2.TaskSpec, devices: Mapping[str, RayDevice]) -> dict[str, float]:
    """The bundle a replica of ``spec`` asks Ray for where the view found no node for it,
    so that Ray's own word on the request is heard."""
    wanted: dict[str, float] = {"CPU": spec.resources.cpu} if spec.resources.cpu else {}
    acc = spec.resources.accelerator
    if acc.count:
        models = set(acc.models)
        resource = next(
            (r for r, d in sorted(devices.items()) if (d.model or r) in models),
            next(iter(sorted(devices)), "GPU"),
        )
        wanted[resource] = float(acc.count)
    return wanted or {"CPU": 0.001}


def bundles_on(
    nodes: Sequence[resources_pb2.Node],
    slots: Sequence[Slot],
    spec: jobs_pb2.TaskSpec,
    ray_node: Callable[[str], str],
) -> tuple[list[dict[str, float]], list[dict[str, str]]]:
    """Each replica's bundle on the node the view placed it on, and the label selectors that
    pin the bundles on launched nodes (which may share an IP; ``ray_node`` gives a launched
    node's Ray node id, "" for others); [] when none is."""
    by_name = {node.name: node for node in nodes}
    bundles, selectors = [], []
    for s in slots:
        ray_id = ray_node(s.node)
        cpu, memory = spec.resources.cpu, s.memory_mib
        bundles.append(bundle(by_name[s.node], cpu, memory, s.device_positions, by_ip=not ray_id))
        selectors.append({NODE_ID_LABEL: ray_id} if ray_id else {})
    return bundles, selectors if any(selectors) else []


def device_ids(nodes: Sequence[resources_pb2.Node], slots: Sequence[Slot]) -> list[list[str]]:
    """Each replica's devices, ``NODE:DEVICE``."""
    by_name = {node.name: node for node in nodes}
    return [
        [f"{s.node}:{by_name[s.node].devices[p].id}" for p in s.device_positions] for s in slots
    ]
