"""The lost-site monitor: moves the tasks of a site that stayed away too long elsewhere.

Every ``interval_s`` the leader looks at the sites without a session. A task delegated to or
running at such a site moves back to PENDING, with a new epoch, once the site has been away
for its job's ``disconnect.lost_after_s`` (and the job allows replacing it), and with
``disconnect.stop_after_s`` once the site has surely stopped its copy; the scheduler then places
it elsewhere, restarting from its newest recorded checkpoint. The copy left behind is
remembered (``TaskStatus.displaced``) for the job's reconcile rule, and fenced off if the site
comes back with it. While more than half of the sites the coordinator should reach are
unreachable at once, it suspects itself cut off and moves nothing until enough come back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.coordinator.jobs.records import (
    Change,
    Mutation,
    find_task,
    forget_devices,
    next_epoch,
    transition,
    unplace,
)
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.sites.disconnect import is_due, is_partitioned, policy_of
from federation.coordinator.sites.registry import OfflineSite, SiteRegistry
from federation.errors import FederationError
from federation.metrics import RESCHEDULING_PAUSED, TASKS_MOVED

log = structlog.get_logger()


@dataclass(frozen=True, slots=True)
class Move:
    """One task to move off a lost site."""

    job_id: str
    task: str
    site: str
    epoch: int
    reason: str
    is_cancel: bool = False
    """The job was cancelled: the task ends CANCELLED instead of being placed again."""


class LostSites:
    """Watches sites without a session and moves their tasks once their jobs' grace is over.

    Args:
        jobs: The job repository (moves are written through it).
        sites: The site registry: which sites are offline, since when, and why.
        wake: Wakes the scheduler after tasks were moved back to PENDING.
        interval_s: Time between two looks.
        heartbeat_s: The interval at which agents hear from the coordinator (it answers each
            heartbeat): how late a cut-off site may notice it (``disconnect.stop_after_s``).
        clock: Monotonic clock (tests pass their own).
    """

    def __init__(
        self,
        jobs: JobRepository,
        sites: SiteRegistry,
        wake: Callable[[], None],
        interval_s: float,
        *,
        heartbeat_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._jobs = jobs
        self._sites = sites
        self._wake = wake
        self._interval_s = interval_s
        self._heartbeat_s = heartbeat_s
        self._clock = clock
        self.paused = False
        """Whether moving is paused because most sites are unreachable at once."""
        self.note = ""
        """Why it is paused, for people; empty when it is not."""

    async def run(self) -> None:
        """Look every ``interval_s`` until cancelled; a failed look is logged and retried."""
        try:
            while True:
                await asyncio.sleep(self._interval_s)
                try:
                    await self.check()
                except Exception:
                    log.exception("lost_site_check_failed")
        finally:
            RESCHEDULING_PAUSED.set(0)  # the term is over: a next one judges afresh

    async def check(self) -> list[Move]:
        """Move every task that is due; returns the moves written."""
        offline = {site.name: site for site in self._sites.offline()}
        self._judge_partition(list(offline.values()))
        if self.paused or not offline:
            return []
        now = self._clock()
        moves = [
            move
            for job in self._jobs.at_sites(offline.keys())
            for move in due_moves(job, offline, now, self._heartbeat_s)
        ]
        done = [move for move in moves if await self._move(move)]
        if done:
            self._wake()
        return done

    def _judge_partition(self, offline: list[OfflineSite]) -> None:
        """Pause while more than half of the sites that should be reachable are not."""
        unreachable = [s.name for s in offline if s.is_unreachable and not s.is_cordoned]
        connected = self._sites.connected_count()
        paused = is_partitioned(connected, len(unreachable))
        if paused:
            self.note = (
                f"{len(unreachable)} of {len(unreachable) + connected} sites are unreachable "
                f"({', '.join(unreachable[:5])}{', ...' if len(unreachable) > 5 else ''}): this "
                "coordinator may be the one cut off, so their tasks stay where they are until "
                "more sites are back. To move them anyway: cordon the sites that are gone"
            )
        if paused != self.paused:
            self.paused = paused
            RESCHEDULING_PAUSED.set(1 if paused else 0)
            if paused:
                log.warning(
                    "rescheduling_paused",
                    unreachable=len(unreachable),
                    connected=connected,
                    sites=unreachable,
                )
            else:
                log.info("rescheduling_resumed", unreachable=len(unreachable), connected=connected)
        if not paused:
            self.note = ""

    async def _move(self, move: Move) -> bool:
        """Write one move; a lost race or a store failure is logged and retried next look."""
        try:
            job = await self._jobs.update(move.job_id, move_off(move))
        except FederationError as err:
            log.warning(
                "task_move_failed",
                job=move.job_id,
                task=move.task,
                site=move.site,
                error=str(err),
                code=err.reason,
            )
            return False
        task = find_task(job, move.task)
        if move.is_cancel:
            if task.state != job_state.CANCELLED:
                return False
            log.info("cancel_finished_without_site", job=move.job_id, task=move.task)
            return True
        if task.state != job_state.PENDING or task.displaced.epoch != move.epoch:
            return False  # the task moved on meanwhile (a report, a cancel): nothing to do
        TASKS_MOVED.inc()
        log.warning(
            "task_moved_off_lost_site",
            job=move.job_id,
            task=move.task,
            site=move.site,
            old_epoch=move.epoch,
            epoch=task.epoch,
            reason=move.reason,
        )
        return True


def due_moves(
    job: jobs_pb2.Job, offline: dict[str, OfflineSite], now: float, heartbeat_s: float
) -> list[Move]:
    """The tasks of ``job`` at offline sites whose grace is over (``is_due``).

    A cancelled job's tasks are not placed again: past the grace they end CANCELLED without
    waiting for their site (whatever it still runs is stopped when it returns).
    """
    policy = policy_of(job.spec)
    out = []
    for task in job.tasks:
        site = offline.get(task.site)
        if site is None or task.state not in job_state.AT_SITE:
            continue
        away_s = now - site.since
        how = "unreachable" if site.is_unreachable else "disconnected"
        if job.cancel_requested:
            if away_s >= policy.lost_after_s:
                reason = f"cancelled; site {site.name} {how} for {away_s:.0f}s"
                out.append(Move(job.id, task.name, site.name, task.epoch, reason, is_cancel=True))
            continue
        if not is_due(policy, away_s, heartbeat_s):
            continue
        where = (
            f"from checkpoint {task.checkpoint.path}" if task.checkpoint.path else "from scratch"
        )
        reason = f"site {site.name} {how} for {away_s:.0f}s; placing again {where}"
        out.append(Move(job.id, task.name, site.name, task.epoch, reason))
    return out


def move_off(move: Move) -> Mutation:
    """Back to PENDING with a new epoch, remembering the copy left at the lost site."""

    def mutate(job: jobs_pb2.Job) -> list[Change]:
        task = find_task(job, move.task)
        if task.site != move.site or task.epoch != move.epoch:
            return []
        if task.state not in job_state.AT_SITE:
            return []
        if move.is_cancel != job.cancel_requested:
            return []  # cancelled (or not) since the look: the next look decides again
        if move.is_cancel:
            return [transition(job, move.task, job_state.CANCELLED, move.reason)]
        change = transition(job, move.task, job_state.PENDING, move.reason)
        task.displaced.site = move.site
        task.displaced.epoch = move.epoch
        task.displaced.moved_at.GetCurrentTime()
        next_epoch(task)
        unplace(task)
        task.preempted_by = ""  # moved anyway: its room there is gone with the site
        task.moves += 1
        forget_devices(task)
        return [Change(change.task, change.state, change.reason, move.site, move.site)]

    return mutate
