"""Who is tried in a scheduling cycle: the line of waiting jobs in fair order, each waiting
task's retry timer, and the jobs that rest until one of their timers comes due."""

from __future__ import annotations

import itertools
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass, field

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.common.keys import TaskKey
from federation.coordinator.jobs import retries
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.policy.sharing import Sharing, Tentative, task_demand
from federation.coordinator.scheduling.config import (
    FRONT_OF_LINE,
    QUEUE_GAUGES_EVERY_S,
    TIMER_PACE,
    SchedulerConfig,
)
from federation.coordinator.sites.registry import SiteRegistry


@dataclass(slots=True)
class Rest:
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


class Line:
    """The waiting jobs in the order they get capacity, and the timers that hold tasks back."""

    def __init__(
        self, jobs: JobRepository, sites: SiteRegistry, sharing: Sharing, config: SchedulerConfig
    ) -> None:
        self._jobs = jobs
        self._sites = sites
        self._sharing = sharing
        self._config = config
        self._not_before: dict[TaskKey, float] = {}
        self._backoff_s: dict[TaskKey, float] = {}
        self._resting: dict[str, Rest] = {}
        """Per waiting job whose every waiting task waits out a timer, as the last cycle that
        looked at it found: the next cycles pass it by without reading it (``awake``)."""
        self._unfit: set[TaskKey] = set()
        """Waiting tasks that every site refused, the last time, for reasons room coming free
        does not change (``UNFIT``)."""
        self._gauges_at = 0.0

    def due_at(self, key: TaskKey) -> float:
        """When (monotonic) the task may be tried again; 0: now."""
        return self._not_before.get(key, 0.0)

    def backoff(self, key: TaskKey, *, unfit: bool = False) -> None:
        """Try the task again after a wait that doubles at each try, up to the retry interval
        (``unfit``: the longer one for tasks room coming free cannot help, remembered)."""
        longest = self._config.unfit_retry_interval_s if unfit else self._config.retry_interval_s
        delay = min(self._backoff_s.get(key, 0.25) * 2, longest)
        self._backoff_s[key] = delay
        if unfit:
            self._unfit.add(key)
            # Spread: a backlog submitted at once would otherwise come due all at once.
            delay *= random.uniform(0.8, 1.0)
        self._not_before[key] = time.monotonic() + delay

    def not_before(self, key: TaskKey, at: float) -> None:
        """Hold the task back until ``at`` (monotonic) at least: a failed attempt's backoff."""
        self._not_before[key] = max(self._not_before.get(key, 0.0), at)

    def hold_for(self, key: TaskKey, due_s: float) -> None:
        """Hold the task back ``due_s`` from now, its backoff reset: it waits for a busy site."""
        self._backoff_s.pop(key, None)
        self._not_before[key] = time.monotonic() + due_s

    def considered(self, key: TaskKey) -> None:
        """The task is being tried: whether it is unfit is found again."""
        self._unfit.discard(key)

    def wake(self, keys: Iterable[TaskKey]) -> None:
        """Let these tasks be tried at the next cycle, whatever their timers."""
        for key in keys:
            self._not_before.pop(key, None)
            self._resting.pop(key[0], None)

    def wake_unfit(self) -> None:
        """A site came or came back: what no site had may be there now (a task's end never
        brings it, so ``clear_front`` leaves unfit tasks alone)."""
        self.wake(self._unfit)

    def clear_front(self, waiting_for_site: Container[TaskKey]) -> None:
        """Let the first ``FRONT_OF_LINE`` waiting jobs be tried at once, whatever their retry
        timers: freed room is theirs (but not jobs resting unfit, ``UNFIT``: it cannot help
        them, nor tasks in ``waiting_for_site``: woken once their site's room shows). Only the
        front: clearing every timer at each task end would place every waiting task again,
        which a flood of short jobs makes costly.
        The front is the cycle's fair order with each job counted as admitted: without that
        the queue with the smallest share fills the whole front, and only its tasks would
        be tried when many GPUs free at once."""
        tentative: Tentative = {}
        wall = time.time()
        for job in itertools.islice(self.order(tentative, self._fit()), FRONT_OF_LINE):
            for task in job.tasks:
                key = (job.id, task.name)
                if retries.due_in_s(task, wall) > 0:
                    continue  # its backoff after a failed attempt holds
                if task.state == job_state.PENDING and job.spec.queue:
                    self._sharing.admit(job, task_demand(job, task.name), tentative)
                if key not in waiting_for_site:
                    self._not_before.pop(key, None)
                    self._backoff_s.pop(key, None)
                    self._resting.pop(job.id, None)

    def next_wait_s(self, walk_s: float) -> float:
        """Until the soonest backed-off task is due (due ones were handled this cycle), but
        no sooner than ``TIMER_PACE`` walks of the line (``walk_s`` each), nor later than the
        retry interval."""
        now = time.monotonic()
        future = [t for t in self._not_before.values() if t > now]
        soonest = min(future, default=now + self._config.retry_interval_s)
        paced_s = max(soonest - now, TIMER_PACE * walk_s)
        return max(0.01, min(paced_s, self._config.retry_interval_s))

    def awake(self, now: float, rested: set[str]) -> Iterator[jobs_pb2.Job]:
        """The waiting jobs, in line order, but those resting until after ``now``, passed by
        unread (their ids go in ``rested``): a backlog of thousands that cannot be placed yet
        must not make every cycle read all of it again."""
        return self._waiting_but(lambda rest: rest.until > now, rested)

    def _fit(self) -> Iterator[jobs_pb2.Job]:
        """The waiting jobs, in line order, but those resting with every waiting task unfit
        (``UNFIT``): room coming free is not theirs."""
        return self._waiting_but(lambda rest: rest.unfit, set())

    def _waiting_but(
        self, passes: Callable[[Rest], bool], passed: set[str]
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

    def order(
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

    def reading(self, job_id: str) -> None:
        """The cycle reads the job again: it rests no more until the cycle says so."""
        self._resting.pop(job_id, None)

    def rest(self, rest: Rest) -> bool:
        """Let the job rest if every waiting task of it waits out a timer; whether it does."""
        if not rest.keys or rest.awake:
            return False
        rest.unfit = all(key in self._unfit for key in rest.keys)
        self._resting[rest.job.id] = rest
        return True

    def swept(self, rested: set[str], pending: set[TaskKey]) -> set[TaskKey]:
        """After a cycle that walked the whole line: only the jobs it ``rested`` rest on; the
        tasks with timers that no longer wait (not ``pending``, nor resting), to forget."""
        self._resting = {job_id: self._resting[job_id] for job_id in rested}
        waiting = pending.union(*(rest.keys for rest in self._resting.values()))
        known = set(self._not_before) | self._backoff_s.keys() | self._unfit
        return known - waiting

    def forget(self, key: TaskKey) -> None:
        self._backoff_s.pop(key, None)
        self._not_before.pop(key, None)
        self._resting.pop(key[0], None)
        self._unfit.discard(key)
