"""What one task asks of a site, distilled from its spec for placement."""

from __future__ import annotations

from dataclasses import dataclass

from federation.api.v1 import jobs_pb2


@dataclass(frozen=True, slots=True)
class Request:
    """Per-replica demand of one task plus the job's constraints."""

    replicas: int
    cpu: float
    memory_mib: float
    accelerator_kind: int
    accelerator_count: int
    accelerator_models: frozenset[str]
    accelerator_vendor: str
    accelerator_min_memory_mib: float
    domains: frozenset[int]
    regions: frozenset[str]
    sites: frozenset[str]
    node_labels: tuple[tuple[str, str], ...]

    @classmethod
    def from_spec(cls, job: jobs_pb2.JobSpec, task: jobs_pb2.TaskSpec) -> Request:
        acc = task.resources.accelerator
        constraints = job.constraints
        return cls(
            replicas=max(1, task.replicas),
            cpu=task.resources.cpu,
            memory_mib=float(task.resources.memory_mib),
            accelerator_kind=acc.kind,
            accelerator_count=acc.count,
            accelerator_models=frozenset(acc.models),
            accelerator_vendor=acc.vendor,
            accelerator_min_memory_mib=float(acc.min_memory_mib),
            domains=frozenset(constraints.domains),
            regions=frozenset(constraints.regions),
            sites=frozenset(constraints.sites),
            node_labels=tuple(sorted(constraints.node_labels.items())),
        )
