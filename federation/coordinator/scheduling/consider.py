"""Considering a waiting task in a scheduling cycle: its queue's quota, placement, the rules
beside placement, a wait for a busy site or preemption, in that order; and the parts of an
all-or-nothing gang together. What comes of it is a negotiation to start, or the verdicts the
task waits with."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from federation import tracing
from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.common.keys import DATASET, TaskKey
from federation.coordinator.data.staged_inputs import Registered, holders_away, with_copies
from federation.coordinator.jobs import retries, spread
from federation.coordinator.jobs.records import find_spec
from federation.coordinator.policy.resources import at
from federation.coordinator.policy.sharing import Admitted, Sharing, Tentative, task_demand
from federation.coordinator.policy.stopped_for import KEPT_REASON
from federation.coordinator.scheduling.admission import Admission, with_devices_left
from federation.coordinator.scheduling.config import (
    GANG,
    INPUTS,
    OWNER_SHARE,
    PREEMPT,
    QUOTA,
    SPREAD,
)
from federation.coordinator.scheduling.cycle_state import Cycle, Placement
from federation.coordinator.scheduling.line import Line, Rest
from federation.coordinator.scheduling.offers import Negotiation
from federation.coordinator.scheduling.placing import Placing
from federation.coordinator.scheduling.preemption import Preemption, room_coming_by_verdict
from federation.coordinator.scheduling.task_requests import request_for
from federation.coordinator.scheduling.verdicts import stage_verdicts, waiting_verdict
from federation.coordinator.scheduling.waiting import Waiting
from federation.coordinator.sites.registry import SiteRegistry
from federation.placement.framework import Code
from federation.placement.request import Request

log = structlog.get_logger()

Outcome = Negotiation | list[jobs_pb2.SiteVerdict] | None
"""What considering a waiting task comes to: a negotiation to start, the verdicts it waits
with (backed off), or None (its dependencies have not succeeded, or placing it failed)."""
Waits = list[tuple[str, str, list[jobs_pb2.SiteVerdict]]]
"""(job id, task, verdicts) of waiting tasks whose verdicts changed."""


@dataclass(slots=True)
class _Placed:
    request: Request
    placement: Placement
    reused: bool
    """Placed by an earlier task with the same request, on the same snapshot."""


@dataclass(slots=True)
class _Choice:
    """A waiting task that may be offered: its sites, best first, and what it counts."""

    ranked: tuple[str, ...]
    verdicts: tuple[jobs_pb2.SiteVerdict, ...]
    estimates: dict[str, jobs_pb2.Estimate]
    admitted: Admitted
    need: dict[str, float]
    reused: bool


class Considering:
    """Takes waiting tasks through the parts of the cycle that decide, one after another."""

    def __init__(
        self,
        sites: SiteRegistry,
        sharing: Sharing,
        datasets: Registered | None,
        line: Line,
        admission: Admission,
        placing: Placing,
        waiting: Waiting,
        preemption: Preemption,
    ) -> None:
        self._sites = sites
        self._sharing = sharing
        self._datasets = datasets
        self._line = line
        self._admission = admission
        self._placing = placing
        self._waiting = waiting
        self._preemption = preemption

    def task(self, job: jobs_pb2.Job, task: str, cycle: Cycle) -> Outcome:
        """One waiting task, through its queue's quota and placement (``Outcome``)."""
        key = (job.id, task)
        started_ns = tracing.now_ns()
        self._waiting.stop_waiting(key)
        self._line.considered(key)
        try:
            choice = self._choose(job, task, cycle)
        except Exception:
            # One task's bad spec or a plugin's bug must not hold up the others.
            log.exception("placement_failed", job=job.id, task=task)
            self._line.backoff(key)
            return None
        if not isinstance(choice, _Choice):
            return choice
        return self._negotiation(job, task, choice, cycle, started_ns)

    def _choose(
        self, job: jobs_pb2.Job, task: str, cycle: Cycle
    ) -> _Choice | list[jobs_pb2.SiteVerdict] | None:
        """Where the task may be offered, or what it waits with: its queue's quota first
        (reclaiming what it is owed), then placement (preempting where only room is short)."""
        key = (job.id, task)
        need = task_demand(job, task)
        queued = bool(job.spec.queue)
        held_back: jobs_pb2.SiteVerdict | None = None
        debts = []
        # What is claimed by the tasks that had others stopped for them counts too.
        tentative = self._preemption.with_claims(cycle, key) if queued else cycle.tentative
        if queued and (why := self._sharing.admission(job, need, tentative)):
            self._line.backoff(key)  # a task's end wakes it (``capacity_freed``)
            held_back = jobs_pb2.SiteVerdict(stage=QUOTA, reason=why)
            debts = self._preemption.owed(job, task, need, cycle)
            if not debts:
                return [held_back]
        placed = self._placed(job, task, cycle)
        if not isinstance(placed, _Placed):
            return placed
        verdicts, ranked, _, _, unfit = placed.placement
        if held_back is not None:  # owed what the queues beside its queue borrow
            short = {v.site for v in verdicts if v.code == Code.INSUFFICIENT_FREE_CAPACITY}
            options = [(debts, {*ranked, *short}, need)]
            return [held_back, *self._preemption.reclaim_for(job, task, options, cycle)]
        if not ranked:
            self._line.backoff(key, unfit=unfit)
            return [*verdicts, *self._preemption.preempt_for(job, task, verdicts, cycle)]
        return self._narrow(job, task, need, tentative, placed, cycle)

    def _placed(
        self, job: jobs_pb2.Job, task: str, cycle: Cycle
    ) -> _Placed | list[jobs_pb2.SiteVerdict] | None:
        """Placement's decision for the task on this cycle's snapshot; or the verdict it
        waits with for its inputs' holders, or None while its dependencies or its selector's
        verdicts are not known yet."""
        key = (job.id, task)
        if cycle.snapshot is None:
            # Built only when something waits: every view delta wakes the loop, and
            # flattening the federation into arrays is the expensive part of a cycle.
            cycle.snapshot = self._sites.snapshot()
            cycle.placements = self._placing.placements_on(cycle.snapshot)
        request = with_copies(
            request_for(job, task), job.spec.tenant, self._datasets, self._sites.connected
        )
        if request is None:
            return None  # waits for its dependencies; a report of theirs wakes us
        reads_data = any(t.outputs for t in job.spec.tasks) or any(
            i.dataset.startswith(DATASET) for i in find_spec(job, task).inputs
        )
        if reads_data and (away := holders_away(job, task, self._sites, self._datasets)):
            self._line.backoff(key)  # no offer while no one can sign its inputs' URLs
            why = f"waiting for site {', '.join(away)}, which holds its inputs, to connect"
            return [jobs_pb2.SiteVerdict(stage=INPUTS, reason=why)]
        request = self._placing.with_learned_speeds(request)
        if request.selector and self._placing.selector_unevaluated(
            request.selector, cycle.snapshot
        ):
            return None  # its verdicts are being found; that wakes us
        placement = cycle.placements.get(request)
        reused = placement is not None
        if placement is None:
            placement = cycle.placements[request] = self._placing.place(request, cycle.snapshot)
        return _Placed(request, placement, reused)

    def _narrow(
        self,
        job: jobs_pb2.Job,
        task: str,
        need: dict[str, float],
        tentative: Tentative,
        placed: _Placed,
        cycle: Cycle,
    ) -> _Choice | list[jobs_pb2.SiteVerdict] | None:
        """Of the sites placement ranked, those its quotas, the owner shares, the room kept
        for others, its spread and the devices left let the task go to; unless it should
        wait for a busy site instead."""
        assert cycle.snapshot is not None
        key = (job.id, task)
        verdicts, ranked, estimates, busy, _ = placed.placement
        feasible = ranked
        if job.spec.queue:
            admitted = self._admission.where(job, task, need, ranked, cycle.snapshot, tentative)
        else:
            admitted = Admitted(list(ranked), {}, need, [])
        kept, for_owners = self._admission.within_owner_shares(job, need, admitted.sites, cycle)
        kept, behind = self._preemption.kept_for(key, kept)
        refused = [
            *stage_verdicts(QUOTA, admitted.refused),
            *stage_verdicts(OWNER_SHARE, for_owners),
            *stage_verdicts(PREEMPT, [(site, KEPT_REASON) for site in behind]),
        ]
        if not kept:
            self._line.backoff(key)  # a task's end wakes it (``capacity_freed``)
            reclaimed = self._reclaim_at_sites(job, task, need, admitted, cycle)
            return [*verdicts, *refused, *reclaimed]
        ranked, verdicts = tuple(kept), (*verdicts, *refused)
        if spread.PART in task:
            kept, apart = self._admission.within_spread(job, task, feasible, ranked, cycle.snapshot)
            verdicts = (*verdicts, *stage_verdicts(SPREAD, apart))
            if not kept:
                self._line.backoff(key)  # a sibling's placement or end wakes it
                # Room elsewhere is not its room: it may preempt where it may go.
                return [*verdicts, *self._preemption.preempt_for(job, task, verdicts, cycle)]
            ranked = tuple(kept)
        wait = (
            self._waiting.sooner(placed.request, placed.placement, ranked, cycle) if busy else None
        )
        if wait is not None and self._waiting.within_promise(key, wait):
            # A task's end there wakes it, and it is weighed again by then anyway, should
            # what runs there overrun.
            self._line.hold_for(key, self._waiting.wait_for(key, wait))
            return [waiting_verdict(wait, ranked[0], estimates[ranked[0]].total_s)]
        ranked = with_devices_left(ranked, need, cycle)
        if not ranked:
            # Earlier tasks in line were offered the devices free now: offered too, it
            # would be declined and held meanwhile, counting against its queue's share.
            self._line.backoff(key)  # their negotiations' end, or a task's, wakes it
            return None
        return _Choice(ranked, verdicts, estimates, admitted, need, placed.reused)

    def _reclaim_at_sites(
        self, job: jobs_pb2.Job, task: str, need: dict[str, float], admitted: Admitted, cycle: Cycle
    ) -> tuple[jobs_pb2.SiteVerdict, ...]:
        """Reclaim what the task is owed at the sites its scoped or model quotas refused it,
        counting what it would count there."""
        assert cycle.snapshot is not None
        domain_of = self._sites.domain_of
        at_sites = [
            (owed, {site}, counted)
            for site, _ in admitted.refused
            for counted in self._admission.counted(job, task, need, site, cycle.snapshot)
            if (owed := self._preemption.owed(job, task, at(counted, site, domain_of(site)), cycle))
        ]
        return self._preemption.reclaim_for(job, task, at_sites, cycle)

    def _negotiation(
        self, job: jobs_pb2.Job, task: str, choice: _Choice, cycle: Cycle, started_ns: int
    ) -> Negotiation:
        """The task, admitted, becomes a negotiation with its ranked sites."""
        if job.spec.queue:
            self._sharing.admit(job, choice.admitted.holds, cycle.tentative)
            self._preemption.admitted((job.id, task))
        self._admission.guest_sent(job, choice.need, choice.ranked, cycle)
        if tracing.on():
            best = choice.estimates[choice.ranked[0]]
            tracing.record(
                "task.place",
                job.id,
                started_ns,
                task=task,
                attributes={
                    "federation.ranked": list(choice.ranked),
                    "federation.estimate_s": best.total_s,
                    "federation.estimate_run_s": best.run_s,
                    "federation.placement_reused": choice.reused,
                    "federation.refused_sites": len(choice.verdicts),
                },
            )
        if spread.PART in task:
            self._admission.part_offered(job.id, task, choice.ranked[0])
        return Negotiation(
            job.id,
            task,
            choice.ranked,
            list(choice.verdicts),
            choice.estimates,
            holds=choice.admitted.holds,
            models=choice.admitted.models,
        )

    def gang(
        self,
        job: jobs_pb2.Job,
        parts: list[jobs_pb2.TaskStatus],
        cycle: Cycle,
        negotiating: set[TaskKey],
        rest: Rest,
        now: float,
        wall: float,
    ) -> tuple[list[Negotiation], Waits]:
        """An all-or-nothing gang's parts, together (``federation.coordinator.jobs.gangs``): a
        negotiation for each once every part is PENDING, none negotiating, and every one has
        sites; else none, and the verdicts they wait with. ``negotiating``: the tasks under
        negotiation; ``now`` and ``wall``: the cycle's monotonic and wall clocks, as its
        other tasks are judged by."""
        keys = [(job.id, t.name) for t in parts]
        if any(t.state != job_state.PENDING for t in parts) or any(k in negotiating for k in keys):
            rest.awake = True  # the keeper stops the parts at sites; their ends wake us
            return [], []
        for task, key in zip(parts, keys, strict=True):
            if (retry_in_s := retries.due_in_s(task, wall)) > 0:
                self._line.not_before(key, now + retry_in_s)
        not_before = max(self._line.due_at(key) for key in keys)
        if not_before > now:  # one part backs off: the gang does
            for key in keys:
                rest.add(key, not_before)
            return [], []
        cycle.deferred = []
        try:
            found = [self.task(job, task.name, cycle) for task in parts]
        finally:
            preemptions, cycle.deferred = cycle.deferred, None
        started = [n for n in found if isinstance(n, Negotiation)]
        if len(started) == len(parts):
            for n in started:
                n.gang = started
            rest.awake = True
            return started, []
        lacking = [
            (t.name, f) for t, f in zip(parts, found, strict=True) if not isinstance(f, Negotiation)
        ]
        coming = [n for n, f in lacking if self._preemption.room_coming(f, (job.id, n))]
        if len(coming) == len(lacking):
            # Every part has a site or room being made: the gang preempts as one, and waits.
            for start in preemptions:
                start()
            why = "waits for its gang: room is being made for parts " + ", ".join(coming)
        else:
            missing = next(name for name, _ in lacking if name not in coming)
            why = f"waits for its gang: part {missing} has no site now (all or nothing)"
        return [], self._gang_waits(
            job, parts, found, why, all_coming=len(coming) == len(lacking), now=now, rest=rest
        )

    def _gang_waits(
        self,
        job: jobs_pb2.Job,
        parts: list[jobs_pb2.TaskStatus],
        found: list[Outcome],
        why: str,
        *,
        all_coming: bool,
        now: float,
        rest: Rest,
    ) -> Waits:
        """The verdicts a gang's parts wait with, ``why`` added to those that had a site; a
        part that had one is offered no more this cycle."""
        waits = []
        for task, outcome in zip(parts, found, strict=True):
            key = (job.id, task.name)
            verdicts: list[jobs_pb2.SiteVerdict] | None
            if not isinstance(outcome, Negotiation):
                verdicts = outcome
                if verdicts is not None and not all_coming:
                    # The stopping it would have started was not: no verdict says it was.
                    verdicts = [v for v in verdicts if not room_coming_by_verdict([v])]
            else:
                self._line.backoff(key)
                self._admission.part_let_go(job.id, task.name)  # not offered after all
                verdicts = [*outcome.verdicts, jobs_pb2.SiteVerdict(stage=GANG, reason=why)]
            if verdicts is not None and list(task.verdicts) != verdicts:
                waits.append((job.id, task.name, verdicts))
            if (until := self._line.due_at(key)) > now:
                rest.add(key, until)
            else:
                rest.awake = True
        return waits
