"""What one task asks of a site, distilled from its spec for placement."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from federation.api.v1 import jobs_pb2


@dataclass(frozen=True, slots=True)
class Input:
    """Data a task reads: ``bytes`` of ``dataset``, at ``site`` (and its copies at ``also``)
    or wherever it is held."""

    dataset: str
    bytes: int
    site: str = ""
    also: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Request:
    """Per-replica demand of one task plus the job's constraints and objective (hashable)."""

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
    fraction: float = 0.0
    share_memory_mib: float = 0.0
    """With ``fraction``: device memory the share needs."""
    partition: str = ""
    selector: str = ""
    same_interconnect: bool = False
    requires: tuple[tuple[str, str], ...] = ()
    inputs: tuple[Input, ...] = ()
    duration_s: float = 0.0
    workload_class: str = "training"
    speed: tuple[tuple[str, float], ...] = ()
    max_cost_usd: float = 0.0
    deadline_s: float = 0.0
    near_region: str = ""
    """A service's ``near_region``: sites are ranked by their RTT to it first (``NearRegion``)."""
    topology_required: str = ""
    """Every replica at one value of this node label (``TopologyRequest.required``)."""
    image: str = ""
    """The OCI image the task runs in ("": none): sites that refuse images are filtered out
    (``ImagePolicy``), and pulling it counts in the transfer time (``estimates``)."""
    sequence: int = 0
    """Arrival order of the task, for policies that take turns (the simulator sets it)."""

    @property
    def wants_accelerator(self) -> bool:
        return bool(self.accelerator_count or self.fraction or self.partition)

    @property
    def devices_per_replica(self) -> float:
        """Device-equivalents one replica holds (for cost and energy)."""
        if self.accelerator_count:
            return float(self.accelerator_count)
        return self.fraction if self.fraction else (1.0 if self.partition else 0.0)

    @classmethod
    def from_spec(
        cls,
        job: jobs_pb2.JobSpec,
        task: jobs_pb2.TaskSpec,
        inputs: Sequence[Input] | None = None,
    ) -> Request:
        """Build a request; ``inputs`` replaces the spec's (the scheduler resolves task outputs).

        Of the job it reads only the constraints and the objective: the scheduler remembers
        requests by those, the task spec and the inputs.
        """
        acc = task.resources.accelerator
        constraints = job.constraints
        if inputs is None:
            inputs = [Input(i.dataset, i.bytes, i.site) for i in task.inputs]
        return cls(
            replicas=max(1, task.replicas),
            cpu=task.resources.cpu,
            memory_mib=float(task.resources.memory_mib),
            accelerator_kind=acc.kind,
            accelerator_count=acc.count,
            accelerator_models=frozenset(acc.models),
            accelerator_vendor=acc.vendor.lower(),
            accelerator_min_memory_mib=float(acc.min_memory_mib),
            domains=frozenset(constraints.domains),
            regions=frozenset(constraints.regions),
            sites=frozenset(constraints.sites),
            node_labels=tuple(sorted(constraints.node_labels.items())),
            fraction=acc.fraction,
            share_memory_mib=float(acc.memory_mib),
            partition=acc.partition,
            selector=acc.selector,
            same_interconnect=acc.same_interconnect,
            requires=tuple(sorted(task.requires.items())),
            inputs=tuple(inputs),
            duration_s=task.estimated_duration_s,
            workload_class=task.workload_class or "training",
            speed=tuple(sorted(task.speed.items())),
            max_cost_usd=job.objective.max_cost_usd,
            deadline_s=job.objective.deadline_s,
            near_region=task.service.near_region,  # submit allows a service policy on services only
            topology_required=task.topology.required,
            image=task.image,
        )
