"""What the federation has, per domain and device model, and what a caller's jobs hold of it.

A tenant's view of the fleet: totals, health and room across the sites that take work now
(connected, not cordoned), with no site's name and no other tenant's job in it; ``yours`` is
what the caller's own tasks hold (an operator's: every job's).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from federation.api.v1 import job_service_pb2, jobs_pb2, resources_pb2
from federation.common import job_state
from federation.coordinator.jobs.manager import visible_to
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.sites.registry import SiteRegistry
from federation.jobspec import domain_name, kind_name
from federation.resources import booked_share
from federation.security.identity import Identity

Key = tuple[str, str, str]
"""(domain, kind, model)."""
CPU = "CPU"


def capacity_rows(
    sites: SiteRegistry, jobs: JobRepository, caller: Identity
) -> list[job_service_pb2.CapacityRow]:
    rows: dict[Key, job_service_pb2.CapacityRow] = {}
    seen: defaultdict[Key, set[str]] = defaultdict(set)

    def row(key: Key) -> job_service_pb2.CapacityRow:
        if key not in rows:
            rows[key] = job_service_pb2.CapacityRow(domain=key[0], kind=key[1], model=key[2])
        return rows[key]

    for name in sites.names():
        entry = sites.get(name)
        if entry.view is None or entry.session is None or entry.record.cordoned:
            continue
        domain = domain_name(entry.record.domain)
        for node in entry.view.nodes():
            cpu = row((domain, CPU, ""))
            cpu.total += node.cpu_cores
            cpu.healthy += node.cpu_cores if node.schedulable else 0.0
            cpu.free += max(0.0, node.cpu_free)
            seen[(domain, CPU, "")].add(name)
            for device in node.devices:
                key = (domain, kind_name(device.kind), device.model)
                counted = row(key)
                counted.total += 1
                counted.healthy += device.health == resources_pb2.DEVICE_HEALTH_HEALTHY
                counted.free += 1.0 - booked_share(device)
                seen[key].add(name)
    visible = visible_to(caller)
    for job in jobs.at_site():
        if visible(job):
            _count_held(job, sites, row)
    for key, names in seen.items():
        rows[key].sites = len(names)
    return [rows[key] for key in sorted(rows)]


def _count_held(
    job: jobs_pb2.Job,
    sites: SiteRegistry,
    row: Callable[[Key], job_service_pb2.CapacityRow],
) -> None:
    """Add what ``job``'s tasks at sites hold to the rows' ``yours``."""
    specs = {spec.name: spec for spec in job.spec.tasks}
    for task in job.tasks:
        if task.state not in job_state.AT_SITE or not task.site:
            continue
        domain = sites.domain_of(task.site)
        spec = specs.get(task.name)
        if spec is None or not domain:
            continue
        replicas = max(1, spec.replicas)
        row((domain, CPU, "")).yours += spec.resources.cpu * replicas
        share = spec.resources.accelerator.fraction or 1.0
        for label in task.devices:  # "node:KIND:index", the site's own names
            models = sites.device_models(task.site, [label])
            if models and label.count(":") >= 2:
                row((domain, label.split(":")[1], models[0])).yours += share
