"""Preemption in the scheduling cycle: when a waiting task may stop others (a higher
priority, or its queue owed its nominal quota by the queues that borrow it), which tasks it
stops (``plan_preemption``, pure, which the simulator calls too), and stopping them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.common.keys import TaskKey
from federation.coordinator.jobs import spread
from federation.coordinator.jobs.records import Change, Mutation, find_task
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.policy.preemption import (
    Candidate,
    TaskAt,
    choose_victims,
    fits,
    free_room,
    may_stop,
    ready_s,
)
from federation.coordinator.policy.quota import Debt
from federation.coordinator.policy.resources import Demand, at
from federation.coordinator.policy.sharing import Sharing, Tentative, task_demand
from federation.coordinator.policy.stopped_for import KEPT_REASON, StoppedFor
from federation.coordinator.policy.usage import placed
from federation.coordinator.scheduling.admission import Admission
from federation.coordinator.scheduling.config import PREEMPT, RECLAIMED, SchedulerConfig
from federation.coordinator.scheduling.cycle_state import Cycle
from federation.coordinator.sites.registry import SessionClosedError, SiteRegistry, cancel_request
from federation.errors import FederationError
from federation.metrics import PREEMPTIONS
from federation.placement.framework import Code
from federation.placement.snapshot import Snapshot
from federation.resources import add

log = structlog.get_logger()

Stopping = list[tuple[str, str, int]]
"""Tasks being stopped, as (job id, task, epoch)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """Where a waiting task gets room by preemption: the victims to stop at ``site`` now, and
    the tasks being stopped there already that it counts on."""

    site: str
    victims: list[Candidate] = field(default_factory=list)
    stopping: Stopping = field(default_factory=list)


class MinRuns(Protocol):
    """How long a task runs before it may be stopped (``SchedulerConfig``; the simulator's
    ``SimConfig`` has the same two)."""

    @property
    def preemption_min_run_s(self) -> float:
        """For a task of higher priority."""
        ...

    @property
    def reclaim_min_run_s(self) -> float:
        """For its queue's borrowed quota to be taken back."""
        ...


def as_victim(
    sharing: Sharing,
    job: jobs_pb2.Job,
    task: TaskAt,
    *,
    holds: Demand,
    domain: str,
    started_s: float | None,
    lost_s: float,
    urgent: jobs_pb2.Job,
    lenders: Collection[str],
    min_runs: MinRuns,
) -> tuple[Candidate, float] | None:
    """``task`` of ``job``, at a site, as a victim for a waiting task of ``urgent``, and from
    when it may be stopped (``ready_s``: once it has run its minimum since ``started_s``);
    None when it may not be: its class is not preemptible, or it is not of one of
    ``lenders`` when its queue takes back what it lent, or else not of lower priority
    (``may_stop``). ``holds``: what it holds as its site granted it, counted at its site and
    in its ``domain``; ``lost_s``: the run it would lose. The coordinator's ``Preemption``
    and the simulator both take their candidates so."""
    if not sharing.preemptible(job):
        return None
    if not may_stop(job.spec.priority, job.spec.queue, urgent.spec.priority, lenders):
        return None
    reclaim = bool(lenders)
    min_run_s = min_runs.reclaim_min_run_s if reclaim else min_runs.preemption_min_run_s
    candidate = Candidate(
        job_id=task.job_id,
        task=task.task,
        site=task.site,
        epoch=task.epoch,
        priority=job.spec.priority,
        demand=at(holds, task.site, domain),
        lost_s=lost_s,
        queues=sharing.chain(job.spec.queue),
    )
    return candidate, ready_s(started_s, min_run_s, reclaim=reclaim)


def plan_preemption(
    need: Demand,
    room: Mapping[str, Mapping[str, float]],
    candidates: Callable[[], list[Candidate]],
    stopping: Mapping[str, Stopping] | None = None,
    debts: Sequence[Debt] = (),
) -> Plan | None:
    """Where a task that needs ``need`` gets room: at a site whose ``room`` (free, plus what
    its tasks ``stopping`` already will free) holds it, stopping no more; else by the fewest
    victims of ``candidates()`` (``choose_victims``, paying ``debts`` if given); else None."""
    stopping = stopping or {}
    for site, stopped in stopping.items():
        if fits(need, room[site]):
            return Plan(site, [], stopped)
    choice = choose_victims(need, room, candidates(), debts)
    if choice is None:
        return None
    site, victims = choice
    return Plan(site, victims, list(stopping.get(site, [])))


class Preemption:
    """The tasks being stopped for waiting ones, and what those will hold once they run."""

    def __init__(
        self,
        jobs: JobRepository,
        sites: SiteRegistry,
        sharing: Sharing,
        admission: Admission,
        config: SchedulerConfig,
    ) -> None:
        self._jobs = jobs
        self._sites = sites
        self._sharing = sharing
        self._admission = admission
        self._config = config
        self._tasks: set[asyncio.Task[None]] = set()
        self._preempting: dict[TaskKey, Stopping] = {}
        """Per waiting task, the (job, task, epoch) it had stopped while it waits."""
        self._stopped_for = StoppedFor(self._status_of, lambda key: key in self._preempting)
        """Tasks stopped for a waiting one, kept from the room they freed until it runs."""
        self._claims: dict[TaskKey, dict[str, float]] = {}
        """Per waiting task of a queue that had tasks stopped for it, what it will hold (at
        the site it waits for) until it is admitted: no other task takes that quota meanwhile,
        not even the victims back, borrowing again."""

    def making_room(self, key: TaskKey) -> bool:
        """Whether tasks are being stopped for the waiting task ``key``."""
        return key in self._preempting

    def kept_for(self, key: TaskKey, sites: Sequence[str]) -> tuple[list[str], list[str]]:
        """Of ``sites``, those the room freed for other waiting tasks leaves ``key``, and the
        others (``StoppedFor.room_kept``)."""
        return self._stopped_for.room_kept(key, sites)

    def admitted(self, key: TaskKey) -> None:
        """The task was admitted: what it holds is counted now by what it was admitted with."""
        self._claims.pop(key, None)

    def forget(self, key: TaskKey) -> None:
        self._preempting.pop(key, None)
        self._stopped_for.forget(key)
        self._claims.pop(key, None)

    def preempt_for(
        self,
        job: jobs_pb2.Job,
        task: str,
        verdicts: tuple[jobs_pb2.SiteVerdict, ...],
        cycle: Cycle,
    ) -> tuple[jobs_pb2.SiteVerdict, ...]:
        """Stop tasks to make room, at a site that is only short of room, when the job may
        preempt (lower-priority, preemptible tasks) or its queue is owed its nominal quota
        (tasks of the queues that borrow it: ``Sharing.lenders``). The task then waits for
        that room, which it gets first (``Sharing.order``). Returns the verdict that says so;
        nothing while earlier victims are still stopping."""
        key = (job.id, task)
        urgent = self._sharing.may_preempt(job)
        if not urgent and job.spec.queue not in self._sharing.book.queues:
            return ()  # the common case, checked first: this runs for every waiting task
        assert cycle.snapshot is not None
        need = task_demand(job, task)
        short, lenders = self._short_of_room(job, task, verdicts, urgent, cycle)
        if not short or key in self._preempting:
            # Once per waiting spell: the room is summed per site, not fitted per node, so a
            # second round could stop more and more tasks for a task that never fits.
            return ()
        room, stopping = self._room_coming_free(cycle.snapshot, short)
        plan = plan_preemption(need, room, lambda: self._candidates(job, short, lenders), stopping)
        if plan is None:
            return ()
        if not plan.victims:
            # Tasks already being stopped make the room (stopped before this leader's term,
            # say): they become its victims, and it stops no more while it waits.
            reason = f"waits for {len(plan.stopping)} task(s) being stopped to make room"
        else:
            reason = (
                f"stopping {len(plan.victims)} task(s) of lower priority or borrowed quota "
                "to make room"
            )
        # Tenants see their own jobs only: the reason names no other job or queue.
        why = f"a job of priority {job.spec.priority}" if urgent else RECLAIMED
        cycle.now_or_with_gang(lambda: self._carry_out(key, job, need, plan, why, room=True))
        return (jobs_pb2.SiteVerdict(site=plan.site, stage=PREEMPT, reason=reason),)

    def _short_of_room(
        self,
        job: jobs_pb2.Job,
        task: str,
        verdicts: tuple[jobs_pb2.SiteVerdict, ...],
        urgent: bool,
        cycle: Cycle,
    ) -> tuple[set[str], dict[str, set[str]]]:
        """The sites only short of room for the task where it may stop tasks, and per site
        the queues whose tasks it may stop there (none: it is urgent, by priority)."""
        assert cycle.snapshot is not None
        key = (job.id, task)
        short = {v.site for v in verdicts if v.code == Code.INSUFFICIENT_FREE_CAPACITY}
        if spread.PART in task and short:
            # A part stops tasks only where its spread lets it go (its site by weight, say).
            ordered = sorted(short)
            within = self._admission.within_spread(job, task, ordered, ordered, cycle.snapshot)
            short = set(within[0])
        lenders: dict[str, set[str]] = {}
        if not urgent:
            # What it would hold there, as the queues' site, domain and model quotas count it.
            need = task_demand(job, task)
            claimed, domain_of = self._claimed(cycle, key), self._sites.domain_of
            for site in short:
                there = at(need, site, domain_of(site))
                if found := self._sharing.lenders(job, there, claimed):
                    lenders[site] = found
            short = set(lenders)
        return short, lenders

    def _carry_out(
        self, key: TaskKey, job: jobs_pb2.Job, need: Demand, plan: Plan, why: str, *, room: bool
    ) -> None:
        """Stop ``plan``'s victims for waiting task ``key``, which claims what it will hold;
        ``room``: the room they free is kept for it (``StoppedFor``), not only the quota."""
        self._preempting[key] = [(v.job_id, v.task, v.epoch) for v in plan.victims]
        self._preempting[key] += plan.stopping  # theirs counts too: no other's
        if room:
            self._stopped_for.stopped(plan.site, key, self._preempting[key])
        self._claim(key, job, need, plan.site)
        if plan.victims:
            self._start(key, plan.victims, why)

    def owed(self, job: jobs_pb2.Job, task: str, need: Demand, cycle: Cycle) -> list[Debt]:
        """What the queues beside the job's queue must give back of what they borrow for its
        task, within its nominal quotas, to start with ``need`` (as its quotas count it), or []
        when they owe nothing, someone owed cannot be paid, or it had tasks stopped already
        while it waits."""
        key = (job.id, task)
        if key in self._preempting:
            return []
        claimed = self._claimed(cycle, key)
        debts = self._sharing.owed(job, need, claimed)
        if not debts or not all(debt.over for debt in debts):
            return []
        # Tasks being stopped that no waiting task chose (marked before this leader's term)
        # give back what they hold soon: stopping others for it would stop them for nothing.
        # As many as pay what it is owed become its own victims (and it claims what it will
        # hold, so that they cannot borrow it back); the rest give back what they hold.
        stopping = self._stopping_unchosen(claimed)
        if stopping and (adopted := choose_victims({}, {"": {}}, stopping, debts)) is not None:
            self._preempting[key] = [(v.job_id, v.task, v.epoch) for v in adopted[1]]
            self._claims[key] = dict(need)
            return []
        debts = self._sharing.owed(job, need, claimed)
        return debts if all(debt.over for debt in debts) else []

    def _stopping_unchosen(self, claimed: Tentative) -> list[Candidate]:
        """The tasks being stopped that no waiting task chose, as candidates that pay debts
        anywhere; what each holds comes off ``claimed``."""
        taken = {victim for victims in self._preempting.values() for victim in victims}
        stopping = []
        for other in self._jobs.at_any_site():
            for status in other.tasks:
                victim = (other.id, status.name, status.epoch)
                if not status.preempted_by or victim in taken:
                    continue
                if (held := self._holds(*victim)) is not None:
                    queue, holds = held
                    stopping.append(
                        Candidate(
                            job_id=other.id,
                            task=status.name,
                            site="",  # anywhere: they make no room, they pay what is owed
                            epoch=status.epoch,
                            priority=0,
                            demand=holds,
                            lost_s=0.0,
                            queues=self._sharing.chain(queue),
                        )
                    )
                    add(claimed.setdefault(queue, {}), ((r, -n) for r, n in holds.items()))
        return stopping

    def reclaim_for(
        self,
        job: jobs_pb2.Job,
        task: str,
        options: Sequence[tuple[list[Debt], set[str], Demand]],
        cycle: Cycle,
    ) -> tuple[jobs_pb2.SiteVerdict, ...]:
        """A task its quotas hold back though it is within its nominal ones, as the queues
        beside its queue borrow what it is owed (``owed``: nominal quotas together are never
        exceeded): stop tasks of those queues, whole, of those that ran ``reclaim_min_run_s``,
        so that it fits at one of the sites of an option and they gave back its debts (the
        fewest victims of all ``options``: its federation-wide quotas at every site it may
        go, or a scoped or model quota at the site it counts, with what it then counts
        there). It waits, held back, until they end."""
        key = (job.id, task)
        if key in self._preempting or cycle.snapshot is None:
            return ()
        need = task_demand(job, task)
        best: tuple[Plan, Demand] | None = None
        for debts, sites, counted in options:
            lenders = {q for d in debts for lender in d.over for q in self._sharing.subtree(lender)}
            room, _ = self._room_coming_free(cycle.snapshot, sites)
            candidates = functools.partial(self._candidates, job, None, lenders)
            plan = plan_preemption(need, room, candidates, debts=debts)
            if plan is not None and (best is None or len(plan.victims) < len(best[0].victims)):
                best = (plan, counted)
        if best is None:
            return ()  # not (yet) taken back: its backoff tries again
        plan, counted = best
        cycle.now_or_with_gang(
            lambda: self._carry_out(key, job, counted, plan, RECLAIMED, room=False)
        )
        reason = f"stopping {len(plan.victims)} task(s) on borrowed quota to give back its quota"
        return (jobs_pb2.SiteVerdict(site=plan.site, stage=PREEMPT, reason=reason),)

    def _start(self, key: TaskKey, victims: list[Candidate], why: str) -> None:
        runner = asyncio.create_task(self.stop(victims, why))
        self._tasks.add(runner)
        runner.add_done_callback(self._tasks.discard)
        named = ", ".join(f"{v.job_id}/{v.task}" for v in victims)
        log.info("preempting", job=key[0], task=key[1], victims=named)

    def _claim(self, key: TaskKey, job: jobs_pb2.Job, need: Demand, site: str) -> None:
        if job.spec.queue:
            self._claims[key] = at(need, site, self._sites.domain_of(site))

    def with_claims(self, cycle: Cycle, but: TaskKey) -> Tentative:
        """What the queues hold beyond their placed tasks: what this cycle admitted, and what
        the other tasks waiting for tasks stopped for them will (``_claims``)."""
        if not self._claims or self._claims.keys() == {but}:
            return cycle.tentative  # the common case: nothing is stopped for anyone
        claimed = {queue: dict(held) for queue, held in cycle.tentative.items()}
        for (job_id, task), holds in self._claims.items():
            job = self._jobs.cached(job_id)
            if (job_id, task) != but and job is not None and job.spec.queue:
                add(claimed.setdefault(job.spec.queue, {}), holds.items())
        return claimed

    def _claimed(self, cycle: Cycle, but: TaskKey) -> Tentative:
        """``with_claims``, less what the tasks being stopped for those waiting hold. A
        queue owed one GPU is owed it once: without these, each of its waiting tasks found it
        owed and stopped a task."""
        claimed = self.with_claims(cycle, but)
        claimed = {queue: dict(held) for queue, held in claimed.items()}
        for victims in self._preempting.values():
            for victim_id, name, epoch in victims:
                held = self._holds(victim_id, name, epoch)
                if held is not None:
                    queue, holds = held
                    add(claimed.setdefault(queue, {}), ((r, -n) for r, n in holds.items()))
        return claimed

    def _holds(self, job_id: str, task: str, epoch: int) -> tuple[str, dict[str, float]] | None:
        """The queue of a task at a site, in ``epoch``, and what it holds against it there."""
        job = self._jobs.cached(job_id)
        if job is None or not job.spec.queue:
            return None
        for spec, status in zip(job.spec.tasks, job.tasks, strict=False):
            at_site = status.state in job_state.AT_SITE
            if status.name == task and status.epoch == epoch and at_site:
                where = at(placed(spec, status), status.site, self._sites.domain_of(status.site))
                return job.spec.queue, where
        return None

    def _candidates(
        self,
        urgent: jobs_pb2.Job,
        sites: set[str] | None,
        lenders: Mapping[str, set[str]] | set[str],
    ) -> list[Candidate]:
        """Tasks at ``sites`` (None: anywhere) that ``urgent`` may stop (``as_victim``),
        running long enough and not already being stopped: with ``lenders`` (per site, or
        everywhere), those of the queues that borrow what its queue is owed; else those of
        lower priority and a preemptible class."""
        now = time.time()
        taken = {victim for victims in self._preempting.values() for victim in victims}
        out = []
        for job in self._jobs.at_sites(sites) if sites is not None else self._jobs.at_any_site():
            if job.cancel_requested:
                continue
            for spec, task in zip(job.spec.tasks, job.tasks, strict=False):
                if task.state not in job_state.AT_SITE or (
                    sites is not None and task.site not in sites
                ):
                    continue
                if task.preempted_by or (job.id, task.name, task.epoch) in taken:
                    continue  # stopping already, or chosen by another waiting task
                started = task.started_at.ToSeconds() if task.HasField("started_at") else None
                found = as_victim(
                    self._sharing,
                    job,
                    TaskAt(job.id, task.name, task.site, task.epoch),
                    holds=placed(spec, task),
                    domain=self._sites.domain_of(task.site),
                    started_s=started,
                    lost_s=_lost_s(task, started, now),
                    urgent=urgent,
                    lenders=(
                        lenders.get(task.site, set()) if isinstance(lenders, Mapping) else lenders
                    ),
                    min_runs=self._config,
                )
                if found is not None and found[1] <= now:
                    out.append(found[0])
        return out

    def _room_coming_free(
        self, snapshot: Snapshot, sites: set[str]
    ) -> tuple[dict[str, dict[str, float]], dict[str, Stopping]]:
        """Per site of ``sites``, its free room plus the room of its tasks being stopped that
        no waiting task chose (marked before this leader's term, which starts with no
        ``_preempting``, or for a task that no longer waits); and those tasks. Their room comes
        free soon: stopping others for it would stop them for nothing."""
        room = free_room(snapshot, sites)
        taken = {victim for victims in self._preempting.values() for victim in victims}
        stopping: dict[str, Stopping] = {}
        for job in self._jobs.at_sites(sites):
            for spec, task in zip(job.spec.tasks, job.tasks, strict=False):
                victim = (job.id, task.name, task.epoch)
                if not task.preempted_by or task.state not in job_state.AT_SITE:
                    continue
                if task.site in room and victim not in taken:
                    stopping.setdefault(task.site, []).append(victim)
                    add(room[task.site], placed(spec, task).items())
        return room, stopping

    async def stop(self, victims: Sequence[Candidate | TaskAt], why: str) -> None:
        """Mark each victim as being preempted (written first, so a new leader knows), then
        tell its site to stop it; its final report puts it back to PENDING and it is placed
        again, from its newest checkpoint if it has one. ``why`` names what for."""

        def mark(victim: Candidate | TaskAt) -> Mutation:
            def mutate(job: jobs_pb2.Job) -> list[Change]:
                task = find_task(job, victim.task)
                if task.epoch == victim.epoch and task.state in job_state.AT_SITE:
                    task.preempted_by = why
                return []

            return mutate

        written = await self._jobs.update_many([(v.job_id, mark(v)) for v in victims])
        for victim in victims:
            job = written.get(victim.job_id)
            if isinstance(job, FederationError) or job is None:
                log.warning("preemption_not_written", job=victim.job_id, error=str(job))
                continue
            if not find_task(job, victim.task).preempted_by:
                continue  # it ended or moved meanwhile
            session = self._sites.session(victim.site)
            if session is not None:
                with contextlib.suppress(SessionClosedError):
                    reason = f"preempted by {why}"
                    session.send(cancel_request(victim.job_id, victim.task, victim.epoch, reason))
            PREEMPTIONS.inc()

    def _status_of(self, key: TaskKey) -> jobs_pb2.TaskStatus | None:
        """The task's status now; None once its job is no longer cached (it ended)."""
        job = self._jobs.cached(key[0])
        return next((t for t in job.tasks if t.name == key[1]), None) if job else None

    def room_coming(self, outcome: list[jobs_pb2.SiteVerdict] | None, key: TaskKey) -> bool:
        """Whether a gang part with no site now has room coming: tasks are (or would be)
        stopped for it."""
        return key in self._preempting or room_coming_by_verdict(outcome)

    def running(self) -> list[asyncio.Task[None]]:
        """Its stops under way (the loop cancels them when it closes)."""
        return list(self._tasks)


def _lost_s(task: jobs_pb2.TaskStatus, started: float | None, now: float) -> float:
    """The run ``task`` would lose if stopped ``now``: since it ``started``, or its last
    checkpoint; nothing if it has not started."""
    checkpoint = task.checkpoint.time.ToSeconds() if task.checkpoint.path else 0.0
    return max(0.0, now - max(now if started is None else started, checkpoint))


def room_coming_by_verdict(outcome: list[jobs_pb2.SiteVerdict] | None) -> bool:
    """Whether ``outcome`` says tasks are (or would be) stopped to make room."""
    return outcome is not None and any(
        v.stage == PREEMPT and v.reason != KEPT_REASON for v in outcome
    )
