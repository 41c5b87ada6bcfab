"""The scheduling loop: each cycle walks the line of waiting tasks and asks the parts in
turn. Admission (quotas, owner shares, spread), placing, waiting for a busy site, preemption,
then negotiation, which runs while later cycles start others (``negotiation``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import structlog

from federation.api.v1 import admin_service_pb2, jobs_pb2
from federation.common import job_state
from federation.common.keys import TaskKey
from federation.coordinator.data.staged_inputs import Registered
from federation.coordinator.jobs import retries
from federation.coordinator.jobs.gangs import gangs
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.policy.preemption import TaskAt
from federation.coordinator.policy.queues import QueueBook
from federation.coordinator.policy.sharing import Sharing
from federation.coordinator.scheduling.admission import Admission
from federation.coordinator.scheduling.config import (
    SchedulerConfig,
)
from federation.coordinator.scheduling.consider import Considering, Waits
from federation.coordinator.scheduling.cycle_state import Cycle
from federation.coordinator.scheduling.delegation import stay_pending
from federation.coordinator.scheduling.explain import Explainer
from federation.coordinator.scheduling.forecast import SiteHistory
from federation.coordinator.scheduling.learning import SpeedLearner
from federation.coordinator.scheduling.line import Line, Rest
from federation.coordinator.scheduling.negotiation import Negotiator
from federation.coordinator.scheduling.offers import Negotiation
from federation.coordinator.scheduling.placing import Placing
from federation.coordinator.scheduling.preemption import Preemption
from federation.coordinator.scheduling.waiting import Waiting
from federation.coordinator.sites.registry import SiteRegistry
from federation.errors import FederationError
from federation.metrics import SCHEDULING_JOBS_READ, SCHEDULING_WALK_SECONDS
from federation.placement.framework import Framework
from federation.timeslice import SLICE_S, TimeSlice

log = structlog.get_logger()


@dataclass(slots=True)
class _Loop:
    """What the loop and its negotiations share."""

    wake: Callable[[], None]
    frees: int = 0
    """How often room came free (a task ended, a view showed more, a reservation was let
    go): a negotiation compares it."""
    full: bool = False
    """A cycle left tasks waiting because max_concurrent_negotiations were under way."""
    front_due: bool = False
    """The front of the line is to be tried at the next cycle (``Line.clear_front``)."""

    def front(self) -> None:
        self.front_due = True
        self.wake()


@dataclass(slots=True)
class _Walk:
    """One cycle's walk of the line."""

    room: int
    """Negotiations it may start."""
    negotiating: set[TaskKey]
    """Tasks under negotiation as it started."""
    now: float
    wall: float
    cycle: Cycle = field(default_factory=Cycle)
    batch: list[Negotiation] = field(default_factory=list)
    nowhere: Waits = field(default_factory=list)
    pending: set[TaskKey] = field(default_factory=set)
    rested: set[str] = field(default_factory=set)
    """Jobs passed by, resting (``Line.awake``)."""
    swept: bool = True
    """It walked the whole line (it was not cut short for want of room to negotiate)."""
    read: int = 0


class _Outcomes:
    """What the cycle learns from its negotiations (``negotiation.Outcomes``)."""

    def __init__(
        self,
        loop: _Loop,
        line: Line,
        admission: Admission,
        history: SiteHistory,
        forget: Callable[[TaskKey], None],
    ) -> None:
        self._loop = loop
        self._line = line
        self._admission = admission
        self._history = history
        self._forget = forget

    def unsettled(self, key: TaskKey) -> None:
        self._line.backoff(key)

    def over(self, negotiations: list[Negotiation]) -> None:
        for n in negotiations:
            self._admission.part_let_go(n.job_id, n.task)
            if n.settled:
                self._forget(n.key)
        if self._loop.full:
            self._loop.wake()  # tasks wait for the room this leaves

    def released(self) -> None:
        self._loop.frees += 1

    def frees(self) -> int:
        return self._loop.frees

    def arrived(self, site: str) -> None:
        self._history.arrived(site)

    def batch_over(self, unsettled: bool, room_freed: bool) -> None:
        if unsettled and room_freed:
            # Room came free while they were out (reservations let go, above all), and the
            # front of the line it went to was tried while they were held: what they count
            # against their queues kept the others back by quota. Now that they are let go,
            # the front is tried again, with them in their places.
            self._loop.front()


class Scheduler:
    """Finds pending tasks, places them and negotiates delegation for many tasks at once.

    A cycle places every pending task (a placement is reused for identical requests, and on
    an unchanged snapshot across cycles) and hands the placed ones to one negotiation, which
    runs while later cycles start others. Each round of a negotiation sends each site its
    offers together; as each site answers, the tasks whose sites have all answered get their
    DELEGATED states written in one go, then each site its commits together.
    """

    def __init__(
        self,
        jobs: JobRepository,
        sites: SiteRegistry,
        framework: Framework,
        config: SchedulerConfig,
        learner: SpeedLearner | None = None,
        sharing: Sharing | None = None,
        datasets: Registered | None = None,
    ) -> None:
        self._jobs = jobs
        self._sites = sites
        self._config = config
        self._datasets = datasets
        """The registered datasets, whose holders sign URLs for tasks reading them."""
        learner = learner or SpeedLearner()
        """Speeds learned from finished tasks: estimates and offers use them."""
        self._sharing = sharing or Sharing(QueueBook(jobs.store), jobs.usage)
        """Queues: who goes first, and which tasks their quotas hold back."""
        self._wake = asyncio.Event()
        self._loop = _Loop(self.wake)
        self._line = Line(jobs, sites, self._sharing, config)
        self._waiting = Waiting(jobs, config.wait_gain)
        self._admission = Admission(jobs, sites, self._sharing)
        self._placing = Placing(
            framework, learner, config.max_offers_per_round, config.wait_gain, self.wake
        )
        self._preemption = Preemption(jobs, sites, self._sharing, self._admission, config)
        outcomes = _Outcomes(
            self._loop, self._line, self._admission, self._waiting.history, self._forget
        )
        self._negotiator = Negotiator(jobs, sites, learner, config, outcomes, datasets)
        self._considering = Considering(
            sites,
            self._sharing,
            datasets,
            self._line,
            self._admission,
            self._placing,
            self._waiting,
            self._preemption,
        )
        self._explainer = Explainer(
            sites, self._placing, self._sharing, self._waiting.predicted, datasets
        )
        self._last_cycle = 0.0
        self._walk_s = 0.0
        """How long the last cycle took to walk the line (``TIMER_PACE``)."""
        self._cycle_end = 0.0

    @property
    def history(self) -> SiteHistory:
        """How often tasks come to each site and how long they run there."""
        return self._waiting.history

    @property
    def push_outputs(self) -> Callable[[str, str], None]:
        """Pushes a task's outputs out of a store other sites cannot reach (the job
        manager's, set once it exists)."""
        return self._negotiator.push_outputs

    @push_outputs.setter
    def push_outputs(self, push: Callable[[str, str], None]) -> None:
        self._negotiator.push_outputs = push

    def wake(self) -> None:
        self._wake.set()

    def room_freed(self) -> None:
        """Room in a queue's quota came free without a task ending (a change that would have
        added replicas was given up): the front of the line is tried at once."""
        self._loop.front()

    def capacity_freed(self, site: str, ran_s: float) -> None:
        """A task ended (at ``site``, after ``ran_s``): what it held goes to the first in line
        (``Sharing.order``), not to whichever waiting task's retry timer happens to come
        due first: its queue's quota is free now. The site's report may come before its
        view shows the room free, so the front is tried again when it does (``_cycle``)."""
        self.history.ended(site, ran_s)
        self._loop.frees += 1
        self.room_freed()

    def forecasts(self, sites: Iterable[str]) -> dict[str, admin_service_pb2.SiteForecast]:
        """Per site: when room should next free there, what waits for it, and its history."""
        return self._waiting.forecasts(sites)

    def explain(self, job: jobs_pb2.Job) -> list[jobs_pb2.TaskExplanation]:
        """For each task: every site, with every filter that rejects it (each with its code)
        or its score by term; and placement's estimate at its site against the committed one."""
        return self._explainer.explain(job)

    async def evaluate_selectors(self, job: jobs_pb2.Job) -> None:
        """Find the verdicts of the job's selectors on every device class now, in a thread,
        so that ``explain`` does not evaluate them on the event loop."""
        await self._placing.evaluate_selectors(job, self._sites.snapshot())

    async def stop(self, tasks: Sequence[TaskAt], why: str) -> None:
        """Stop ``tasks`` as preemption does, ``why`` naming what for (a drain): each goes
        back to PENDING and is placed again, from its newest checkpoint if it has one."""
        await self._preemption.stop(tasks, why)

    async def run(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: in Python 3.11 wait_for can swallow a
            # cancellation that races with the event being set, and stop() would hang.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._line.next_wait_s(self._walk_s)):
                    await self._wake.wait()
            # At most one cycle per batch window: under a stream of single submissions one
            # cycle and one negotiation then serve many tasks, not one each, while a task
            # that arrives after a quiet spell is placed at once.
            # And after a cycle, a rest as long as its walk of the line took: a long line
            # (thousands of waiting jobs) must leave the loop to the calls half the time.
            next_at = max(
                self._last_cycle + self._config.batch_window_s, self._cycle_end + self._walk_s
            )
            if (wait_s := next_at - time.monotonic()) > 0:
                await asyncio.sleep(wait_s)
            self._last_cycle = time.monotonic()
            self._wake.clear()
            try:
                await self._cycle()
                self._cycle_end = time.monotonic()
            except Exception:
                # One bad cycle (a store error, a plugin bug) must not stop scheduling for good.
                log.exception("scheduling_cycle_failed")
                await asyncio.sleep(self._config.retry_interval_s)

    async def close(self) -> None:
        """Cancel everything the parts run in the background, all at once: a stop must not
        write ``preempted_by`` while a negotiation is being cancelled."""
        running = [
            *self._negotiator.running(),
            *self._preemption.running(),
            *self._placing.running(),
        ]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    def _take_news(self) -> None:
        """Wake the tasks that what happened since the last cycle may help."""
        if self._sites.take_arrived():
            self._line.wake_unfit()
        freed = self._sites.take_freed()
        if freed:
            # Views show room they had not (a task ended, a reservation was let go, a site
            # came back): it goes to the first in line, not to whichever retry timer comes
            # due first. Tasks that wait for a busy site are tried only now: before, the
            # site's view still showed the room taken. After a failover, sites coming back
            # let the first in line count the room of what the last leader was stopping
            # for them rather than stop more (``Preemption.preempt_for``).
            self._loop.frees += 1
            self._line.wake(self._waiting.at(freed))
        if freed or self._loop.front_due:
            # Here, as a cycle starts, not where the room came free: a cycle under way
            # (it rests now and then) would back off again the tasks it finds held back
            # by what was just let go, undoing the clearing.
            self._loop.front_due = False
            self._line.clear_front(self._waiting)

    async def _cycle(self) -> None:
        self._take_news()
        # Tasks under negotiation are the ones held out of the repository's pending(); as the
        # cycle starts: one let go while it rests is neither tried now nor taken for gone
        # (forgetting it would forget the tasks being stopped for it, and stop more).
        negotiating = set(self._negotiator.reservations)
        room = self._config.max_concurrent_negotiations - len(negotiating)
        self._loop.full = room <= 0
        if self._loop.full:
            return  # the next negotiation to end wakes the loop again
        walk = _Walk(room, negotiating, time.monotonic(), time.time())
        # What the queues hold as the cycle starts, all through it: negotiations and tasks
        # that end while it rests would let a task later in line take room or quota that one
        # it already refused (on what was held then) should have had. Next cycle, theirs.
        walk_started = time.monotonic()
        with self._sharing.as_of_now(walk.cycle.tentative):
            # Thousands of waiting tasks (one tenant's flood) must not stall every other call
            # on the loop: rest now and then to let them in, and go on with the jobs still
            # pending.
            timeslice = TimeSlice(rest_s=SLICE_S)
            awake = self._line.awake(walk.now, walk.rested)
            for job in self._line.order(walk.cycle.tentative, awake):
                await timeslice.share()
                walk.read += 1
                if not self._walk_job(job, walk):
                    break
        self._walk_s = time.monotonic() - walk_started
        SCHEDULING_WALK_SECONDS.observe(self._walk_s)
        SCHEDULING_JOBS_READ.inc(walk.read)
        if walk.swept:
            # Forget the backoff of tasks no longer waiting (placed, cancelled, failed).
            for key in self._line.swept(walk.rested, walk.pending) - negotiating:
                self._forget(key)
        if walk.batch:
            self._negotiator.start(walk.batch)
        if walk.nowhere:
            await self._stay_pending(walk.nowhere)

    def _walk_job(self, job: jobs_pb2.Job, walk: _Walk) -> bool:
        """Consider the waiting tasks of ``job``; False when no more negotiations may start
        this cycle (the walk ends)."""
        self._line.reading(job.id)
        if job.cancel_requested:
            return True
        rest = Rest(job)
        job_gangs = gangs(job)
        in_gangs = {t.name for parts in job_gangs.values() for t in parts}
        for task in job.tasks:
            # A gang's parts are considered with their gang, below.
            if task.name not in in_gangs and not self._walk_task(job, task, rest, walk):
                return False
        for parts in job_gangs.values():
            if len(walk.batch) + len(parts) > walk.room:
                self._loop.full = True
                walk.swept = False
                return False
            walk.pending.update((job.id, t.name) for t in parts if t.state == job_state.PENDING)
            started, waits = self._considering.gang(
                job, parts, walk.cycle, walk.negotiating, rest, walk.now, walk.wall
            )
            walk.batch.extend(started)
            walk.nowhere.extend(waits)
        if self._line.rest(rest):
            walk.rested.add(job.id)
        return True

    def _walk_task(
        self, job: jobs_pb2.Job, task: jobs_pb2.TaskStatus, rest: Rest, walk: _Walk
    ) -> bool:
        """Consider one task of ``job`` if it waits and its timers let it; False when no more
        negotiations may start this cycle."""
        key = (job.id, task.name)
        if task.state != job_state.PENDING or key in walk.negotiating:
            rest.awake |= key in walk.negotiating  # its negotiation may end with no write
            return True
        walk.pending.add(key)
        if (retry_in_s := retries.due_in_s(task, walk.wall)) > 0:
            # Waits out the backoff after a failed attempt; the timer wakes us.
            self._line.not_before(key, walk.now + retry_in_s)
        if (not_before := self._line.due_at(key)) > walk.now:
            rest.add(key, not_before)
            return True
        if len(walk.batch) >= walk.room:
            self._loop.full = True
            walk.swept = False
            return False
        outcome = self._considering.task(job, task.name, walk.cycle)
        if isinstance(outcome, Negotiation):
            walk.batch.append(outcome)
            rest.awake = True
            return True
        if outcome is not None and list(task.verdicts) != outcome:
            walk.nowhere.append((job.id, task.name, outcome))  # else nothing to write
        if (not_before := self._line.due_at(key)) > walk.now:
            rest.add(key, not_before)  # backed off just now
        else:
            rest.awake = True  # waits for its dependencies, not a timer
        return True

    async def _stay_pending(self, nowhere: Waits) -> None:
        """Record why tasks fit nowhere; written only when the reasons change."""
        results = await self._jobs.update_many(
            [(job_id, stay_pending(task, verdicts)) for job_id, task, verdicts in nowhere]
        )
        for job_id, result in results.items():
            if isinstance(result, FederationError):
                log.warning("pending_update_failed", job=job_id, error=str(result))

    def _forget(self, key: TaskKey) -> None:
        self._line.forget(key)
        self._preemption.forget(key)
        self._waiting.forget(key)
