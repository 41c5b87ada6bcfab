"""Hypothesis strategies for placement: random site views and random task demands.

CPU amounts are multiples of 0.5 so that every division the plugins do is exact in binary
floating point; properties then test placement logic, not rounding. Demands often copy a free
device some site has, so that accelerator placements succeed often enough to matter.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from federation.api.v1 import jobs_pb2, resources_pb2
from federation.placement.snapshot import SiteInput

DOMAINS = (resources_pb2.DOMAIN_EDGE, resources_pb2.DOMAIN_DATACENTER, resources_pb2.DOMAIN_CLOUD)
REGIONS = ("eu-west", "us-east", "ap-south")
KINDS = (resources_pb2.DEVICE_KIND_GPU, resources_pb2.DEVICE_KIND_NPU)
VENDORS = ("nvidia", "amd", "huawei")
MODELS = ("H100", "A100", "MI300", "910B")
DEVICE_MEMORY_MIB = (16384, 40960, 81920)
HEALTHS = (
    resources_pb2.DEVICE_HEALTH_HEALTHY,
    resources_pb2.DEVICE_HEALTH_HEALTHY,
    resources_pb2.DEVICE_HEALTH_HEALTHY,
    resources_pb2.DEVICE_HEALTH_DEGRADED,
    resources_pb2.DEVICE_HEALTH_UNHEALTHY,
)
LABELS = {"zone": ("a", "b"), "net": ("ib", "eth")}
SITE_NAMES = st.text(alphabet="abcdefghij", min_size=1, max_size=5)


@st.composite
def devices(draw: st.DrawFn) -> resources_pb2.Device:
    return resources_pb2.Device(
        kind=draw(st.sampled_from(KINDS)),
        vendor=draw(st.sampled_from(VENDORS)),
        model=draw(st.sampled_from(MODELS)),
        memory_total_mib=draw(st.sampled_from(DEVICE_MEMORY_MIB)),
        allocated=draw(st.sampled_from((False, False, True))),
        health=draw(st.sampled_from(HEALTHS)),
    )


@st.composite
def node_labels(draw: st.DrawFn) -> dict[str, str]:
    keys = draw(st.lists(st.sampled_from(sorted(LABELS)), unique=True))
    return {k: draw(st.sampled_from(LABELS[k])) for k in keys}


@st.composite
def nodes(draw: st.DrawFn, name: str) -> resources_pb2.Node:
    return resources_pb2.Node(
        name=name,
        cpu_free=draw(st.sampled_from((0.0, 1.5, 2.0, 4.0, 8.0, 16.0))),
        memory_free_mib=draw(st.sampled_from((0, 8192, 16384, 65536))),
        schedulable=draw(st.sampled_from((True, True, True, False))),
        labels=draw(node_labels()),
        devices=draw(st.lists(devices(), max_size=8)),
    )


@st.composite
def site_views(draw: st.DrawFn, name: str) -> resources_pb2.SiteView:
    n_nodes = draw(st.sampled_from((0, 1, 1, 2, 2, 3)))
    return resources_pb2.SiteView(
        site=name,
        domain=draw(st.sampled_from(DOMAINS)),
        region=draw(st.sampled_from(REGIONS)),
        nodes=[draw(nodes(f"node-{i}")) for i in range(n_nodes)],
    )


@st.composite
def site_inputs(draw: st.DrawFn, min_size: int = 0, max_size: int = 6) -> list[SiteInput]:
    """Sites with distinct names, mostly connected and uncordoned."""
    names = draw(st.lists(SITE_NAMES, min_size=min_size, max_size=max_size, unique=True))
    return [
        SiteInput(
            view=draw(site_views(name)),
            is_connected=draw(st.sampled_from((True,) * 7 + (False,))),
            is_cordoned=draw(st.sampled_from((False,) * 7 + (True,))),
        )
        for name in names
    ]


@st.composite
def accelerator_requests(draw: st.DrawFn) -> jobs_pb2.AcceleratorRequest:
    return jobs_pb2.AcceleratorRequest(
        kind=draw(st.sampled_from(KINDS)),
        count=draw(st.sampled_from((1, 1, 2, 4))),
        models=draw(st.just([]) | st.lists(st.sampled_from(MODELS), max_size=2, unique=True)),
        vendor=draw(st.sampled_from(("", "", "", *VENDORS))),
        min_memory_mib=draw(st.sampled_from((0, 0, 0, *DEVICE_MEMORY_MIB))),
    )


@st.composite
def task_specs(draw: st.DrawFn, name: str = "main") -> jobs_pb2.TaskSpec:
    resources = jobs_pb2.ResourceRequest(
        cpu=draw(st.sampled_from((0.0, 0.5, 1.0, 2.0, 4.0))),
        memory_mib=draw(st.sampled_from((0, 512, 1024, 4096))),
    )
    if draw(st.booleans()):
        resources.accelerator.CopyFrom(draw(accelerator_requests()))
    return jobs_pb2.TaskSpec(
        name=name,
        command=["python", "train.py"],
        replicas=draw(st.sampled_from((0, 1, 1, 2, 4))),
        resources=resources,
    )


@st.composite
def job_specs(draw: st.DrawFn, site_names: tuple[str, ...] = ()) -> jobs_pb2.JobSpec:
    """A job with one to three tasks and optional constraints (sites from ``site_names``)."""
    n_tasks = draw(st.integers(1, 3))
    constraints = jobs_pb2.Constraints(
        domains=draw(st.just([]) | st.lists(st.sampled_from(DOMAINS), max_size=2, unique=True)),
        regions=draw(st.just([]) | st.lists(st.sampled_from(REGIONS), max_size=2, unique=True)),
        node_labels=draw(st.one_of(st.just({}), node_labels())),
    )
    if site_names and draw(st.integers(0, 3)) == 0:
        constraints.sites.extend(
            draw(st.lists(st.sampled_from(site_names), min_size=1, max_size=2, unique=True))
        )
    return jobs_pb2.JobSpec(
        name="job",
        tasks=[draw(task_specs(f"task-{i}")) for i in range(n_tasks)],
        constraints=constraints,
    )


@dataclass(frozen=True)
class PlacementCase:
    """Sites plus one task of a job to place on them."""

    sites: list[SiteInput]
    job: jobs_pb2.JobSpec
    task: jobs_pb2.TaskSpec


@st.composite
def placement_cases(draw: st.DrawFn, max_sites: int = 6) -> PlacementCase:
    """Sites and a task; an accelerator demand often copies a device that some site has."""
    sites = draw(site_inputs(min_size=1, max_size=max_sites))
    job = draw(job_specs(tuple(s.view.site for s in sites)))
    task = job.tasks[draw(st.integers(0, len(job.tasks) - 1))]
    existing = [
        d
        for s in sites
        for n in s.view.nodes
        for d in n.devices
        if d.health == resources_pb2.DEVICE_HEALTH_HEALTHY and not d.allocated
    ]
    acc = task.resources.accelerator
    if acc.count and existing and draw(st.booleans()):
        like = draw(st.sampled_from(existing))
        acc.kind = like.kind
        acc.vendor = draw(st.sampled_from(("", like.vendor)))
        del acc.models[:]
        acc.models.extend(draw(st.sampled_from(([], [like.model]))))
        acc.min_memory_mib = draw(st.sampled_from((0, like.memory_total_mib)))
    return PlacementCase(sites, job, task)
