"""The scheduling loop: place pending tasks and negotiate each with the chosen sites.

Every round of offers carries a new epoch (the task's fencing token), and DELEGATED with that
epoch is written before the commit leaves, so a restarted coordinator never forgets a task it
handed to a site and committed epochs only grow. The epoch of an offer is not written before
the offer leaves: a site runs nothing without a commit, and a commit follows only the durable
DELEGATED, which requires an epoch above every one the task has recorded. An offer's epoch
that a coordinator issued and then lost in a crash can be issued again, to a reservation that
is never committed (it lapses or is released) or, at the same site, as that same reservation.

Once a commit has left, only the site's refusal puts the task back to PENDING here: a commit
without an answer leaves it DELEGATED for the site's next hello to settle, so a task never
runs twice because a leader died, or an answer was lost, between a commit and its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import structlog

from federation import tracing
from federation.api.v1 import admin_service_pb2, jobs_pb2, resources_pb2, site_link_service_pb2
from federation.common import job_state
from federation.common.keys import TaskKey
from federation.coordinator import retries, spread
from federation.coordinator.checkpoint_copies import PROTOCOL as CKPT_PROTOCOL
from federation.coordinator.checkpoint_copies import restore_input
from federation.coordinator.forecast import SiteHistory
from federation.coordinator.jobs import (
    Change,
    JobRepository,
    Mutation,
    find_spec,
    find_task,
    transition,
    unplace,
)
from federation.coordinator.learning import SpeedLearner
from federation.coordinator.outputs import DATASET, source_of, staged
from federation.coordinator.outputs import PROTOCOL as DATA_PROTOCOL
from federation.coordinator.policy.preemption import (
    Candidate,
    TaskAt,
    choose_victims,
    fits,
    free_room,
    may_stop,
    ready_s,
)
from federation.coordinator.policy.queues import QueueBook
from federation.coordinator.policy.quota import Debt
from federation.coordinator.policy.resources import Demand, at, demand, kind_of
from federation.coordinator.policy.sharing import Admitted, Sharing, Tentative, task_demand
from federation.coordinator.policy.stopped_for import HOLD_REASON, StoppedFor
from federation.coordinator.policy.usage import placed
from federation.coordinator.sites import SessionClosedError, SiteRegistry, cancel_request
from federation.coordinator.staged_inputs import Registered, holders_away, resolve
from federation.coordinator.validation import TASK_OUTPUT
from federation.coordinator.waits import (
    WAIT_GAIN,
    Holding,
    Wait,
    Waiter,
    holdings,
    predictable,
    sooner_by_waiting,
    wait_at,
)
from federation.errors import FederationError, UnavailableError
from federation.jobspec import domain_name
from federation.metrics import (
    OFFERS,
    PREEMPTIONS,
    SCHEDULING_JOBS_READ,
    SCHEDULING_WALK_SECONDS,
)
from federation.placement.estimates import Estimates, estimate
from federation.placement.framework import Code, Framework, Rejection
from federation.placement.plugins.near_region import NearRegion, describe
from federation.placement.request import Input, Request
from federation.placement.selectors import VERDICTS, selector_matches
from federation.placement.snapshot import Snapshot
from federation.resources import KINDS, add, owner_share_refusal
from federation.timeslice import SLICE_S, TimeSlice

log = structlog.get_logger()

NEGOTIATE = "Negotiate"
QUOTA = "Quota"
OWNER_SHARE = "OwnerShare"
SPREAD = "Spread"
"""The stage of a verdict that holds a task back for its queue's quota, at every site."""
PREEMPT = "Preempt"
"""The stage of the verdict naming the tasks stopped to make room for a waiting one."""
RECLAIMED = "a queue taking back the nominal quota it lent"
"""Why a task on borrowed quota was stopped (naming no other job or queue)."""
WAIT = "Wait"
"""The stage of the verdict of a task that waits for a busy site (``waits``)."""
RETRY = "Retry"
"""The stage of what holds back a failed task waiting out its backoff (explain only)."""
INPUTS = "Inputs"
"""The stage of the verdict of a task whose inputs are held by a site not connected now."""
WAIT_RECHECK_S = 30.0
"""Longest a task waits for a busy site before its choice is weighed again; a task's end
there wakes it sooner."""
WAIT_SLACK_S = 5.0
"""A task waits for a busy site at most this long past the start its first wait promised
(or a quarter of that wait, if longer): what runs there may overrun its estimate for ever,
and each recheck would promise "any moment now" again."""
FRONT_OF_LINE = 64
"""Waiting jobs whose retry timers a task's end clears (``capacity_freed``)."""
QUEUE_GAUGES_EVERY_S = 5.0
"""How often the scheduling loop refreshes the queues' gauges (listing queues does too)."""
TIMER_PACE = 20
"""After a cycle, a retry timer alone starts the next one no sooner than this many times the
cycle's walk of the line later: a backlog whose timers come due one after another then costs
a walk now and then (at most 1/21 of the loop), not one walk after another."""
CHECKPOINT = "checkpoint:"
"""Placement input naming the newest checkpoint of a task that restarts from it."""
MAX_REMEMBERED_PLACEMENTS = 10_000
"""Distinct requests whose placement on the current snapshot is kept for later cycles."""


_OfferReply: TypeAlias = tuple[str, str, site_link_service_pb2.OfferAnswer | None]
"""A site's reply to one offer: (reservation id, "", the answer) when it accepts, else ("",
why not, None)."""


@dataclass(slots=True)
class _Rest:
    """A waiting job whose every waiting task waits out a timer: until the soonest is due,
    and while the job is not written again, a cycle has nothing to try in it."""

    job: jobs_pb2.Job
    """The cached message as it was: the repository replaces it at every write."""
    keys: list[TaskKey] = field(default_factory=list)
    until: float = math.inf
    awake: bool = False
    """A task of it is to be tried, or under negotiation: the job does not rest."""
    unfit: bool = False
    """Every site refused each of its waiting tasks for what room coming free cannot change."""

    def add(self, key: TaskKey, not_before: float) -> None:
        self.keys.append(key)
        self.until = min(self.until, not_before)


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    offer_timeout_s: float = 5.0
    """How long a site may take to answer an offer or a commit."""
    reservation_lease_s: float = 10.0
    """How long a site holds a reservation that no commit follows."""
    max_offers_per_round: int = 5
    """Sites tried, best first, before a task goes back to PENDING."""
    offers_at_once: int = 3
    """Sites offered a task at the same time once the best site has declined it; the best one
    that accepts gets the commit (see ``offer_rounds``)."""
    retry_interval_s: float = 5.0
    """Longest wait before pending tasks are tried again without any change."""
    unfit_retry_interval_s: float = 60.0
    """The same for tasks every site refused for what room coming free cannot change
    (``UNFIT``); each of their waits is cut by up to a fifth at random, to spread them."""
    max_concurrent_negotiations: int = 2048
    batch_window_s: float = 0.002
    """Shortest time between two scheduling cycles (see ``Scheduler.run``)."""
    preemption_min_run_s: float = 60.0
    """A task runs at least this long before it may be preempted, so work does not thrash."""
    reclaim_min_run_s: float = 120.0
    """A task on borrowed quota runs at least this long before its lender takes it back."""
    wait_gain: float = WAIT_GAIN
    """A task waits for a busy site where it would finish by this share of its finish on the
    best site free now (``waits``); 0: tasks never wait while some site can take them."""


DEVICE_KINDS = frozenset(KINDS.values())


@dataclass(slots=True)
class _Cycle:
    """What one scheduling cycle builds as it goes."""

    tentative: Tentative = field(default_factory=dict)
    """What it admitted against queues' quotas, not yet held by a negotiation."""
    snapshot: Snapshot | None = None
    placements: dict[Request, _Placement] = field(default_factory=dict)
    holding: dict[str, list[Holding]] | None = None
    """What the tasks at each site hold and until when, gathered once a wait is weighed."""
    guests: dict[str, dict[str, float]] | None = None
    """Per site that keeps an owner share, what other tenants' tasks hold there (with what
    this cycle sent there), gathered once a task of another tenant may go there."""
    devices_left: dict[str, dict[str, float]] | None = None
    """Per site, its free whole devices by kind less those this cycle's offers were sent for,
    gathered once a task that needs whole devices is offered (``_with_devices_left``)."""


@dataclass(slots=True)
class _Negotiation:
    """One task on its way through the negotiation rounds of a batch."""

    job_id: str
    task: str
    candidates: tuple[str, ...]
    """Sites to try, best first."""
    verdicts: list[jobs_pb2.SiteVerdict]
    """Why sites did not take it: placement's, then each refusal."""
    estimates: dict[str, jobs_pb2.Estimate]
    """Placement's estimate per site; a site that accepts with its own run time replaces it
    there (``committed``)."""
    holds: dict[str, float] = field(default_factory=dict)
    """What it counts against its queue while offers are out (``Admitted.holds``)."""
    models: dict[str, list[str]] = field(default_factory=dict)
    """Per site, the only device models its queues' quotas let it be given there."""
    slower: set[str] = field(default_factory=set)
    """Sites that accepted with a longer run time than placement estimated there."""
    deferred: set[str] = field(default_factory=set)
    """Slower sites let go once for untried sites estimated sooner (tried again last)."""
    settled: bool = False
    """Delegated, or moot (cancelled meanwhile): not to be put back to PENDING."""
    epoch: int = 0
    """The epoch of its latest round's offers."""
    revision: int = 0
    """The revision of the spec its offers carried (a service changed meanwhile is not
    delegated with the spec it had before)."""
    chosen: tuple[str, str] | None = None
    """The site and reservation it is delegated to, once a round found one."""
    over: bool = False
    """Let go already (delegated before the rest of its batch ended): the batch must not
    touch it again, since a later negotiation may hold the task by then."""
    key: TaskKey = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.job_id, self.task)


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
        self._datasets = datasets
        """The registered datasets, whose holders sign URLs for tasks reading them."""
        self._learner = learner or SpeedLearner()
        """Speeds learned from finished tasks: estimates and offers use them."""
        self._sharing = sharing or Sharing(QueueBook(jobs.store), jobs.usage)
        """Queues: who goes first, and which tasks their quotas hold back."""
        self._sites = sites
        self._framework = framework
        self._config = config
        self._wake = asyncio.Event()
        self._not_before: dict[TaskKey, float] = {}
        self._backoff_s: dict[TaskKey, float] = {}
        self._resting: dict[str, _Rest] = {}
        """Per waiting job whose every waiting task waits out a timer, as the last cycle that
        looked at it found: the next cycles pass it by without reading it (``_awake``)."""
        self._unfit: set[TaskKey] = set()
        """Waiting tasks that every site refused, the last time, for reasons room coming free
        does not change (``UNFIT``)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._selectors_evaluating: set[str] = set()
        """Selectors whose verdicts on some device class are being found (in a thread)."""
        self._full = False
        """A cycle left tasks waiting because max_concurrent_negotiations were under way."""
        self._last_cycle = 0.0
        self._walk_s = 0.0
        """How long the last cycle took to walk the line (``TIMER_PACE``)."""
        self._cycle_end = 0.0
        self._placed_on: Snapshot | None = None
        self._placements: dict[Request, _Placement] = {}
        self._gauges_at = 0.0
        self._preempting: dict[TaskKey, list[tuple[str, str, int]]] = {}
        """Per waiting task, the (job, task, epoch) it had stopped while it waits."""
        self._stopped_for = StoppedFor(self._status_of, lambda key: key in self._preempting)
        """Tasks stopped for a waiting one, kept from the room they freed until it runs."""
        self._claims: dict[TaskKey, dict[str, float]] = {}
        """Per waiting task of a queue that had tasks stopped for it, what it will hold (at
        the site it waits for) until it is admitted: no other task takes that quota meanwhile,
        not even the victims back, borrowing again."""
        self._waiting: dict[str, dict[TaskKey, Waiter]] = {}
        """Per busy site, the tasks that chose to wait for it, in the order they chose."""
        self._waits_for: dict[TaskKey, str] = {}
        self._promised: dict[TaskKey, float] = {}
        """Per task that waited for a busy site: by when (monotonic) it was to start there,
        slack included (``_within_promise``)."""
        self._front_due = False
        """The front of the line is to be tried at the next cycle (``_clear_front_of_line``)."""
        self._frees = 0
        """How often room came free (a task ended, a view showed more, a reservation was let
        go): a negotiation compares it."""
        self.history = SiteHistory()
        """How often tasks come to each site and how long they run there."""
        self._offered_parts: dict[str, dict[str, str]] = {}
        """Per job, its parts of divided tasks under negotiation, with the site each is offered
        to: a later part's skew counts them (``spread.placed_parts``)."""

    def wake(self) -> None:
        self._wake.set()

    def room_freed(self) -> None:
        """Room in a queue's quota came free without a task ending (a change that would have
        added replicas was given up): the front of the line is tried at once."""
        self._front_due = True
        self.wake()

    def capacity_freed(self, site: str, ran_s: float) -> None:
        """A task ended (at ``site``, after ``ran_s``): what it held goes to the first in line
        (``Sharing.order``), not to whichever waiting task's retry timer happens to come
        due first: its queue's quota is free now. The site's report may come before its
        view shows the room free, so the front is tried again when it does (``_cycle``)."""
        self.history.ended(site, ran_s)
        self._frees += 1
        self.room_freed()

    def _clear_front_of_line(self) -> None:
        """Let the first ``FRONT_OF_LINE`` waiting jobs be tried at once, whatever their retry
        timers: freed room is theirs (but not jobs resting unfit, ``UNFIT``: it cannot help
        them). Only the front: clearing every timer at each task end would place every
        waiting task again, which a flood of short jobs makes costly.
        The front is the cycle's fair order with each job counted as admitted: without that
        the queue with the smallest share fills the whole front, and only its tasks would
        be tried when many GPUs free at once."""
        tentative: Tentative = {}
        wall = time.time()
        for job in itertools.islice(self._line(tentative, self._fit()), FRONT_OF_LINE):
            for task in job.tasks:
                key = (job.id, task.name)
                if retries.due_in_s(task, wall) > 0:
                    continue  # its backoff after a failed attempt holds
                if task.state == job_state.PENDING and job.spec.queue:
                    self._sharing.admit(job, task_demand(job, task.name), tentative)
                if key not in self._waits_for:  # woken once the room shows (``_cycle``)
                    self._not_before.pop(key, None)
                    self._backoff_s.pop(key, None)
                    self._resting.pop(job.id, None)

    def _with_learned_speeds(self, request: Request) -> Request:
        """``request`` estimated with learned speeds where the task sets none of its own."""
        speeds = self._learner.overrides(request.workload_class, dict(request.speed))
        if speeds == dict(request.speed):
            return request
        return dataclasses.replace(request, speed=tuple(sorted(speeds.items())))

    async def run(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: in Python 3.11 wait_for can swallow a
            # cancellation that races with the event being set, and stop() would hang.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._next_wait_s()):
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

    def _next_wait_s(self) -> float:
        """Until the soonest backed-off task is due (due ones were handled this cycle), but
        no sooner than ``TIMER_PACE`` walks of the line, nor later than the retry interval."""
        now = time.monotonic()
        future = [t for t in self._not_before.values() if t > now]
        soonest = min(future, default=now + self._config.retry_interval_s)
        paced_s = max(soonest - now, TIMER_PACE * self._walk_s)
        return max(0.01, min(paced_s, self._config.retry_interval_s))

    async def _cycle(self) -> None:
        if self._sites.take_arrived():
            # A site came or came back: what no site had may be there now (a task's end never
            # brings it, so ``_clear_front_of_line`` leaves unfit tasks alone).
            for key in self._unfit:
                self._not_before.pop(key, None)
                self._resting.pop(key[0], None)
        freed = self._sites.take_freed()
        if freed:
            # Views show room they had not (a task ended, a reservation was let go, a site
            # came back): it goes to the first in line, not to whichever retry timer comes
            # due first. Tasks that wait for a busy site are tried only now: before, the
            # site's view still showed the room taken. After a failover, sites coming back
            # let the first in line count the room of what the last leader was stopping
            # for them rather than stop more (``_preempt_for``).
            self._frees += 1
            for key, site in self._waits_for.items():
                if site in freed:
                    self._not_before.pop(key, None)
                    self._resting.pop(key[0], None)
        if freed or self._front_due:
            # Here, as a cycle starts, not where the room came free: a cycle under way
            # (it rests now and then) would back off again the tasks it finds held back
            # by what was just let go, undoing the clearing.
            self._front_due = False
            self._clear_front_of_line()
        now, wall = time.monotonic(), time.time()
        # Tasks under negotiation are the ones the repository holds out of pending(); as the
        # cycle starts: one let go while it rests is neither tried now nor taken for gone
        # (forgetting it would forget the tasks being stopped for it, and stop more).
        held = set(self._jobs.held)
        room = self._config.max_concurrent_negotiations - len(held)
        self._full = room <= 0
        if self._full:
            return  # the next negotiation to end wakes the loop again
        cycle = _Cycle()
        batch: list[_Negotiation] = []
        nowhere: list[tuple[str, str, list[jobs_pb2.SiteVerdict]]] = []
        pending: set[TaskKey] = set()
        rested: set[str] = set()  # jobs passed by, resting (``_awake``)
        swept = True
        # What the queues hold as the cycle starts, all through it: negotiations and tasks
        # that end while it rests would let a task later in line take room or quota that one
        # it already refused (on what was held then) should have had. Next cycle, theirs.
        walk_started = time.monotonic()
        with self._sharing.as_of_now(cycle.tentative):
            # Thousands of waiting tasks (one tenant's flood) must not stall every other call
            # on the loop: rest now and then to let them in, and go on with the jobs still
            # pending.
            timeslice = TimeSlice(rest_s=SLICE_S)
            read = 0
            for job in self._line(cycle.tentative, self._awake(now, rested)):
                await timeslice.share()
                read += 1
                self._resting.pop(job.id, None)
                if job.cancel_requested:
                    continue
                rest = _Rest(job)
                for task in job.tasks:
                    key = (job.id, task.name)
                    if task.state != job_state.PENDING or key in held:
                        rest.awake |= key in held  # its negotiation may end with no write
                        continue
                    pending.add(key)
                    if (retry_in_s := retries.due_in_s(task, wall)) > 0:
                        # Waits out the backoff after a failed attempt; the timer wakes us.
                        self._not_before[key] = max(
                            self._not_before.get(key, 0.0), now + retry_in_s
                        )
                    if (not_before := self._not_before.get(key, 0.0)) > now:
                        rest.add(key, not_before)
                        continue
                    if len(batch) >= room:
                        self._full = True
                        swept = False
                        break
                    outcome = self._consider(job, task.name, cycle)
                    if isinstance(outcome, _Negotiation):
                        batch.append(outcome)
                        rest.awake = True
                        continue
                    if outcome is not None and list(task.verdicts) != outcome:
                        nowhere.append((job.id, task.name, outcome))  # else nothing to write
                    if (not_before := self._not_before.get(key, 0.0)) > now:
                        rest.add(key, not_before)  # backed off just now
                    else:
                        rest.awake = True  # waits for its dependencies, not a timer
                if not swept:
                    break
                if rest.keys and not rest.awake:
                    rest.unfit = all(key in self._unfit for key in rest.keys)
                    self._resting[job.id] = rest
                    rested.add(job.id)
        self._walk_s = time.monotonic() - walk_started
        SCHEDULING_WALK_SECONDS.observe(self._walk_s)
        SCHEDULING_JOBS_READ.inc(read)
        if swept:
            # Forget the backoff of tasks no longer waiting (placed, cancelled, failed).
            self._resting = {job_id: self._resting[job_id] for job_id in rested}
            waiting = pending.union(*(rest.keys for rest in self._resting.values()))
            known = set(self._not_before) | self._backoff_s.keys() | self._unfit
            for key in known - waiting - held:
                self._forget(key)
        if batch:
            self._jobs.hold((n.key, n.holds) for n in batch)
            runner = asyncio.create_task(self._negotiate(batch, self._frees))
            self._tasks.add(runner)
            runner.add_done_callback(self._tasks.discard)
        if nowhere:
            await self._stay_pending(nowhere)

    def _consider(
        self, job: jobs_pb2.Job, task: str, cycle: _Cycle
    ) -> _Negotiation | list[jobs_pb2.SiteVerdict] | None:
        """One waiting task, through its queue's quota and placement: a negotiation to
        start, or the verdicts it waits with (backed off), or None (its dependencies have
        not succeeded, or placing it failed)."""
        key = (job.id, task)
        started_ns = tracing.now_ns()
        self._stop_waiting(key)
        self._unfit.discard(key)
        try:
            need = task_demand(job, task)
            queued = bool(job.spec.queue)
            held_back: jobs_pb2.SiteVerdict | None = None
            debts: list[Debt] = []
            # What is claimed by the tasks that had others stopped for them counts too.
            tentative = self._with_claims(cycle, key) if queued else cycle.tentative
            if queued and (why := self._sharing.admission(job, need, tentative)):
                self._backoff(key)  # a task's end wakes it (``capacity_freed``)
                held_back = jobs_pb2.SiteVerdict(stage=QUOTA, reason=why)
                debts = self._owed(job, task, need, cycle)
                if not debts:
                    return [held_back]
            if cycle.snapshot is None:
                # Built only when something waits: every view delta wakes the loop, and
                # flattening the federation into arrays is the expensive part of a cycle.
                cycle.snapshot = self._sites.snapshot()
                cycle.placements = self._placements_on(cycle.snapshot)
            request = request_for(job, task)
            if request is None:
                return None  # waits for its dependencies; a report of theirs wakes us
            reads_data = any(t.outputs for t in job.spec.tasks) or any(
                i.dataset.startswith(DATASET) for i in find_spec(job, task).inputs
            )
            if reads_data and (away := holders_away(job, task, self._sites)):
                self._backoff(key)  # no offer while no one can sign its inputs' URLs
                why = f"waiting for site {', '.join(away)}, which holds its inputs, to connect"
                return [jobs_pb2.SiteVerdict(stage=INPUTS, reason=why)]
            request = self._with_learned_speeds(request)
            if request.selector and self._selector_unevaluated(request.selector, cycle.snapshot):
                return None  # its verdicts are being found; that wakes us
            placement = cycle.placements.get(request)
            reused = placement is not None
            if placement is None:
                placement = cycle.placements[request] = self._place(request, cycle.snapshot)
            verdicts, ranked, estimates, busy, unfit = placement
            if held_back is not None:  # owed what the queues beside its queue borrow
                short = {v.site for v in verdicts if v.code == Code.INSUFFICIENT_FREE_CAPACITY}
                options = [(debts, {*ranked, *short}, need)]
                return [held_back, *self._reclaim_for(job, task, options, cycle)]
            feasible = ranked
            if not ranked:
                self._backoff(key, unfit=unfit)
                if unfit:
                    self._unfit.add(key)
                return [*verdicts, *self._preempt_for(job, task, verdicts, cycle)]
            if queued:
                admitted = self._where(job, task, need, ranked, cycle.snapshot, tentative)
            else:
                admitted = Admitted(list(ranked), {}, need, [])
            kept, kept_for_owners = self._within_owner_shares(job, need, admitted.sites, cycle)
            kept, behind = self._stopped_for.held_back(key, kept)
            refused = [
                *_verdicts(QUOTA, admitted.refused),
                *_verdicts(OWNER_SHARE, kept_for_owners),
                *_verdicts(PREEMPT, [(site, HOLD_REASON) for site in behind]),
            ]
            if not kept:
                self._backoff(key)  # a task's end wakes it (``capacity_freed``)
                domain_of = self._sites.domain_of
                at_sites: list[tuple[list[Debt], set[str], Demand]] = [
                    (owed, {site}, counted)
                    for site, _ in admitted.refused
                    for counted in self._counted(job, task, need, site, cycle.snapshot)
                    if (owed := self._owed(job, task, at(counted, site, domain_of(site)), cycle))
                ]
                return [*verdicts, *refused, *self._reclaim_for(job, task, at_sites, cycle)]
            ranked = tuple(kept)
            verdicts = (*verdicts, *refused)
            if spread.PART in task:
                kept, apart = self._within_spread(job, task, feasible, ranked, cycle.snapshot)
                verdicts = (*verdicts, *_verdicts(SPREAD, apart))
                if not kept:
                    self._backoff(key)  # a sibling's placement or end wakes it
                    return list(verdicts)
                ranked = tuple(kept)
            wait = self._sooner_by_waiting(request, placement, ranked, cycle) if busy else None
            if wait is not None and self._within_promise(key, wait):
                self._wait_for(key, wait)
                return [_waiting_verdict(wait, ranked[0], estimates[ranked[0]].total_s)]
            ranked = _with_devices_left(ranked, need, cycle)
            if not ranked:
                # Earlier tasks in line were offered the devices free now: offered too, it
                # would be declined and held meanwhile, counting against its queue's share.
                self._backoff(key)  # their negotiations' end, or a task's, wakes it
                return None
        except Exception:
            # One task's bad spec or a plugin's bug must not hold up the others.
            log.exception("placement_failed", job=job.id, task=task)
            self._backoff(key)
            return None
        if queued:
            self._sharing.admit(job, admitted.holds, cycle.tentative)
            self._claims.pop(key, None)  # counted now by what it was admitted with
        if cycle.guests is not None:
            shares = self._sites.owner_shares()
            for site in ranked:  # wherever it may go: no second guest in this cycle over-asks
                if site in cycle.guests and job.spec.tenant not in shares[site].tenants:
                    add(cycle.guests[site], need.items())
        if tracing.on():
            best = estimates[ranked[0]]
            tracing.record(
                "task.place",
                job.id,
                started_ns,
                task=task,
                attributes={
                    "federation.ranked": list(ranked),
                    "federation.estimate_s": best.total_s,
                    "federation.estimate_run_s": best.run_s,
                    "federation.placement_reused": reused,
                    "federation.refused_sites": len(verdicts),
                },
            )
        if spread.PART in task:
            self._offered_parts.setdefault(job.id, {})[task] = ranked[0]
        return _Negotiation(
            job.id,
            task,
            ranked,
            list(verdicts),
            estimates,
            holds=admitted.holds,
            models=admitted.models,
        )

    def _within_spread(
        self,
        job: jobs_pb2.Job,
        task: str,
        feasible: Sequence[str],
        ranked: Sequence[str],
        snapshot: Snapshot,
    ) -> tuple[list[str], list[tuple[str, str]]]:
        """Of ``ranked``, the sites where part ``task`` of a divided task may go by its spread
        (``spread``): the one its static weights give it, or those within its skew; and
        (site, why) for the others. ``feasible`` are the sites placement found for it."""
        rule = find_spec(job, task).spread
        what = spread.part_of(task)
        if rule.site_weights:
            parts = sum(1 for t in job.tasks if t.part_of == what)
            division = spread.static_division(parts, rule.site_weights)
            number = spread.part_number(task)
            site = division[number] if number < len(division) else ""
            why = f"part {number} of {what} goes to {site} by its site weights"
            if site not in ranked:
                return [], [(site, f"{why}, which cannot take it now")]
            return [site], [(s, why) for s in ranked if s != site]
        if not rule.max_skew:
            return list(ranked), []  # division by available capacity: soonest finish wins
        topology = spread.TOPOLOGY.get(rule.topology, "site")

        def value_of(site: str) -> str:
            index = snapshot.site_index(site)
            if topology == "site" or index is None:
                return site
            if topology == "domain":
                return domain_name(int(snapshot.domain[index]))
            return str(snapshot.region[index])

        counts = spread.placed_parts(job, task, value_of, self._offered_parts.get(job.id, {}))
        return spread.within_skew(ranked, feasible, value_of, counts, rule.max_skew, what, topology)

    def _where(
        self,
        job: jobs_pb2.Job,
        task: str,
        need: dict[str, float],
        ranked: Sequence[str],
        snapshot: Snapshot,
        tentative: Tentative,
    ) -> Admitted:
        """The sites of ``ranked`` (and models there) the quotas of the job's queues let the
        task run at, with what it then counts against them (``Sharing.where``)."""
        spec = find_spec(job, task)
        acc = spec.resources.accelerator
        accepted = set(acc.models)

        def models_at(site: str) -> set[str]:
            models = snapshot.device_models(acc.kind, site)
            return models & accepted if accepted else models

        return self._sharing.where(
            job, spec, need, ranked, models_at, self._sites.domain_of, tentative
        )

    def _counted(
        self, job: jobs_pb2.Job, task: str, need: Demand, site: str, snapshot: Snapshot
    ) -> list[Demand]:
        """What the job's task may count against its queues' quotas at ``site`` (before
        ``at`` it): ``need``, or for a task that names not one model, ``need`` with each model
        it may be given there (as ``Sharing.where`` counts it)."""
        spec = find_spec(job, task)
        acc = spec.resources.accelerator
        kind = kind_of(spec)
        if kind is None or len(acc.models) == 1:
            return [need]
        models = snapshot.device_models(acc.kind, site)
        base = {r: amount for r, amount in need.items() if "/" not in r}
        return [need] + [
            {**base, f"{kind}/{model}": base[kind]}
            for model in sorted(models & set(acc.models) if acc.models else models)
        ]

    def _within_owner_shares(
        self, job: jobs_pb2.Job, need: Demand, sites: Sequence[str], cycle: _Cycle
    ) -> tuple[list[str], list[tuple[str, str]]]:
        """Of ``sites``, those whose owner share leaves the job's tenant room for a task that
        needs ``need``; and (site, why) for the others. The site checks it again when offered
        the task."""
        shares = self._sites.owner_shares()
        tenant = job.spec.tenant
        if not shares or all(tenant in shares[s].tenants for s in sites if s in shares):
            return list(sites), []
        if cycle.guests is None:
            cycle.guests = self._guests(shares)
        kept, refused = [], []
        for site in sites:
            share = shares.get(site)
            why = share and owner_share_refusal(
                share, tenant, need, cycle.guests[site], self._sites.site_capacity(site)
            )
            if why:
                refused.append((site, why))
            else:
                kept.append(site)
        return kept, refused

    def _guests(
        self, shares: Mapping[str, resources_pb2.OwnerShare]
    ) -> dict[str, dict[str, float]]:
        """Per site that keeps an owner share, what other tenants' tasks hold there."""
        out: dict[str, dict[str, float]] = {site: {} for site in shares}
        for job in self._jobs.at_site():
            for spec, status in zip(job.spec.tasks, job.tasks, strict=False):
                share = shares.get(status.site)
                if (
                    share is not None
                    and status.state in job_state.AT_SITE
                    and job.spec.tenant not in share.tenants
                ):
                    add(out[status.site], demand(spec, status.models).items())
        return out

    def _sooner_by_waiting(
        self, request: Request, placement: _Placement, ranked: Sequence[str], cycle: _Cycle
    ) -> Wait | None:
        """A busy site where the task would finish sooner by waiting (``waits``) than at
        ``ranked[0]``, or None."""
        _, _, estimates, busy, _ = placement
        if cycle.snapshot is None:
            return None
        now = time.time()
        if cycle.holding is None:
            cycle.holding = holdings(self._jobs.at_site(), now)
        waiting = self._waiters()
        return sooner_by_waiting(
            request,
            cycle.snapshot,
            busy,
            estimates[ranked[0]].total_s,
            cycle.holding,
            waiting,
            now,
            self._config.wait_gain,
        )

    def _within_promise(self, key: TaskKey, wait: Wait) -> bool:
        """Whether the task may (still) wait: not yet past the start its first wait promised,
        and the slack. Past it, the task goes where it can start now."""
        now = time.monotonic()
        promised = self._promised.setdefault(
            key, now + wait.wait_s + max(WAIT_SLACK_S, wait.wait_s / 4)
        )
        return now <= promised

    def _wait_for(self, key: TaskKey, wait: Wait) -> None:
        """Hold the task back for ``wait.site``: a task's end wakes it (``capacity_freed``),
        and it is weighed again by then anyway, should what runs there overrun."""
        self._waiting.setdefault(wait.site, {})[key] = wait.waiter
        self._waits_for[key] = wait.site
        self._backoff_s.pop(key, None)
        due = min(wait.wait_s + 1.0, WAIT_RECHECK_S)
        self._not_before[key] = time.monotonic() + due

    def forecasts(self, sites: Iterable[str]) -> dict[str, admin_service_pb2.SiteForecast]:
        """Per site: when room should next free there, what waits for it, and its history."""
        now = time.time()
        waiting = {site: len(line) for site, line in self._waiting.items()}
        return self.history.forecasts(sites, holdings(self._jobs.at_site(), now), waiting, now)

    def _predicted_waits(
        self, key: TaskKey, request: Request, snapshot: Snapshot, busy: list[int]
    ) -> dict[str, Wait]:
        """For ``explain``: when task ``key`` would start and finish at each busy site."""
        if not busy or not predictable(request):
            return {}
        now = time.time()
        holding = holdings(self._jobs.at_site(), now)
        waiting = self._waiters(but=key)
        found = (wait_at(request, snapshot, i, holding, waiting, now) for i in busy)
        return {wait.site: wait for wait in found if wait is not None}

    def _waiters(self, but: TaskKey | None = None) -> dict[str, list[Waiter]]:
        """Per busy site, the tasks waiting for it in the order they chose to (but ``but``)."""
        return {
            site: [waiter for key, waiter in line.items() if key != but]
            for site, line in self._waiting.items()
        }

    def _stop_waiting(self, key: TaskKey) -> None:
        site = self._waits_for.pop(key, None)
        if site is not None:
            line = self._waiting[site]
            line.pop(key, None)
            if not line:
                del self._waiting[site]

    def _preempt_for(
        self,
        job: jobs_pb2.Job,
        task: str,
        verdicts: tuple[jobs_pb2.SiteVerdict, ...],
        cycle: _Cycle,
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
        snapshot = cycle.snapshot
        need = task_demand(job, task)
        short = {v.site for v in verdicts if v.code == Code.INSUFFICIENT_FREE_CAPACITY}
        lenders: dict[str, set[str]] = {}
        if not urgent:
            # What it would hold there, as the queues' site, domain and model quotas count it.
            claimed, domain_of = self._claimed(cycle, key), self._sites.domain_of
            for site in short:
                there = at(need, site, domain_of(site))
                if found := self._sharing.lenders(job, there, claimed):
                    lenders[site] = found
            short = set(lenders)
        if not short:
            return ()
        if key in self._preempting:
            # Once per waiting spell: the room is summed per site, not fitted per node, so a
            # second round could stop more and more tasks for a task that never fits.
            return ()
        room, stopping = self._room_coming_free(snapshot, short)
        for site, stopped in stopping.items():
            if fits(need, room[site]):
                # Tasks already being stopped make the room (stopped before this leader's
                # term, say): they become its victims, and it stops no more while it waits.
                self._preempting[key] = stopped
                self._stopped_for.stopped(site, key, stopped)
                self._claim(key, job, need, site)
                reason = f"waits for {len(stopped)} task(s) being stopped to make room"
                return (jobs_pb2.SiteVerdict(site=site, stage=PREEMPT, reason=reason),)
        candidates = self._preemption_candidates(job, short, lenders)
        choice = choose_victims(need, room, candidates)
        if choice is None:
            return ()
        site, victims = choice
        self._preempting[key] = [(v.job_id, v.task, v.epoch) for v in victims]
        self._preempting[key] += stopping.get(site, [])  # theirs counts too: no other's
        self._stopped_for.stopped(site, key, self._preempting[key])
        # Tenants see their own jobs only: the reason names no other job or queue.
        why = f"a job of priority {job.spec.priority}" if urgent else RECLAIMED
        self._claim(key, job, need, site)
        self._start_preempting(key, victims, why)
        return (
            jobs_pb2.SiteVerdict(
                site=site,
                stage=PREEMPT,
                reason=f"stopping {len(victims)} task(s) of lower priority or borrowed quota "
                "to make room",
            ),
        )

    def _owed(self, job: jobs_pb2.Job, task: str, need: Demand, cycle: _Cycle) -> list[Debt]:
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
        if stopping and (adopted := choose_victims({}, {"": {}}, stopping, debts)) is not None:
            self._preempting[key] = [(v.job_id, v.task, v.epoch) for v in adopted[1]]
            self._claims[key] = dict(need)
            return []
        debts = self._sharing.owed(job, need, claimed)
        return debts if all(debt.over for debt in debts) else []

    def _reclaim_for(
        self,
        job: jobs_pb2.Job,
        task: str,
        options: Sequence[tuple[list[Debt], set[str], Demand]],
        cycle: _Cycle,
    ) -> tuple[jobs_pb2.SiteVerdict, ...]:
        """A task its quotas hold back though it is within its nominal ones, as the queues
        beside its queue borrow what it is owed (``_owed``: nominal quotas together are never
        exceeded): stop tasks of those queues, whole, of those that ran ``reclaim_min_run_s``,
        so that it fits at one of the sites of an option and they gave back its debts (the
        fewest victims of all ``options``: its federation-wide quotas at every site it may
        go, or a scoped or model quota at the site it counts, with what it then counts
        there). It waits, held back, until they end."""
        key = (job.id, task)
        if key in self._preempting or cycle.snapshot is None:
            return ()
        need = task_demand(job, task)
        best: tuple[str, list[Candidate], Demand] | None = None
        for debts, sites, counted in options:
            lenders = {q for d in debts for lender in d.over for q in self._sharing.subtree(lender)}
            room, _ = self._room_coming_free(cycle.snapshot, sites)
            candidates = self._preemption_candidates(job, None, lenders)
            choice = choose_victims(need, room, candidates, debts)
            if choice is not None and (best is None or len(choice[1]) < len(best[1])):
                best = (*choice, counted)
        if best is None:
            return ()  # not (yet) taken back: its backoff tries again
        site, victims, counted = best
        self._preempting[key] = [(v.job_id, v.task, v.epoch) for v in victims]
        self._claim(key, job, counted, site)
        self._start_preempting(key, victims, RECLAIMED)
        reason = f"stopping {len(victims)} task(s) on borrowed quota to give back its quota"
        return (jobs_pb2.SiteVerdict(site=site, stage=PREEMPT, reason=reason),)

    def _start_preempting(self, key: TaskKey, victims: list[Candidate], why: str) -> None:
        runner = asyncio.create_task(self._preempt(victims, why))
        self._tasks.add(runner)
        runner.add_done_callback(self._tasks.discard)
        named = ", ".join(f"{v.job_id}/{v.task}" for v in victims)
        log.info("preempting", job=key[0], task=key[1], victims=named)

    def _claim(self, key: TaskKey, job: jobs_pb2.Job, need: Demand, site: str) -> None:
        if job.spec.queue:
            self._claims[key] = at(need, site, self._sites.domain_of(site))

    def _with_claims(self, cycle: _Cycle, but: TaskKey) -> Tentative:
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

    def _claimed(self, cycle: _Cycle, but: TaskKey) -> Tentative:
        """``_with_claims``, less what the tasks being stopped for those waiting hold. A
        queue owed one GPU is owed it once: without these, each of its waiting tasks found it
        owed and stopped a task."""
        claimed = self._with_claims(cycle, but)
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

    def _preemption_candidates(
        self,
        urgent: jobs_pb2.Job,
        sites: set[str] | None,
        lenders: Mapping[str, set[str]] | set[str],
    ) -> list[Candidate]:
        """Tasks at ``sites`` (None: anywhere) that ``urgent`` may stop, running long enough
        and not already being stopped: with ``lenders`` (per site, or everywhere), those of
        the queues that borrow what its queue is owed; else those of lower priority and a
        preemptible class. Each counts what it holds as its site granted it."""
        now = time.time()
        taken = {victim for victims in self._preempting.values() for victim in victims}
        reclaim = bool(lenders)
        min_run_s = self._config.reclaim_min_run_s if reclaim else self._config.preemption_min_run_s
        domain_of = self._sites.domain_of
        out = []
        for job in self._jobs.at_sites(sites) if sites is not None else self._jobs.at_any_site():
            if job.cancel_requested or not self._sharing.preemptible(job):
                continue
            queues = self._sharing.chain(job.spec.queue)
            for spec, task in zip(job.spec.tasks, job.tasks, strict=False):
                if task.state not in job_state.AT_SITE or (
                    sites is not None and task.site not in sites
                ):
                    continue
                stoppable = (
                    lenders.get(task.site, set()) if isinstance(lenders, Mapping) else lenders
                )
                if not may_stop(job.spec.priority, job.spec.queue, urgent.spec.priority, stoppable):
                    continue
                if task.preempted_by or (job.id, task.name, task.epoch) in taken:
                    continue  # stopping already, or chosen by another waiting task
                started = task.started_at.ToSeconds() if task.HasField("started_at") else None
                if ready_s(started, min_run_s, reclaim=reclaim) > now:
                    continue
                since = max(
                    started or now,
                    task.checkpoint.time.ToSeconds() if task.checkpoint.path else 0.0,
                )
                out.append(
                    Candidate(
                        job_id=job.id,
                        task=task.name,
                        site=task.site,
                        epoch=task.epoch,
                        priority=job.spec.priority,
                        demand=at(placed(spec, task), task.site, domain_of(task.site)),
                        lost_s=max(0.0, now - since),
                        queues=queues,
                    )
                )
        return out

    def _room_coming_free(
        self, snapshot: Snapshot, sites: set[str]
    ) -> tuple[dict[str, dict[str, float]], dict[str, list[tuple[str, str, int]]]]:
        """Per site of ``sites``, its free room plus the room of its tasks being stopped that
        no waiting task chose (marked before this leader's term, which starts with no
        ``_preempting``, or for a task that no longer waits); and those tasks. Their room comes
        free soon: stopping others for it would stop them for nothing."""
        room = free_room(snapshot, sites)
        taken = {victim for victims in self._preempting.values() for victim in victims}
        stopping: dict[str, list[tuple[str, str, int]]] = {}
        for job in self._jobs.at_sites(sites):
            for spec, task in zip(job.spec.tasks, job.tasks, strict=False):
                victim = (job.id, task.name, task.epoch)
                if not task.preempted_by or task.state not in job_state.AT_SITE:
                    continue
                if task.site in room and victim not in taken:
                    stopping.setdefault(task.site, []).append(victim)
                    add(room[task.site], placed(spec, task).items())
        return room, stopping

    async def stop(self, tasks: Sequence[TaskAt], why: str) -> None:
        """Stop ``tasks`` as preemption does, ``why`` naming what for (a drain): each goes
        back to PENDING and is placed again, from its newest checkpoint if it has one."""
        await self._preempt(tasks, why)

    async def _preempt(self, victims: Sequence[Candidate | TaskAt], why: str) -> None:
        """Mark each victim as being preempted (written first, so a new leader knows), then
        tell its site to stop it; its final report puts it back to PENDING."""

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

    def _awake(self, now: float, rested: set[str]) -> Iterator[jobs_pb2.Job]:
        """The waiting jobs, in line order, but those resting (``_resting``) until after
        ``now``, passed by unread (their ids go in ``rested``): a backlog of thousands that
        cannot be placed yet must not make every cycle read all of it again."""
        return self._waiting_but(lambda rest: rest.until > now, rested)

    def _fit(self) -> Iterator[jobs_pb2.Job]:
        """The waiting jobs, in line order, but those resting with every waiting task unfit
        (``UNFIT``): room coming free is not theirs."""
        return self._waiting_but(lambda rest: rest.unfit, set())

    def _waiting_but(
        self, passes: Callable[[_Rest], bool], passed: set[str]
    ) -> Iterator[jobs_pb2.Job]:
        """The waiting jobs, in line order, but those whose rest still holds and ``passes``,
        whose ids go in ``passed``."""
        pending_job, resting = self._jobs.pending_job, self._resting
        for job_id in self._jobs.pending_ids():
            if (job := pending_job(job_id)) is None:
                continue
            rest = resting.get(job_id)
            # The cached message is replaced at every write: the same one, nothing changed.
            if rest is not None and rest.job is job and passes(rest):
                passed.add(job_id)
                continue
            yield job

    def _line(
        self, tentative: Tentative, pending: Iterable[jobs_pb2.Job] | None = None
    ) -> Iterator[jobs_pb2.Job]:
        """The waiting jobs (``pending``, all by default) in the order they get capacity:
        queues take turns by weighted dominant share, each queue's jobs by priority, then
        submission."""
        pending = self._jobs.pending() if pending is None else pending
        if not self._sharing.book.queues and not self._sharing.classes:
            return iter(pending)
        capacity = self._sites.capacity()
        if time.monotonic() - self._gauges_at > QUEUE_GAUGES_EVERY_S:
            self._gauges_at = time.monotonic()
            # A walk over the waiting jobs, once every few seconds: the admin's count, as listed.
            waiting = Counter(job.spec.queue for job in self._jobs.pending())
            self._sharing.export_gauges(capacity, waiting)
        return self._sharing.order(pending, capacity, tentative)

    def _placements_on(self, snapshot: Snapshot) -> dict[Request, _Placement]:
        """Placements already made on ``snapshot``, by request: placement depends on nothing
        else, and while no view changes (the snapshot is the same object) a cycle that finds
        a request it has seen need not place it again."""
        if snapshot is not self._placed_on or len(self._placements) > MAX_REMEMBERED_PLACEMENTS:
            self._placed_on = snapshot
            self._placements = {}
        return self._placements

    def _selector_unevaluated(self, source: str, snapshot: Snapshot) -> bool:
        """Whether the selector's verdict on some device class is unknown. A user's selector
        never runs on the event loop: its verdicts are found in a thread (in the selector
        sandbox, under its time budget), and the loop is woken when they are known."""
        known = ("selector evaluated", source)
        if snapshot.memo.get(known):
            return False  # every task with this selector, this snapshot: checked once
        attribute_sets = [c.attributes for c in snapshot.classes]
        if not VERDICTS.missing(source, attribute_sets):
            snapshot.memo[known] = True
            return False
        if source not in self._selectors_evaluating:
            self._selectors_evaluating.add(source)
            runner = asyncio.create_task(self._evaluate_selector(source, attribute_sets))
            self._tasks.add(runner)
            runner.add_done_callback(self._tasks.discard)
        return True

    async def _evaluate_selector(self, source: str, attribute_sets: list[dict[str, Any]]) -> None:
        try:
            await asyncio.to_thread(selector_matches, source, attribute_sets)
            if why := VERDICTS.over_budget(source):
                log.warning("selector_over_budget", selector=source[:200], reason=why)
        except Exception:
            log.exception("selector_evaluation_failed", selector=source[:200])
        finally:
            self._selectors_evaluating.discard(source)
            self.wake()

    async def evaluate_selectors(self, job: jobs_pb2.Job) -> None:
        """Find the verdicts of the job's selectors on every device class now, in a thread,
        so that ``explain`` does not evaluate them on the event loop."""
        attribute_sets = [c.attributes for c in self._sites.snapshot().classes]
        for task in job.spec.tasks:
            if source := task.resources.accelerator.selector:
                await asyncio.to_thread(selector_matches, source, attribute_sets)

    def _place(self, request: Request, snapshot: Snapshot) -> _Placement:
        """Placement's verdicts, the sites to try (best first) and their estimates."""
        decision = self._framework.place(request, snapshot)
        verdicts = tuple(
            jobs_pb2.SiteVerdict(site=r.site, stage=r.plugin, reason=r.reason, code=r.code)
            for r in decision.rejections  # the first per site: job records stay small
        )
        ranked = decision.ranked[: self._config.max_offers_per_round]
        if not ranked:
            unfit = bool(verdicts) and all(v.code in UNFIT for v in verdicts)
            return verdicts, (), {}, (), unfit
        estimates = estimate(request, snapshot)
        by_site = {
            site: estimate_proto(estimates, snapshot.site_index(site) or 0) for site in ranked
        }
        # Only for tasks a wait can be predicted for: finding the busy sites reads every
        # site's shortfall, which most placements never need.
        weigh = self._config.wait_gain > 0 and predictable(request)
        busy = tuple(decision.short_of_room().tolist()) if weigh else ()
        return verdicts, ranked, by_site, busy, False

    async def _stay_pending(
        self, nowhere: list[tuple[str, str, list[jobs_pb2.SiteVerdict]]]
    ) -> None:
        """Record why tasks fit nowhere; written only when the reasons change."""

        def mutation(task_name: str, verdicts: list[jobs_pb2.SiteVerdict]) -> Mutation:
            def mutate(job: jobs_pb2.Job) -> list[Change]:
                task = find_task(job, task_name)
                if task.state != job_state.PENDING or list(task.verdicts) == verdicts:
                    return []
                return [_to_pending(job, task, verdicts)]

            return mutate

        results = await self._jobs.update_many(
            [(job_id, mutation(task, verdicts)) for job_id, task, verdicts in nowhere]
        )
        for job_id, result in results.items():
            if isinstance(result, FederationError):
                log.warning("pending_update_failed", job=job_id, error=str(result))

    def _backoff(self, key: TaskKey, *, unfit: bool = False) -> None:
        longest = self._config.unfit_retry_interval_s if unfit else self._config.retry_interval_s
        delay = min(self._backoff_s.get(key, 0.25) * 2, longest)
        self._backoff_s[key] = delay
        if unfit:
            # Spread: a backlog submitted at once would otherwise come due all at once.
            delay *= random.uniform(0.8, 1.0)
        self._not_before[key] = time.monotonic() + delay

    def _status_of(self, key: TaskKey) -> jobs_pb2.TaskStatus | None:
        """The task's status now; None once its job is no longer cached (it ended)."""
        job = self._jobs.cached(key[0])
        return next((t for t in job.tasks if t.name == key[1]), None) if job else None

    def _forget(self, key: TaskKey) -> None:
        self._backoff_s.pop(key, None)
        self._not_before.pop(key, None)
        self._resting.pop(key[0], None)
        self._unfit.discard(key)
        self._preempting.pop(key, None)
        self._promised.pop(key, None)
        self._stopped_for.forget(key)
        self._claims.pop(key, None)
        self._stop_waiting(key)

    async def _negotiate(self, batch: list[_Negotiation], frees: int) -> None:
        """Rounds of offers until every task is delegated or has run out of sites. ``frees``:
        ``_frees`` when the batch was formed."""
        unsettled: list[_Negotiation] = []
        try:
            await self._rounds(batch)
            unsettled = [n for n in batch if not n.settled]
            for n in unsettled:
                self._backoff(n.key)
            try:
                # Record why no site took them, and the epochs their offers used.
                if unsettled:
                    await self._back_to_pending(unsettled)
            except Exception as err:
                log.warning("requeue_failed", tasks=len(unsettled), error=str(err))
        finally:
            self._let_go(batch)
        if unsettled and self._frees != frees:
            # Room came free while they were out (reservations let go, above all), and the
            # front of the line it went to was tried while they were held: what they count
            # against their queues kept the others back by quota. Now that they are let go,
            # the front is tried again, with them in their places.
            self._front_due = True
            self.wake()

    def _let_go(self, negotiations: list[_Negotiation]) -> None:
        """These negotiations are over: their room is free, and tasks left PENDING can be
        picked up again. Each is let go once: by then another may hold its task."""
        keys = [n.key for n in negotiations if not n.over]
        for n in negotiations:
            if not n.over and (offered := self._offered_parts.get(n.job_id)) is not None:
                offered.pop(n.task, None)
                if not offered:
                    del self._offered_parts[n.job_id]
            if n.settled and not n.over:
                self._forget(n.key)
            n.over = True
        self._jobs.release(keys)
        if self._full:
            self.wake()  # tasks wait for the room this leaves

    async def _rounds(self, batch: list[_Negotiation]) -> None:
        """Every round the batch's tasks need; a failure ends them, leaving tasks unsettled."""
        try:
            # One round more than the sites ranked: a slower site let go is asked last.
            for first, stop in offer_rounds(
                self._config.max_offers_per_round + 1, self._config.offers_at_once
            ):
                open_ = [n for n in batch if not n.settled and first < len(n.candidates)]
                if not open_:
                    return
                await self._round(open_, first, stop)
                settled = sum(n.settled for n in open_)
                OFFERS.labels("settled").inc(settled)
                OFFERS.labels("refused").inc(len(open_) - settled)
        except FederationError as err:
            log.warning("negotiation_failed", tasks=len(batch), error=str(err))
        except Exception:
            log.exception("negotiation_crashed", tasks=len(batch))

    async def _round(self, negotiations: list[_Negotiation], first: int, stop: int) -> None:
        """Offer each task to its sites ``first:stop`` at once, commit the best acceptance,
        release the others; tasks delegated (or moot) end ``settled``, others gain verdicts.

        All offers of a task in a round share one epoch: only the site that gets the commit
        may ever run it.
        """
        offered_to: dict[TaskKey, list[str]] = {}
        for n in negotiations:
            live = []
            for site in n.candidates[first:stop]:
                if self._sites.session(site) is None:
                    n.verdicts.append(_refusal(site, "site disconnected before the offer"))
                else:
                    live.append(site)
            if live:
                offered_to[n.key] = live
        offers: dict[str, list[tuple[_Negotiation, site_link_service_pb2.Offer]]] = {}
        active = []
        for n in negotiations:
            if n.key not in offered_to:
                continue
            job = self._jobs.cached(n.job_id)
            if job is None:
                continue  # the cache let it go (a write raced it): requeued from the store
            task = find_task(job, n.task)
            if task.state != job_state.PENDING:
                n.settled = True  # cancelled meanwhile
                continue
            spec = find_spec(job, n.task)
            stages_inputs = bool(spec.inputs) and staged(spec, _specs(job))
            if spec.outputs or stages_inputs:
                offered_to[n.key] = self._speaking_data(n, offered_to[n.key])
                if not offered_to[n.key]:
                    continue
            n.epoch = max(task.epoch, task.issued_epoch, n.epoch) + 1
            n.revision = task.revision
            active.append(n)
            offer = site_link_service_pb2.Offer(
                job_id=n.job_id,
                task=n.task,
                epoch=n.epoch,
                spec=spec,
                tenant=job.spec.tenant,
                lease_s=self._config.reservation_lease_s,
                restore=task.checkpoint if task.checkpoint.path else None,
                node_labels=job.spec.constraints.node_labels,
                stop_after_disconnect_s=job.spec.disconnect.stop_after_s,
                revision=task.revision,
                stages_inputs=stages_inputs,
            )
            # The site reads device speeds as the estimate did: learned ones included.
            offer.spec.speed.update(self._learner.overrides(spec.workload_class, spec.speed))
            for site in offered_to[n.key]:
                cordoned = self._sites.get(site).record.cordoned_nodes
                own = _for_site(offer, n.estimates.get(site), n.models.get(site), cordoned)
                offers.setdefault(site, []).append((n, own))
        # Sites answer in their own time: a task is decided once every site it was offered
        # to has answered, so a slow site holds up only the tasks offered to it.
        unanswered = {n.key: len(offered_to[n.key]) for n in active}
        accepted: dict[TaskKey, list[tuple[str, str]]] = {}
        asking = {
            asyncio.ensure_future(self._offer(site, [offer for _, offer in items])): site
            for site, items in offers.items()
        }
        # Each site's answer is queued as it comes: waiting on the set of those left over
        # and over (asyncio.wait) cost the square of the sites asked.
        answers: asyncio.Queue[asyncio.Task[list[_OfferReply]]] = asyncio.Queue()
        for asked in asking:
            asked.add_done_callback(answers.put_nowait)
        deciding: list[asyncio.Task[None]] = []
        failure: Exception | None = None
        asked_ns = tracing.now_ns()
        try:
            while asking:
                done = [await answers.get()]
                while not answers.empty():
                    done.append(answers.get_nowait())
                ready = []
                for answered in done:
                    site = asking.pop(answered)
                    for (n, _), (reservation, why, answer) in zip(
                        offers[site], answered.result(), strict=True
                    ):
                        if reservation and answer is not None:
                            accepted.setdefault(n.key, []).append((site, reservation))
                            self._commit_estimate(n, site, answer)
                        else:
                            n.verdicts.append(_refusal(site, why))
                        if tracing.on():
                            _trace_offer(n, site, asked_ns, answer, why)
                        unanswered[n.key] -= 1
                        if not unanswered[n.key]:
                            ready.append(n)
                if ready:
                    decided = self._decide(ready, offered_to, accepted)
                    deciding.append(asyncio.create_task(decided))
        except asyncio.CancelledError:
            for pending in [*asking, *deciding]:
                pending.cancel()
            raise
        except Exception as err:
            failure = err
            for pending in asking:
                pending.cancel()
        # Decisions under way finish on their own: cancelling one could leave a commit sent
        # for a task that never reads as settled.
        outcomes = await asyncio.gather(*deciding, return_exceptions=True)
        for outcome in [failure, *outcomes]:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _decide(
        self,
        negotiations: list[_Negotiation],
        offered_to: dict[TaskKey, list[str]],
        accepted: dict[TaskKey, list[tuple[str, str]]],
    ) -> None:
        """For tasks whose sites have all answered: commit the best acceptance of each and
        release the others."""
        for n in negotiations:
            if n.key not in accepted:
                continue
            best, *others = _by_promise(n, offered_to[n.key], accepted[n.key])
            if not others and (sooner := sooner_untried(n, best[0], offered_to[n.key])):
                # Its own answer is slower than a site not asked yet was estimated: ask
                # that one first, and this one again last.
                self._release(*best)
                del accepted[n.key]
                n.deferred.add(best[0])
                n.candidates = (*n.candidates, best[0])
                n.verdicts.append(
                    _refusal(
                        best[0],
                        f"accepted, but would finish in {n.estimates[best[0]].total_s:.0f} s, "
                        f"later than {sooner} was estimated to; asked last",
                    )
                )
                continue
            n.chosen = best
            for site, reservation in others:
                self._release(site, reservation)
                why = f"accepted, but {best[0]} finishes sooner or ranked higher"
                n.verdicts.append(_refusal(site, why))
        await self._delegate([n for n in negotiations if n.key in accepted])
        # Delegated ones need no more of the batch, which may wait on slower sites.
        self._let_go([n for n in negotiations if n.settled])

    async def _delegate(self, negotiations: list[_Negotiation]) -> None:
        """Write DELEGATED for each task's chosen site, then send the commits.

        Once its commit has left, a task goes back to PENDING only when its site refuses the
        commit. A commit that gets no answer may have started the task: it stays DELEGATED
        at its epoch, and the site's next hello, which lists every task it holds, settles it
        (``JobManager.reconcile``: RUNNING if the site has it, PENDING at once if not); a site
        that stays away is left to the lost-site monitor, as after a failover."""
        if not negotiations:
            return
        started_ns = tracing.now_ns()
        marks = []
        for n in negotiations:
            assert n.chosen is not None
            site, reservation = n.chosen
            estimated = n.estimates.get(site)
            mark = _mark_delegated(n.task, site, n.epoch, n.revision, reservation, estimated)
            marks.append((n.job_id, mark))
        written = await self._jobs.update_many(marks)
        commits: dict[str, list[tuple[_Negotiation, site_link_service_pb2.Commit]]] = {}
        back: list[tuple[str, Mutation]] = []
        ready: list[tuple[_Negotiation, site_link_service_pb2.Commit]] = []
        staging: dict[int, Awaitable[list[site_link_service_pb2.StagedInput] | str]] = {}
        restoring: dict[int, Awaitable[site_link_service_pb2.StagedInput]] = {}
        for n in negotiations:
            assert n.chosen is not None
            site, reservation = n.chosen
            task = _task_of(written, n)
            if task is None or not _delegated_as(task, n):
                self._release(site, reservation)
                n.settled = task is not None  # moved on meanwhile; a failed write requeues
                continue
            if self._sites.session(site) is None:
                # No commit leaves, so the site cannot run it: later rounds may offer it on.
                why = "site disconnected before the commit"
                if tracing.on():
                    _trace_commit(n, site, started_ns, why)
                back.append((n.job_id, _back_from_site(n.task, n.epoch, why)))
                n.verdicts.append(_refusal(site, why))
                continue
            commit = site_link_service_pb2.Commit(
                reservation_id=reservation, job_id=n.job_id, task=n.task, epoch=n.epoch
            )
            job = written[n.job_id]
            assert isinstance(job, jobs_pb2.Job)  # _task_of found the task in it
            if (spec := find_spec(job, n.task)).inputs and staged(spec, _specs(job)):
                timeout_s = self._config.offer_timeout_s
                staging[len(ready)] = resolve(job, n.task, self._sites, timeout_s, self._datasets)
            session = self._sites.session(site)
            if task.checkpoint.HasField("stored") and session and session.protocol >= CKPT_PROTOCOL:
                timeout_s = self._config.offer_timeout_s
                restoring[len(ready)] = restore_input(
                    job, n.task, task.checkpoint, self._sites, timeout_s, to_site=site
                )
            ready.append((n, commit))
        # Each holder signs its tasks' URLs over its own link, all holders at once.
        resolved = {}
        if staging:
            resolved = dict(zip(staging, await asyncio.gather(*staging.values()), strict=True))
        restores = dict(zip(restoring, await asyncio.gather(*restoring.values()), strict=True))
        for i, (n, commit) in enumerate(ready):
            assert n.chosen is not None
            site, reservation = n.chosen
            inputs = resolved.get(i, [])
            if isinstance(inputs, str):  # a holder is away: wait, and be placed again
                self._release(site, reservation)
                back.append((n.job_id, _back_from_site(n.task, n.epoch, inputs)))
                n.verdicts.append(_refusal(site, inputs))
                continue
            commit.inputs.extend(inputs)
            if (restore := restores.get(i)) is not None:
                commit.restore.CopyFrom(restore)
                if restore.error:
                    log.warning(
                        "checkpoint_not_restorable", job=n.job_id, task=n.task, why=restore.error
                    )
            self.history.arrived(site)
            commits.setdefault(site, []).append((n, commit))
            n.settled = True  # from here on, only the site's refusal puts it back to PENDING
        answers = await asyncio.gather(
            *(self._commit(site, [c for _, c in items]) for site, items in commits.items())
        )
        for (site, items), site_answers in zip(commits.items(), answers, strict=True):
            for (n, commit), answer in zip(items, site_answers, strict=True):
                if answer is None:
                    # It may have started: DELEGATED stands until the site's hello says.
                    log.warning(
                        "commit_unanswered", job=n.job_id, task=n.task, site=site, epoch=n.epoch
                    )
                    if tracing.on():
                        _trace_commit(n, site, started_ns, "no answer to the commit")
                    continue
                if answer.commit_answer.started:
                    log.debug("task_delegated", job=n.job_id, task=n.task, site=site, epoch=n.epoch)
                    if tracing.on():
                        _trace_commit(n, site, started_ns, "")
                    continue
                why = f"commit refused: {answer.commit_answer.reason}"
                if tracing.on():
                    _trace_commit(n, site, started_ns, why)
                log.warning("commit_failed", job=n.job_id, task=n.task, site=site, reason=why)
                n.settled = False  # the site does not run it: later rounds may offer it on
                back.append((n.job_id, _back_from_site(n.task, commit.epoch, why)))
                n.verdicts.append(_refusal(site, why))
        if back:
            await self._jobs.update_many(back)

    def _speaking_data(self, n: _Negotiation, sites: list[str]) -> list[str]:
        """The sites whose agents can store outputs and stage inputs; a verdict for others."""
        out = []
        for site in sites:
            session = self._sites.session(site)
            if session is not None and session.protocol < DATA_PROTOCOL:
                why = f"its agent speaks site-link protocol {session.protocol}; outputs and "
                n.verdicts.append(_refusal(site, why + f"staged inputs need {DATA_PROTOCOL}"))
            else:
                out.append(site)
        return out

    async def _offer(
        self, site: str, offers: list[site_link_service_pb2.Offer]
    ) -> list[_OfferReply]:
        """For each offer: (reservation id, "", the answer) when the site accepts, else ("",
        why not, None)."""
        session = self._sites.session(site)
        if session is None:
            return [("", "site disconnected before the offer", None)] * len(offers)
        timeout_s = self._config.offer_timeout_s
        replies = await session.request_many(
            [site_link_service_pb2.CoordinatorMessage(offer=offer) for offer in offers], timeout_s
        )
        out: list[_OfferReply] = []
        for reply in replies:
            if isinstance(reply, TimeoutError):
                out.append(("", f"no answer to the offer within {timeout_s:g}s", None))
            elif isinstance(reply, SessionClosedError):
                out.append(("", "site disconnected during the offer", None))
            elif not reply.HasField("offer_answer"):
                out.append(("", "site answered the offer with the wrong message", None))
            elif not (answer := reply.offer_answer).accepted:
                out.append(("", f"declined: {answer.reason}", None))
            else:
                out.append((answer.reservation_id, "", answer))
        return out

    def _commit_estimate(
        self, n: _Negotiation, site: str, answer: site_link_service_pb2.OfferAnswer
    ) -> None:
        """The site's answer into its estimate, with the error learned for that model."""
        _commit_estimate(n, site, answer.run_s, answer.device_model)
        estimated = n.estimates.get(site)
        if estimated is not None and answer.device_model:
            job = self._jobs.cached(n.job_id)
            spec = next((t for t in job.spec.tasks if t.name == n.task), None) if job else None
            workload = spec.workload_class if spec is not None else ""
            error = self._learner.error(workload, answer.device_model, site=site)
            if error != estimated.run_error:
                n.estimates[site] = _copy_estimate(estimated, run_error=error)

    def _release(self, site: str, reservation_id: str) -> None:
        # Room another task of the negotiation may have been refused for: it goes to the
        # front of the line once the negotiation ends (``_negotiate``).
        self._frees += 1
        session = self._sites.session(site)
        if session is not None:
            with contextlib.suppress(SessionClosedError):
                session.send(
                    site_link_service_pb2.CoordinatorMessage(
                        release=site_link_service_pb2.Release(reservation_id=reservation_id)
                    )
                )

    def explain(self, job: jobs_pb2.Job) -> list[jobs_pb2.TaskExplanation]:
        """For each task: every site, with every filter that rejects it (each with its code)
        or its score by term; and placement's estimate at its site against the committed one."""
        snapshot = self._sites.snapshot()
        out = []
        for task in job.tasks:
            explanation = jobs_pb2.TaskExplanation(task=task.name, state=task.state, site=task.site)
            request = request_for(job, task.name)
            if request is None:
                waiting = waiting_on(job, task.name)
                explanation.note = f"waits for task(s) {', '.join(waiting)} to succeed"
                out.append(explanation)
                continue
            if job_state.is_terminal(task.state):
                explanation.note = f"ended {jobs_pb2.JobState.Name(task.state)}: {task.reason}"
            elif task.state in job_state.AT_SITE:
                explanation.note = "placed; the scores below are for the federation as it is now"
            request = self._with_learned_speeds(request)  # as the scheduler ranks it
            decision = self._framework.place(request, snapshot)
            if request.near_region:
                near = self._near_region_note(request, snapshot, decision.ranked)
                explanation.note = "; ".join(n for n in (explanation.note, near) if n)
            estimates = estimate(request, snapshot)
            for rank, (site, total) in enumerate(
                zip(decision.ranked, decision.scores, strict=True), start=1
            ):
                explanation.sites.add(
                    site=site,
                    feasible=True,
                    score=total,
                    scores={name: v[rank - 1] for name, v in decision.terms.items()},
                    estimate=estimate_proto(estimates, snapshot.site_index(site) or 0),
                    rank=rank,
                )
            by_site: dict[str, list[Rejection]] = {}
            for rejection in decision.every_rejection:  # by site, then in profile order
                by_site.setdefault(rejection.site, []).append(rejection)
            waits = self._predicted_waits(
                (job.id, task.name), request, snapshot, decision.short_of_room().tolist()
            )
            for site, every in by_site.items():
                verdicts = [
                    jobs_pb2.SiteVerdict(site=site, stage=r.plugin, reason=r.reason, code=r.code)
                    for r in every
                ]
                now = estimate_proto(estimates, snapshot.site_index(site) or 0)
                explanation.sites.add(
                    site=site,
                    plugin=every[0].plugin,
                    reason=every[0].reason,
                    code=every[0].code,
                    rejections=verdicts,
                    estimate=_once_free(now, waits.get(site)),
                )
            ranked_site = task.site or (decision.ranked[0] if decision.ranked else "")
            index = snapshot.site_index(ranked_site) if ranked_site else None
            if index is not None:
                explanation.ranked_site = ranked_site
                explanation.ranked_estimate.CopyFrom(estimate_proto(estimates, index))
            if task.site and task.HasField("estimate"):
                explanation.committed_estimate.CopyFrom(task.estimate)
            if task.state == job_state.PENDING:
                explanation.held_back.extend(self._held_back(job, task))
            out.append(explanation)
        return out

    def _near_region_note(self, request: Request, snapshot: Snapshot, ranked: Sequence[str]) -> str:
        """The RTT to its region each ranked site was ranked by (explain only); a profile
        without NearRegion ranks by none."""
        region = request.near_region
        if not any(s.name == NearRegion.name and w > 0 for s, w in self._framework.scorers):
            return f"near_region {region} is not weighed: the profile has no NearRegion"
        return describe(request, snapshot, ranked)

    def _held_back(
        self, job: jobs_pb2.Job, task: jobs_pb2.TaskStatus
    ) -> list[jobs_pb2.SiteVerdict]:
        """What keeps a waiting task back beside placement (``TaskExplanation.held_back``):
        its queue's quota as it stands now, then what the scheduler last found of the rest."""
        out = []
        if (wait_s := retries.due_in_s(task, time.time())) > 0:
            after = f"attempt {task.failed_attempts} failed; the next starts in {wait_s:.0f}s"
            out.append(jobs_pb2.SiteVerdict(stage=RETRY, reason=after))
        if job.spec.queue and (
            why := self._sharing.admission(job, task_demand(job, task.name), {})
        ):
            out.append(jobs_pb2.SiteVerdict(stage=QUOTA, reason=why))
        held = (QUOTA, OWNER_SHARE, PREEMPT, SPREAD, INPUTS)
        found = (v for v in task.verdicts if v.stage in held)
        out += [v for v in found if v.site or v.stage != QUOTA]  # the queue's own: now
        return out

    async def _commit(
        self, site: str, commits: list[site_link_service_pb2.Commit]
    ) -> list[site_link_service_pb2.AgentMessage | None]:
        """Send the commits; those without an answer (None) go once more over the same session.
        A site answers a repeated commit of a task it took at once, as a no-op.

        Never over a newer session: the site's hello there settles every task delegated to it
        before (``JobManager.reconcile``), and a commit sent meanwhile could start a task its
        hello did not list, which goes back to PENDING. A session that answers neither time is
        ended, so that its site says hello again with the tasks it holds."""
        answers: list[site_link_service_pb2.AgentMessage | None] = [None] * len(commits)
        session = self._sites.session(site)
        if session is None:
            return answers
        unanswered = list(range(len(commits)))
        for _ in range(2):
            if session.closed or not unanswered:
                break
            replies = await session.request_many(
                [site_link_service_pb2.CoordinatorMessage(commit=commits[i]) for i in unanswered],
                self._config.offer_timeout_s,
            )
            still = []
            for i, reply in zip(unanswered, replies, strict=True):
                if isinstance(reply, TimeoutError | SessionClosedError):
                    still.append(i)
                else:
                    answers[i] = reply
            unanswered = still
        if unanswered and not session.closed:
            why = f"no answer to a commit within {2 * self._config.offer_timeout_s:g}s"
            log.warning("site_session_ended", site=site, reason=why, unanswered=len(unanswered))
            session.end(UnavailableError(why))
        return answers

    async def _back_to_pending(self, negotiations: list[_Negotiation]) -> None:
        def mutation(n: _Negotiation) -> Mutation:
            task_name, verdicts = n.task, n.verdicts

            def mutate(job: jobs_pb2.Job) -> list[Change]:
                task = find_task(job, task_name)
                # Its own delegation here means no commit left, or its site refused the commit
                # and writing that down failed: the bumped epoch of the next try fences it.
                if task.state != job_state.PENDING and not _delegated_as(task, n):
                    return []
                unplace(task)
                # Epochs offered in vain are recorded, so the task's next offers go above them.
                task.issued_epoch = max(task.issued_epoch, n.epoch)
                return [_to_pending(job, task, verdicts)]

            return mutate

        results = await self._jobs.update_many([(n.job_id, mutation(n)) for n in negotiations])
        for job_id, result in results.items():
            if isinstance(result, FederationError):
                log.warning("requeue_failed", job=job_id, error=str(result))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _with_devices_left(ranked: tuple[str, ...], need: Demand, cycle: _Cycle) -> tuple[str, ...]:
    """The sites of ``ranked`` whose free whole devices, less those this cycle already offered,
    still hold ``need``'s; the first of them is counted as taking them (the site the task
    most likely gets). Tasks of shares or of no device are not counted (a share may fit on a
    device in use, which the free count does not show)."""
    wanted = {kind: n for kind, n in need.items() if kind in DEVICE_KINDS and n >= 1}
    if not wanted or any(n != int(n) for n in wanted.values()):
        return ranked
    if cycle.devices_left is None:
        assert cycle.snapshot is not None
        cycle.devices_left = free_room(cycle.snapshot, cycle.snapshot.site_ids)
    left = cycle.devices_left
    kept = tuple(s for s in ranked if all(left[s].get(k, 0.0) >= n for k, n in wanted.items()))
    if kept:
        for kind, n in wanted.items():
            left[kept[0]][kind] -= n
    return kept


def offer_rounds(candidates: int, offers_at_once: int) -> list[tuple[int, int]]:
    """The ``[first, stop)`` slices of the ranked sites that each negotiation round offers to.

    The first round offers the best site alone: it usually accepts, and an offer holds
    capacity at a site until it is committed or released, so offering more sites at once would
    reserve every job several times over and make the others decline their own offers. Once
    the best site has declined, later rounds offer ``offers_at_once`` sites at a time, so a run
    of declines costs few round trips.
    """
    rounds = [(0, min(1, candidates))] if candidates else []
    step = max(1, offers_at_once)
    rounds += [(first, min(first + step, candidates)) for first in range(1, candidates, step)]
    return rounds


_Placement = tuple[
    tuple[jobs_pb2.SiteVerdict, ...],
    tuple[str, ...],
    dict[str, jobs_pb2.Estimate],
    tuple[int, ...],
    bool,
]
"""Verdicts, the sites to try (best first), their estimates, the sites short only of room
(snapshot indices) that a wait may choose, and whether every site refused for what room that
comes free cannot change (``UNFIT``)."""
UNFIT = frozenset(
    {
        Code.DOMAIN_NOT_ALLOWED,
        Code.REGION_NOT_ALLOWED,
        Code.SITE_NOT_ALLOWED,
        Code.NO_DEVICE_OF_MODEL,
        Code.INSUFFICIENT_DEVICE_MEMORY,
        Code.DEVICE_SELECTOR_UNMATCHED,
        Code.NODE_LABELS_UNMATCHED,
    }
)
"""Reasons a site refuses a task that no task ending there changes: the task's own bounds, or
hardware the site does not have. A task every site refuses so is not woken when room comes
free (``_clear_front_of_line``), only by its retry timer: a backlog of such tasks at the front
of the line would otherwise be placed again at every task's end, and keep the room from the
tasks behind them."""


def _to_pending(
    job: jobs_pb2.Job, task: jobs_pb2.TaskStatus, verdicts: list[jobs_pb2.SiteVerdict]
) -> Change:
    """Put ``task`` (of ``job``) back to PENDING with the reasons no site took it."""
    del task.verdicts[:]
    task.verdicts.extend(verdicts)
    return transition(job, task.name, job_state.PENDING, summarize(verdicts))


def _trace_offer(
    n: _Negotiation,
    site: str,
    asked_ns: int,
    answer: site_link_service_pb2.OfferAnswer | None,
    why: str,
) -> None:
    """``task.offer``: one site's answer to its offer, from the round's asking to its answer.
    A refusal is an answer, not a failure: its reason is an attribute."""
    attributes: dict[str, tracing.Value] = {"federation.accepted": answer is not None}
    if answer is not None:
        attributes["federation.offer.run_s"] = answer.run_s
        attributes["federation.offer.device_model"] = answer.device_model
    else:
        attributes["federation.reason"] = why
    tracing.record(
        "task.offer",
        n.job_id,
        asked_ns,
        task=n.task,
        site=site,
        epoch=n.epoch,
        attributes=attributes,
    )


def _trace_commit(n: _Negotiation, site: str, started_ns: int, why: str) -> None:
    """``task.commit``: from writing DELEGATED to the site's answer (``why``: not started)."""
    tracing.record(
        "task.commit",
        n.job_id,
        started_ns,
        task=n.task,
        site=site,
        epoch=n.epoch,
        error=why,
        attributes={"federation.started": not why},
    )


def _refusal(site: str, reason: str) -> jobs_pb2.SiteVerdict:
    return jobs_pb2.SiteVerdict(site=site, stage=NEGOTIATE, reason=reason)


def _delegated_as(task: jobs_pb2.TaskStatus, n: _Negotiation) -> bool:
    """Whether ``task`` is DELEGATED as ``n`` wrote it: its epoch, site and reservation."""
    return (
        task.state == job_state.DELEGATED
        and task.epoch == n.epoch
        and (task.site, task.reservation_id) == n.chosen
    )


def _specs(job: jobs_pb2.Job) -> dict[str, jobs_pb2.TaskSpec]:
    return {t.name: t for t in job.spec.tasks}


def _task_of(
    written: dict[str, jobs_pb2.Job | FederationError], n: _Negotiation
) -> jobs_pb2.TaskStatus | None:
    """The task as written, or None (logged) when its job could not be written."""
    job = written[n.job_id]
    if isinstance(job, FederationError):
        log.warning("negotiation_failed", job=n.job_id, task=n.task, error=str(job))
        return None
    return find_task(job, n.task)


def _by_promise(
    n: _Negotiation, rank: list[str], answers: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    """A task's acceptances, the one to commit first: by placement's rank, except that a site
    that can run the task only slower than placement estimated (``n.slower``) goes last unless
    it still finishes soonest of all."""

    def total(answer: tuple[str, str]) -> float:
        estimated = n.estimates.get(answer[0])
        return estimated.total_s if estimated is not None else math.inf

    soonest = min(total(a) for a in answers)
    return sorted(
        answers,
        key=lambda a: (a[0] in n.slower and total(a) > soonest, rank.index(a[0])),
    )


def sooner_untried(n: _Negotiation, site: str, offered: list[str]) -> str | None:
    """An untried site estimated to finish sooner than ``site`` answered it would, when
    ``site`` accepted only slower than placement estimated (and was not let go once already);
    else None. Placement ranked ``site`` first for an estimate its answer broke."""
    if site not in n.slower or site in n.deferred or not offered:
        return None
    answered = n.estimates[site].total_s
    untried = n.candidates[n.candidates.index(offered[-1]) + 1 :]
    sooner = [s for s in untried if s in n.estimates and n.estimates[s].total_s < answered]
    return min(sooner, key=lambda s: n.estimates[s].total_s) if sooner else None


def _for_site(
    offer: site_link_service_pb2.Offer,
    estimated: jobs_pb2.Estimate | None,
    models: list[str] | None,
    cordoned: Sequence[str] = (),
) -> site_link_service_pb2.Offer:
    """The offer for one site: with what placement estimated there, so the site packs onto
    devices as fast as the estimate assumed (or answers its own run time); with only the
    device ``models`` its queues' quotas leave the task there, if they rule some out; and
    with the site's ``cordoned`` nodes, which no replica may take."""
    if estimated is None and not models and not cordoned:
        return offer
    own = site_link_service_pb2.Offer()
    own.CopyFrom(offer)
    own.cordoned_nodes.extend(cordoned)
    if estimated is not None:
        own.estimate.CopyFrom(estimated)
    if models:
        own.spec.resources.accelerator.models[:] = models
    return own


def _commit_estimate(n: _Negotiation, site: str, run_s: float, model: str = "") -> None:
    """Take a site's own run time into its estimate: what the task is ranked and shown by.

    Cost and energy scale with the run time; a run time the site does not give (0) or that
    is not a finite positive number leaves placement's estimate as it was. ``model`` is the
    device model the site reserved.
    """
    placed = n.estimates.get(site)
    if placed is not None and model and placed.device_model != model:
        placed = n.estimates[site] = _copy_estimate(placed, device_model=model)
    if placed is None or not (math.isfinite(run_s) and run_s > 0) or run_s == placed.run_s:
        return
    if run_s > placed.run_s * (1 + 1e-9):
        n.slower.add(site)
    committed = jobs_pb2.Estimate()
    committed.CopyFrom(placed)
    ratio = run_s / placed.run_s if placed.run_s > 0 else 1.0
    committed.run_s = run_s
    committed.total_s = placed.queue_s + placed.transfer_s + run_s
    committed.cost_usd = placed.cost_usd * ratio
    committed.energy_kwh = placed.energy_kwh * ratio
    if placed.device_speed > 0:
        committed.device_speed = placed.device_speed / ratio
    n.estimates[site] = committed


def _once_free(estimate: jobs_pb2.Estimate, wait: Wait | None) -> jobs_pb2.Estimate:
    """A busy site's estimate once room frees there, the predicted wait as its queue time."""
    if wait is None:
        return estimate
    return _copy_estimate(
        estimate,
        queue_s=wait.wait_s,
        run_s=wait.waiter.run_s,
        total_s=wait.finish_s,
        device_speed=wait.waiter.speed,
    )


def _copy_estimate(estimate: jobs_pb2.Estimate, **changes: Any) -> jobs_pb2.Estimate:
    copy = jobs_pb2.Estimate()
    copy.CopyFrom(estimate)
    for name, value in changes.items():
        setattr(copy, name, value)
    return copy


def _mark_delegated(
    task_name: str,
    site: str,
    epoch: int,
    revision: int,
    reservation_id: str,
    estimated: jobs_pb2.Estimate | None,
) -> Mutation:
    def mutate(job: jobs_pb2.Job) -> list[Change]:
        task = find_task(job, task_name)
        if task.state != job_state.PENDING or max(task.epoch, task.issued_epoch) >= epoch:
            return []  # cancelled, or another delegation went first
        if task.revision != revision:
            return []  # its spec changed while offered: offered again, as it is now
        task.epoch = task.issued_epoch = epoch
        task.site = site
        task.reservation_id = reservation_id
        if estimated is not None:
            task.estimate.CopyFrom(estimated)
        del task.verdicts[:]
        task.ClearField("retry_at")  # its backoff, if it had one, is over
        change = transition(job, task_name, job_state.DELEGATED, f"{site} accepted")
        return [change]

    return mutate


def _back_from_site(task_name: str, epoch: int, reason: str) -> Mutation:
    def mutate(job: jobs_pb2.Job) -> list[Change]:
        task = find_task(job, task_name)
        if task.state != job_state.DELEGATED or task.epoch != epoch:
            return []
        unplace(task)
        return [transition(job, task_name, job_state.PENDING, reason)]

    return mutate


def _verdicts(stage: str, refused: list[tuple[str, str]]) -> list[jobs_pb2.SiteVerdict]:
    """Why ``stage`` keeps the task from each of these sites."""
    return [jobs_pb2.SiteVerdict(site=site, stage=stage, reason=why) for site, why in refused]


def summarize(verdicts: list[jobs_pb2.SiteVerdict]) -> str:
    """One line for people: why no site took the task."""
    if not verdicts:
        return "no sites are connected"
    if verdicts[0].stage == WAIT:
        return verdicts[0].reason
    if all(v.stage == QUOTA for v in verdicts):
        return verdicts[0].reason  # its queue holds it back, whatever the sites have
    parts = [f"{v.site}: {v.reason}" for v in verdicts[:3]]
    more = f" (+{len(verdicts) - 3} more)" if len(verdicts) > 3 else ""
    return "no site can take it now: " + "; ".join(parts) + more


def _waiting_verdict(wait: Wait, now_site: str, now_s: float) -> jobs_pb2.SiteVerdict:
    """Why the task waits although ``now_site`` could take it; figures are rounded so that
    the record is written again only when they change notably."""
    sooner = 5 * round(20 * (1 - wait.finish_s / now_s)) if now_s > 0 else 0
    return jobs_pb2.SiteVerdict(
        site=wait.site,
        stage=WAIT,
        reason=f"waits for room at {wait.site}, expected in {_about(wait.wait_s)}: it should"
        f" finish there about {sooner} % sooner than at {now_site}, which could take it now",
    )


def _about(seconds: float) -> str:
    """A duration to two figures, for people."""
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


def waiting_on(job: jobs_pb2.Job, task_name: str) -> list[str]:
    """Dependencies of a task that have not succeeded yet."""
    spec = find_spec(job, task_name)
    states = {t.name: t.state for t in job.tasks}
    return [d for d in spec.depends_on if states.get(d) != job_state.SUCCEEDED]


def request_for(job: jobs_pb2.Job, task_name: str) -> Request | None:
    """The placement request for a task, or None while it waits for its dependencies.

    The outputs of the tasks it depends on become its inputs, located where those ran, and so
    does the task's newest recorded checkpoint, which a restart reads.
    """
    specs = {t.name: t for t in job.spec.tasks}
    spec = specs[task_name]
    if spec.depends_on and waiting_on(job, task_name):
        return None
    status = {t.name: t for t in job.tasks}
    inputs = [
        Input(i.dataset, i.bytes, i.site)
        for i in spec.inputs
        if not i.dataset.startswith(TASK_OUTPUT)
    ]
    for dep in spec.depends_on:
        size = specs[dep].output_bytes
        for i in spec.inputs:  # an explicit "task:NAME[.OUTPUT]" input may give the size
            if i.bytes and (found := source_of(i.dataset, specs)) is not None and found[0] == dep:
                size = i.bytes
        if stored := sum(a.bytes for a in status[dep].artifacts):
            size = stored  # what its site reported storing
        if size:
            inputs.append(Input(TASK_OUTPUT + dep, size, status[dep].site))
    checkpoint = status[task_name].checkpoint
    if checkpoint.path and checkpoint.bytes:
        # A restart reads its newest checkpoint from the site that holds it.
        inputs.append(Input(CHECKPOINT + task_name, checkpoint.bytes, checkpoint.site))
    return _request(
        spec.SerializeToString(deterministic=True),
        job.spec.constraints.SerializeToString(deterministic=True),
        job.spec.objective.SerializeToString(deterministic=True),
        tuple(inputs),
    )


@functools.lru_cache(maxsize=4096)
def _request(
    task: bytes, constraints: bytes, objective: bytes, inputs: tuple[Input, ...]
) -> Request:
    """``Request.from_spec`` by what it reads: the tasks of job arrays share one, and a key
    costs a seventh of building a request."""
    job = jobs_pb2.JobSpec(
        constraints=jobs_pb2.Constraints.FromString(constraints),
        objective=jobs_pb2.Objective.FromString(objective),
    )
    return Request.from_spec(job, jobs_pb2.TaskSpec.FromString(task), inputs)


def estimate_proto(estimates: Estimates, site: int) -> jobs_pb2.Estimate:
    return jobs_pb2.Estimate(
        queue_s=float(estimates.queue_s[site]),
        transfer_s=float(estimates.transfer_s[site]),
        run_s=float(estimates.run_s[site]),
        total_s=float(estimates.total_s[site]),
        cost_usd=float(estimates.cost_usd[site]),
        energy_kwh=float(estimates.energy_kwh[site]),
        transfer_bytes=int(estimates.transfer_bytes[site]),
        device_speed=float(estimates.device_speed[site]),
        pull_s=float(estimates.pull_s[site]),
        pull_bytes=int(estimates.pull_bytes[site]),
        image_held=bool(estimates.image_held[site]),
    )
