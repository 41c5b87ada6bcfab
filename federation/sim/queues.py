"""Queues, quotas, fair share and priority classes in the replay: the coordinator's own.

The topology's ``queues`` are checked by ``queue_violations`` and its ``priority_classes`` read
by ``parse_priority_classes``; trace rows are checked as the submit path checks job specs
(``Sharing.spec_violations``). During a replay the coordinator's ``Sharing`` decides, over a
``QueueUsage`` fed with job records that the replay keeps up to date: the line
(``Sharing.order``: urgent jobs first, then the queues by weighted dominant share), quotas
(``Sharing.admission``), which queues owe back borrowed quota (``Sharing.lenders``), and who
may preempt whom.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import numpy.typing as npt

from federation.api.v1 import jobs_pb2, queues_pb2, resources_pb2
from federation.common import job_state
from federation.coordinator.jobs.records import LineKey, line_order
from federation.coordinator.policy.fair_share import dominant_share
from federation.coordinator.policy.queues import QueueTable
from federation.coordinator.policy.quota import Debt
from federation.coordinator.policy.resources import Demand, demand
from federation.coordinator.policy.sharing import Sharing
from federation.coordinator.policy.usage import QueueUsage
from federation.resources import capacity
from federation.sim.fields import InputFileError
from federation.sim.topology import Topology
from federation.sim.trace import TraceTask

F64 = npt.NDArray[np.float64]
NO_QUEUE = "(no queue)"
"""How the figures name the jobs that wait in no queue."""
INT32 = 2**31
"""A job's priority is an int32 in its spec."""


def sharing_of(topology: Topology) -> Sharing:
    """The coordinator's ``Sharing`` over the topology's queues and classes, and no usage."""
    return Sharing(QueueTable(topology.queues), QueueUsage(), topology.priority_classes)


def resolve(tasks: Sequence[TraceTask], topology: Topology, source: str) -> list[TraceTask]:
    """Check each row's tenant, queue and priority class as the submit path checks a job
    spec, naming the line; fill in the queue (a tenant's only one), the tenant (the queue's)
    and the priority its class sets."""
    named = any(t.tenant or t.queue or t.priority_class for t in tasks)
    if not (named or topology.queues or topology.priority_classes):
        return list(tasks)
    sharing = sharing_of(topology)
    queues = topology.queues
    out = []
    for t in tasks:
        where = f"{source}:{t.line}: column"
        queue, tenant = t.queue, t.tenant
        if tenant and not queue:
            owned = sorted(q.name for q in queues.values() if q.tenant == tenant)
            if len(owned) != 1:
                listing = f"owns {', '.join(owned)}" if owned else "owns no queue"
                raise InputFileError(f"{where} 'queue': needed: tenant {tenant!r} {listing}")
            queue = owned[0]
        if queue and queue not in queues:
            raise InputFileError(
                f"{where} 'queue': unknown queue {queue!r} "
                f"(queues in the topology: {', '.join(sorted(queues)) or 'none'})"
            )
        tenant = tenant or (queues[queue].tenant if queue else "")
        if not -INT32 <= t.priority < INT32:
            raise InputFileError(f"{where} 'priority': must fit in 32 bits, got {t.priority}")
        spec = jobs_pb2.JobSpec(queue=queue, priority=t.priority, priority_class=t.priority_class)
        # A row with a tenant is that tenant's submission; without one, an operator's.
        for problem in sharing.spec_violations(spec, tenant, "job", by_tenant=bool(tenant)):
            column = problem.field.rsplit(".", 1)[-1]
            raise InputFileError(f"{where} {column!r}: {problem.description}")
        priority = sharing.priority_of(spec)
        out.append(dataclasses.replace(t, queue=queue, tenant=tenant, priority=priority))
    return out


def jain_index(values: Iterable[float]) -> float | None:
    """Jain's fairness index, (sum x)^2 / (n sum x^2): 1 when all are equal, 1/n when one
    has everything; None when there is nothing to compare."""
    x = np.asarray(list(values), dtype=np.float64)
    square = float((x * x).sum())
    return float(x.sum() ** 2 / (len(x) * square)) if square > 0 else None


@dataclass(slots=True)
class Tally:
    """What a replay with queues leaves for the figures, per tenant."""

    tenants: tuple[str, ...]
    """Tenants of the queues the trace names, by name; then ``NO_QUEUE`` if some job has none."""
    weights: F64
    """Per tenant, the weights of its queues that are not under another of its own, summed."""
    fair: npt.NDArray[np.bool_]
    """Per tenant, whether fair share applies (not ``NO_QUEUE``)."""
    tenant_of: list[int]
    """Per task, its tenant's number."""
    share_s: F64
    """Per tenant, its dominant share integrated over the contended time."""
    contended_s: float = 0.0
    """Time during which every tenant (but ``NO_QUEUE``) had some task waiting."""


class Shares:
    """The replay's queues: a job record per trace job, kept in step with its tasks, that
    the coordinator's ``Sharing`` and ``QueueUsage`` read."""

    def __init__(
        self, topology: Topology, tasks: Sequence[TraceTask], nodes: list[resources_pb2.Node]
    ) -> None:
        self.queues = topology.queues
        self.usage = QueueUsage()
        self.sharing = Sharing(QueueTable(topology.queues), self.usage, topology.priority_classes)
        self.capacity = capacity(nodes)
        """What the federation has: what dominant shares are shares of."""
        jobs: dict[str, jobs_pb2.Job] = {}
        self.job: list[jobs_pb2.Job] = []
        self.slot: list[int] = []
        """Per task, its number among its job's tasks."""
        for t in tasks:
            job = jobs.get(t.job_id)
            if job is None:
                job = jobs[t.job_id] = jobs_pb2.Job(id=t.job_id)
                job.spec.queue, job.spec.priority_class = t.queue, t.priority_class
                job.spec.priority = t.priority
                job.created_at.FromNanoseconds(round(t.submit_s * 1e9))
            job.spec.priority = max(job.spec.priority, t.priority)  # as the figures take it
            self.slot.append(len(job.tasks))
            job.spec.tasks.append(_spec(t))
            job.tasks.add(name=t.task, state=job_state.PENDING)
            self.job.append(job)
        self.need: list[dict[str, float]] = [
            demand(job.spec.tasks[k]) for job, k in zip(self.job, self.slot, strict=True)
        ]
        self._line: dict[str, LineKey] = {job_id: line_order(j) for job_id, j in jobs.items()}
        self.tally = self._tenants(topology.queues, tasks)
        n = len(self.tally.tenants)
        self.waiting = np.zeros(n, dtype=np.int64)
        """Per tenant, its tasks waiting (arrived, not placed, fit somewhere)."""
        self._queues_of = [
            [q for q in topology.queues.values() if q.tenant == name] for name in self.tally.tenants
        ]
        self._shares: F64 | None = None

    @staticmethod
    def _tenants(queues: Mapping[str, queues_pb2.Queue], tasks: Sequence[TraceTask]) -> Tally:
        names = sorted({queues[t.queue].tenant for t in tasks if t.queue})
        unqueued = any(not t.queue for t in tasks)
        tenants = (*names, *([NO_QUEUE] if unqueued else []))
        number = {name: i for i, name in enumerate(tenants)}
        weights = np.array(
            [
                sum(
                    q.weight
                    for q in queues.values()
                    if q.tenant == name and not (q.parent and queues[q.parent].tenant == name)
                )
                or 1.0
                for name in tenants
            ]
        )
        return Tally(
            tenants=tenants,
            weights=weights,
            fair=np.array([name != NO_QUEUE for name in tenants], dtype=bool),
            tenant_of=[number[queues[t.queue].tenant if t.queue else NO_QUEUE] for t in tasks],
            share_s=np.zeros(len(tenants)),
        )

    # What the coordinator's Sharing says.

    def order(self, tasks: Iterable[int]) -> Iterator[int]:
        """``tasks`` in the coordinator's line: jobs by ``Sharing.order`` (jobs that may
        preempt first, then the queues taking turns by weighted dominant share, each queue's
        jobs by priority, then submission); a job's tasks in trace order. Shares are read
        afresh at each turn, so what the caller placed meanwhile counts."""
        by_job: dict[str, list[int]] = {}
        for i in sorted(set(tasks)):
            by_job.setdefault(self.job[i].id, []).append(i)
        pending = [self.job[line[0]] for line in by_job.values()]
        pending.sort(key=lambda job: self._line[job.id])
        for job in self.sharing.order(pending, self.capacity, {}):
            yield from by_job[job.id]

    def admission(self, i: int) -> str | None:
        """None when task ``i`` may start now by its queues' quotas, else why not. What the
        replay placed counts at once, so nothing is tentative."""
        return self.sharing.admission(self.job[i], self.need[i], {})

    def may_preempt(self, i: int) -> bool:
        return self.sharing.may_preempt(self.job[i])

    def lenders(self, i: int) -> set[str]:
        """The queues whose tasks may be stopped to give task ``i``'s queue its nominal."""
        return self.sharing.lenders(self.job[i], self.need[i])

    def owed(self, i: int) -> list[Debt]:
        """What the queues that borrow must give back for task ``i`` to start within its
        queue's nominal quota (``Sharing.owed``)."""
        return self.sharing.owed(self.job[i], self.need[i])

    def queue(self, i: int) -> str:
        return self.job[i].spec.queue

    def demand(self, i: int) -> Demand:
        return self.need[i]

    # Keeping the records in step.

    def moved(self, i: int, state: int) -> None:
        """Task ``i`` is now in ``state``: what its queue holds follows."""
        job = self.job[i]
        job.tasks[self.slot[i]].state = cast(jobs_pb2.JobState.ValueType, state)
        self.usage.update(job, {})
        self._shares = None

    def advance(self, dt: float) -> None:
        """``dt`` seconds pass as they are: while every tenant has a task waiting, add each
        tenant's dominant share (of what the federation has) times ``dt``."""
        tally = self.tally
        if dt <= 0 or not tally.fair.any() or (self.waiting[tally.fair] == 0).any():
            return
        if self._shares is None:
            self._shares = np.array([self._share(t) for t in range(len(tally.tenants))])
        tally.share_s += self._shares * dt
        tally.contended_s += dt

    def _share(self, tenant: int) -> float:
        """The tenant's dominant share of the federation, not divided by its weight."""
        held: dict[str, float] = {}
        names = [q.name for q in self._queues_of[tenant]] if self.tally.fair[tenant] else [""]
        for name in names:
            for resource, amount in self.usage.of(name).items():
                held[resource] = held.get(resource, 0.0) + amount
        return dominant_share(held, self.capacity, 1.0)[0]


def _spec(t: TraceTask) -> jobs_pb2.TaskSpec:
    """The task as a job spec states it, as far as quotas count it (``demand``)."""
    spec = jobs_pb2.TaskSpec(name=t.task, replicas=t.replicas)
    res = spec.resources
    res.cpu, res.memory_mib = t.cpu, round(t.memory_mib)
    if t.accelerator_count or t.accelerator_fraction:
        acc = res.accelerator
        acc.kind = cast(resources_pb2.DeviceKind.ValueType, t.accelerator_kind)
        acc.count, acc.fraction = t.accelerator_count, t.accelerator_fraction
        acc.models.extend(sorted(t.accelerator_models))
    return spec
