"""Queues, quotas, fair share and priority classes, as the submit path and the scheduler use
them: one object over the queue book, the queues' usage and the configured classes."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from federation.api.v1 import jobs_pb2, queues_pb2
from federation.common import job_state
from federation.coordinator.policy.fair_share import dominant_share, fair_order
from federation.coordinator.policy.priority import PriorityClass
from federation.coordinator.policy.queues import QueueTable
from federation.coordinator.policy.quota import EPSILON, Debt, admission, owed, within_nominal
from federation.coordinator.policy.resources import Demand, at, demand, kind_of, quota_key
from federation.coordinator.policy.usage import QueueUsage
from federation.errors import FieldViolation
from federation.metrics import QUEUE_DOMINANT_SHARE, QUEUE_USAGE, QUEUE_WAITING_JOBS
from federation.resources import add

Tentative = dict[str, dict[str, float]]
"""Per queue, what a scheduling cycle admitted but has not yet handed to a negotiation."""


@dataclass(slots=True)
class Admitted:
    """Where a task placed at candidate sites may run by its queues' site, domain and model
    quotas (``Sharing.where``)."""

    sites: list[str]
    """The candidate sites it may run at, in the order given."""
    models: dict[str, list[str]]
    """Per site, the only models it may be given there, where its quotas rule some out."""
    holds: dict[str, float]
    """What it counts against its queue until it is placed: at every site it may be offered
    to, with every model it may be given there (so no offer in flight over-admits)."""
    refused: list[tuple[str, str]]
    """(site, why) for each candidate its quotas keep it from."""


class Sharing:
    def __init__(
        self,
        book: QueueTable,
        usage: QueueUsage,
        classes: Mapping[str, PriorityClass] | None = None,
    ) -> None:
        self.book = book
        self._usage = usage
        self.classes = dict(classes or {})
        self._as_of: dict[str, dict[str, float]] | None = None
        """What the queues held when ``as_of_now`` began, while it lasts."""
        self._cycle_admitted: Tentative | None = None
        """What the cycle within ``as_of_now`` has admitted so far, not held yet."""
        self._borrowing: set[tuple[str, str]] | None = None
        """Within ``as_of_now``, once read: (parent, resource) for each queue that held more
        than its nominal quota of a resource as it began."""
        self._borrowing_at: tuple[int, set[tuple[str, str]]] | None = None
        """The same for what the queues hold now, and the usage's version it was read at."""

    # The submit path --------------------------------------------------------------------

    def spec_violations(
        self, spec: jobs_pb2.JobSpec, tenant: str, path: str, *, by_tenant: bool
    ) -> list[FieldViolation]:
        """A queue the job's tenant does not own, a priority class unknown or not the
        submitter's to name, or a tenant raising its own priority (``by_tenant``: a tenant
        submits; its priority may only go down, a class raises it)."""
        out = []
        if spec.queue:
            queue = self.book.queues.get(spec.queue)
            if queue is None or queue.tenant != tenant:
                # The same words either way: no tenant learns another's queue names.
                out.append(
                    FieldViolation(
                        f"{path}.queue",
                        f"tenant {tenant} has no queue {spec.queue[:64]!r}. To fix: submit "
                        "to one of its queues",
                    )
                )
        if by_tenant and spec.priority > 0:
            out.append(
                FieldViolation(
                    f"{path}.priority",
                    f"is {spec.priority}; a tenant may only lower its jobs' priority (at most "
                    "0): name a priority class for more",
                )
            )
        if spec.priority_class:
            known = self.classes.get(spec.priority_class)
            if known is not None and not known.allows(tenant if by_tenant else None):
                known = None  # not the submitter's to name: as if there were no such class
            if known is None:
                names = ", ".join(sorted(self.classes)) or "none are configured"
                out.append(
                    FieldViolation(
                        f"{path}.priority_class",
                        f"unknown priority class {spec.priority_class[:64]!r} ({names})",
                    )
                )
            elif spec.priority and spec.priority != known.value:
                out.append(
                    FieldViolation(
                        f"{path}.priority",
                        f"is {spec.priority} but class {known.name} sets {known.value}; "
                        "give one or the other",
                    )
                )
        return out

    def may_preempt(self, job: jobs_pb2.Job) -> bool:
        """Whether the job's class lets it stop lower-priority work to start."""
        known = self.classes.get(job.spec.priority_class)
        return known is not None and known.may_preempt

    def preemptible(self, job: jobs_pb2.Job) -> bool:
        """Whether the job's tasks may be stopped for higher-priority work (without a class:
        yes)."""
        known = self.classes.get(job.spec.priority_class)
        return known is None or known.preemptible

    def lenders(
        self, job: jobs_pb2.Job, need: Demand, claimed: Tentative | None = None
    ) -> set[str]:
        """When the job's queue (and every queue above it) is within its nominal quota of all
        it needs, the queues beside them that borrow some of those resources, with the queues
        under those: their tasks may be stopped to give the room back. Empty otherwise.
        ``claimed``: what queues hold beyond their placed tasks (``Preemption.with_claims``)."""
        held = functools.partial(self.used, tentative=claimed)
        if not within_nominal(job.spec.queue, need, self.book.queues, held):
            return set()  # it would borrow itself: nothing to reclaim
        borrowing: set[str] = set()
        for current in self._chain(job.spec.queue):
            queue = self.book.queues[current]
            for other in self.book.queues.values():
                if other.parent != queue.parent or other.name == current:
                    continue
                theirs = held(other.name)
                if any(
                    need.get(quota_key(q)) and theirs.get(quota_key(q), 0.0) > q.nominal + EPSILON
                    for q in other.quotas
                ):
                    borrowing.update(self._subtree(other.name))
        return borrowing

    def owed(self, job: jobs_pb2.Job, need: Demand, claimed: Tentative | None = None) -> list[Debt]:
        """What the queues beside the job's queue (and beside each queue above it) must give
        back of what they borrow for its task that needs ``need`` to start within its nominal
        quotas ([] when nothing, or when it would borrow itself). ``claimed`` as for
        ``lenders``."""
        queue = job.spec.queue
        if not queue or queue not in self.book.queues:
            return []
        held = functools.partial(self.used, tentative=claimed)
        return owed(queue, need, self.book.queues, held) or []

    def subtree(self, queue: str) -> list[str]:
        """``queue`` and every queue under it."""
        return self._subtree(queue)

    def chain(self, queue: str) -> tuple[str, ...]:
        """``queue`` and the queues above it."""
        return tuple(self._chain(queue))

    def priority_of(self, spec: jobs_pb2.JobSpec) -> int:
        """The job's priority: its class's, if it names one."""
        known = self.classes.get(spec.priority_class)
        return known.value if known is not None else spec.priority

    # The scheduler ----------------------------------------------------------------------

    @contextlib.contextmanager
    def as_of_now(self, tentative: Tentative | None = None) -> Iterator[None]:
        """Within: every look at what queues hold sees what they held as it began (and what
        is admitted meanwhile: through ``tentative``, the cycle's, or by ``admit_change``).
        Otherwise only tasks ending and negotiations ending change it meanwhile, both
        lowering it: this never over-admits."""
        self._as_of, self._cycle_admitted = self._usage.copy(), tentative
        try:
            yield
        finally:
            self._as_of = self._cycle_admitted = None
            self._borrowing = None

    def used(self, queue: str, tentative: Tentative | None = None) -> dict[str, float]:
        """What ``queue`` and every queue under it hold, with what this cycle admitted (as
        the cycle began, within ``as_of_now``)."""
        as_of = self._as_of
        if as_of is None:
            return self._used(queue, self._usage.of, tentative)
        return self._used(queue, lambda name: as_of.get(name, {}), tentative)

    def _used(
        self,
        queue: str,
        own: Callable[[str], Mapping[str, float]],
        tentative: Tentative | None = None,
    ) -> dict[str, float]:
        out: dict[str, float] = {}
        for name in self._subtree(queue):
            for source in (own(name), (tentative or {}).get(name, {})):
                add(out, source.items())
        return out

    def _subtree(self, queue: str) -> list[str]:
        if not queue:
            return [""]  # jobs in no queue: not the parent of the top-level queues
        names, i = [queue], 0
        while i < len(names):
            names += self.book.children(names[i])
            i += 1
        return names

    def admission(self, job: jobs_pb2.Job, need: Demand, tentative: Tentative) -> str | None:
        """None when the job's task that needs ``need`` may start now, else why not."""
        queue = job.spec.queue
        if not queue or queue not in self.book.queues:
            return None
        held = functools.partial(self.used, tentative=tentative)
        return admission(queue, need, self.book.queues, held, self._borrowed(tentative))

    def _borrowed(
        self, tentative: Tentative | None, *, now: bool = False
    ) -> Callable[[str, str], bool]:
        """For ``admission``: whether a queue beside ``queue`` may hold more than its nominal
        quota of ``key``: it did as the cycle within ``as_of_now`` began (or does ``now``,
        and outside a cycle), or something was admitted (or claimed) of it in ``tentative``
        outside ``queue``. Reading every queue beside each waiting task's would cost the
        square of the queues."""
        as_of = self._as_of
        if now or as_of is None:
            version = self._usage.version
            if self._borrowing_at is None or self._borrowing_at[0] != version:
                self._borrowing_at = (version, self._borrowing_by(self._usage.totals()))
            borrowing = self._borrowing_at[1]
        else:
            if self._borrowing is None:
                self._borrowing = self._borrowing_by(as_of)
            borrowing = self._borrowing
        queues, tentative = self.book.queues, tentative or {}

        def borrowed(queue: str, key: str) -> bool:
            if (queues[queue].parent, key) in borrowing:
                return True
            return any(name != queue and key in held for name, held in tentative.items())

        return borrowed

    def _borrowing_by(self, own: Mapping[str, Mapping[str, float]]) -> set[tuple[str, str]]:
        """(parent, resource) for each queue that holds more than its nominal quota of the
        resource by ``own``: each queue's own usage summed up its chain, once."""
        queues, totals = self.book.queues, dict[str, dict[str, float]]()
        for name, theirs in own.items():
            for current in self._chain(name):
                add(totals.setdefault(current, {}), theirs.items())
        out = set[tuple[str, str]]()
        for name, total in totals.items():
            queue = queues[name]
            for quota in queue.quotas:
                key = quota_key(quota)
                if total.get(key, 0.0) > quota.nominal + EPSILON:
                    out.add((queue.parent, key))
        return out

    def admit_change(self, job: jobs_pb2.Job, need: Demand) -> str | None:
        """``admission`` for what a running task adds (a scale-up), outside the scheduler's
        cycles: against what the queues hold this moment, even while a cycle looks at what
        they held as it began; admitted, it counts in that cycle's view too, so the cycle
        cannot hand the same room to a task of its own (nor this change the room the cycle
        admitted a task to, not held yet). The caller holds it in the usage
        (``Serving``'s ``Reservations``) until the change is written or given up."""
        queue = job.spec.queue
        if not queue or queue not in self.book.queues:
            return None
        admitted = self._cycle_admitted  # by a cycle resting now, and not held yet
        why = admission(
            queue,
            need,
            self.book.queues,
            lambda q: self._used(q, self._usage.of, admitted),
            self._borrowed(admitted, now=True),
        )
        if why is None and self._as_of is not None:
            add(self._as_of.setdefault(queue, {}), need.items())
            self._borrowing = None  # it may borrow: read again
        return why

    def where(
        self,
        job: jobs_pb2.Job,
        spec: jobs_pb2.TaskSpec,
        need: Demand,
        sites: Sequence[str],
        models_at: Callable[[str], Collection[str]],
        domain_of: Callable[[str], str],
        tentative: Tentative,
    ) -> Admitted:
        """Which of ``sites`` (and which models there: ``models_at``, those it accepts) the
        job's task may run at, by the quotas of its queues that count a resource at one site,
        in one domain, or of one model. The task's ``need`` has passed ``admission``."""
        quotas = [q for name in self._chain(job.spec.queue) for q in self.book.queues[name].quotas]
        kind = kind_of(spec)
        by_model = kind is not None and any(q.resource.startswith(f"{kind}/") for q in quotas)
        if not by_model and not any(q.site or q.domain for q in quotas):
            return Admitted(list(sites), {}, dict(need), [])
        base = {r: amount for r, amount in need.items() if "/" not in r}
        admitted = Admitted([], {}, dict(base), [])
        for site in sites:
            domain = domain_of(site)
            if by_model and kind is not None:
                options = [
                    (m, at({**base, f"{kind}/{m}": base[kind]}, site, domain))
                    for m in sorted(models_at(site))
                ]
            else:
                options = [("", at(need, site, domain))]
            kept, why = [], ""
            for model, holds in options:
                refusal = self.admission(job, holds, tentative)
                if refusal is None:
                    kept.append(model)
                    admitted.holds.update(holds)
                else:
                    why = why or refusal
            if not kept:
                admitted.refused.append((site, why or "no device model it accepts there"))
                continue
            admitted.sites.append(site)
            if by_model and len(kept) < len(options):
                admitted.models[site] = kept
        return admitted

    def _chain(self, queue: str) -> list[str]:
        """``queue`` and the queues above it."""
        out = []
        while queue in self.book.queues and queue not in out:
            out.append(queue)
            queue = self.book.queues[queue].parent
        return out

    @staticmethod
    def admit(job: jobs_pb2.Job, need: Demand, tentative: Tentative) -> None:
        """Count ``need`` against the job's queue for the rest of this cycle."""
        add(tentative.setdefault(job.spec.queue, {}), need.items())

    def turn(
        self, job: jobs_pb2.Job, capacity: Mapping[str, float], tentative: Tentative
    ) -> tuple[bool, float]:
        """When the job's queue's turn comes (``fair_order``): whether its next task would
        borrow, then the queue's weighted dominant share."""
        queue = job.spec.queue
        held = functools.partial(self.used, tentative=tentative)
        borrows = not within_nominal(queue, next_need(job), self.book.queues, held)
        weight = self.book.queues[queue].weight if queue in self.book.queues else 1.0
        return borrows, dominant_share(held(queue), capacity, weight)[0]

    def order(
        self,
        pending: Iterable[jobs_pb2.Job],
        capacity: Mapping[str, float],
        tentative: Tentative,
    ) -> Iterator[jobs_pb2.Job]:
        """``pending`` (in line order) with the queues taking turns: tasks within their
        queue's nominal quota before those that would borrow, each by weighted dominant share;
        within a queue the line order stays. Jobs that may preempt go first, as they may
        have had others stopped to make room for them."""
        lines: dict[str, list[jobs_pb2.Job]] = {}
        urgent = []
        for job in pending:
            if self.may_preempt(job):
                urgent.append(job)
            else:
                lines.setdefault(job.spec.queue, []).append(job)
        yield from urgent
        if len(lines) == 1:
            yield from next(iter(lines.values()))
        elif lines:
            yield from fair_order(lines, lambda _, job: self.turn(job, capacity, tentative))

    def status(
        self, capacity: Mapping[str, float], waiting: Mapping[str, int]
    ) -> list[queues_pb2.QueueStatus]:
        """Every queue with what it holds, borrows and its dominant share."""
        out = []
        for name in sorted(self.book.queues):
            queue = self.book.queues[name]
            held = self._used(name, self._usage.of)  # now, even while a cycle rests
            share, resource = dominant_share(held, capacity, queue.weight)
            borrowed = {
                quota_key(q): held.get(quota_key(q), 0.0) - q.nominal
                for q in queue.quotas
                if held.get(quota_key(q), 0.0) > q.nominal
            }
            out.append(
                queues_pb2.QueueStatus(
                    queue=queue,
                    usage=_shown(queue, held),
                    borrowed=borrowed,
                    dominant_share=share,
                    dominant_resource=resource,
                    waiting_jobs=waiting.get(name, 0),
                )
            )
        self.export_gauges(capacity, waiting)
        return out

    def export_gauges(self, capacity: Mapping[str, float], waiting: Mapping[str, int]) -> None:
        """Every queue's usage, dominant share and waiting jobs as gauges; a queue or resource
        that holds nothing now has no series left over from before."""
        QUEUE_USAGE.clear()
        QUEUE_DOMINANT_SHARE.clear()
        QUEUE_WAITING_JOBS.clear()
        for name, queue in self.book.queues.items():
            QUEUE_WAITING_JOBS.labels(name).set(waiting.get(name, 0))
            held = self._used(name, self._usage.of)  # now, even while a cycle rests
            QUEUE_DOMINANT_SHARE.labels(name).set(dominant_share(held, capacity, queue.weight)[0])
            for resource, amount in _shown(queue, held).items():
                QUEUE_USAGE.labels(name, resource).set(amount)


def _shown(queue: queues_pb2.Queue, held: Mapping[str, float]) -> dict[str, float]:
    """What ``queue`` holds federation-wide, and what its scoped quotas count: not what it
    holds at every site and in every domain (a series each would be too many)."""
    counted = {quota_key(q) for q in queue.quotas}
    return {r: amount for r, amount in held.items() if "@" not in r or r in counted}


def next_need(job: jobs_pb2.Job) -> dict[str, float]:
    """What the job's first waiting task needs (its first task's, before it has a status)."""
    waiting = next((t.name for t in job.tasks if t.state == job_state.PENDING), None)
    if waiting is not None:
        return task_demand(job, waiting)
    return demand(job.spec.tasks[0]) if job.spec.tasks else {}


def task_demand(job: jobs_pb2.Job, task: str) -> dict[str, float]:
    """What the job's task ``task`` holds while placed or running."""
    spec = next(t for t in job.spec.tasks if t.name == task)
    return demand(spec)
