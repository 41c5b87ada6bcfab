"""Small builders for hand-written placement tables: sites, nodes, devices and requests."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from federation.api.v1 import jobs_pb2, resources_pb2
from federation.placement.request import Request
from federation.placement.snapshot import SiteInput, Snapshot, build_snapshot

GPU = resources_pb2.DEVICE_KIND_GPU
NPU = resources_pb2.DEVICE_KIND_NPU
EDGE = resources_pb2.DOMAIN_EDGE
DATACENTER = resources_pb2.DOMAIN_DATACENTER
CLOUD = resources_pb2.DOMAIN_CLOUD
HEALTHY = resources_pb2.DEVICE_HEALTH_HEALTHY


def device(
    kind: int = GPU,
    *,
    vendor: str = "nvidia",
    model: str = "H100",
    memory_mib: int = 81920,
    allocated: bool = False,
    health: int = HEALTHY,
) -> resources_pb2.Device:
    return resources_pb2.Device(
        kind=kind,  # type: ignore[arg-type]
        vendor=vendor,
        model=model,
        memory_total_mib=memory_mib,
        allocated=allocated,
        health=health,  # type: ignore[arg-type]
    )


def node(
    name: str = "n0",
    *,
    cpu: float = 16.0,
    memory_mib: int = 65536,
    devices: Iterable[resources_pb2.Device] = (),
    labels: Mapping[str, str] | None = None,
    schedulable: bool = True,
) -> resources_pb2.Node:
    return resources_pb2.Node(
        name=name,
        cpu_free=cpu,
        memory_free_mib=memory_mib,
        devices=list(devices),
        labels=dict(labels or {}),
        schedulable=schedulable,
    )


def site(
    name: str,
    *nodes: resources_pb2.Node,
    domain: int = DATACENTER,
    region: str = "eu-west",
    connected: bool = True,
    cordoned: bool = False,
) -> SiteInput:
    view = resources_pb2.SiteView(
        site=name,
        domain=domain,  # type: ignore[arg-type]
        region=region,
        nodes=list(nodes),
    )
    return SiteInput(view=view, is_connected=connected, is_cordoned=cordoned)


def snapshot(*sites: SiteInput) -> Snapshot:
    return build_snapshot(list(sites))


def request(
    *,
    cpu: float = 0.0,
    memory_mib: int = 0,
    replicas: int = 1,
    kind: int = 0,
    count: int = 0,
    models: Iterable[str] = (),
    vendor: str = "",
    min_memory_mib: int = 0,
    domains: Iterable[int] = (),
    regions: Iterable[str] = (),
    sites: Iterable[str] = (),
    node_labels: Mapping[str, str] | None = None,
) -> Request:
    """A placement request built the way the scheduler builds one: from a job and task spec."""
    task = jobs_pb2.TaskSpec(
        name="main",
        command=["run"],
        replicas=replicas,
        resources=jobs_pb2.ResourceRequest(cpu=cpu, memory_mib=memory_mib),
    )
    if count or kind:
        task.resources.accelerator.CopyFrom(
            jobs_pb2.AcceleratorRequest(
                kind=kind,  # type: ignore[arg-type]
                count=count,
                models=list(models),
                vendor=vendor,
                min_memory_mib=min_memory_mib,
            )
        )
    job = jobs_pb2.JobSpec(
        name="job",
        tasks=[task],
        constraints=jobs_pb2.Constraints(
            domains=list(domains),  # type: ignore[arg-type]
            regions=list(regions),
            sites=list(sites),
            node_labels=dict(node_labels or {}),
        ),
    )
    return Request.from_spec(job, job.tasks[0])
