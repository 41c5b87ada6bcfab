"""The scheduling loop: place pending tasks and negotiate each with the chosen sites.

For every attempt the task's epoch (its fencing token) is bumped and written before the offer
leaves, and DELEGATED is written before the commit leaves, so a restarted coordinator never
reuses an epoch and never forgets a task it handed to a site.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import structlog

from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.coordinator import job_state
from federation.coordinator.jobs import Change, JobRepository, Mutation, find_task, transition
from federation.coordinator.sites import SessionClosedError, SiteRegistry
from federation.errors import FederationError
from federation.metrics import OFFERS
from federation.placement.framework import Framework
from federation.placement.request import Request

log = structlog.get_logger()

NEGOTIATE = "Negotiate"
TaskKey = tuple[str, str]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    offer_timeout_s: float = 5.0
    """How long a site may take to answer an offer or a commit."""
    reservation_lease_s: float = 10.0
    """How long a site holds a reservation that no commit follows."""
    max_offers_per_round: int = 5
    """Sites tried, best first, before a task goes back to PENDING."""
    retry_interval_s: float = 5.0
    """Longest wait before pending tasks are tried again without any change."""
    max_concurrent_negotiations: int = 256


class Scheduler:
    """Finds pending tasks, places them and negotiates delegation, concurrently per task."""

    def __init__(
        self,
        jobs: JobRepository,
        sites: SiteRegistry,
        framework: Framework,
        config: SchedulerConfig,
    ) -> None:
        self._jobs = jobs
        self._sites = sites
        self._framework = framework
        self._config = config
        self._wake = asyncio.Event()
        self._inflight: set[TaskKey] = set()
        self._not_before: dict[TaskKey, float] = {}
        self._backoff_s: dict[TaskKey, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(config.max_concurrent_negotiations)

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: in Python 3.11 wait_for can swallow a
            # cancellation that races with the event being set, and stop() would hang.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._next_wait_s()):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self._cycle()
            except Exception:
                # One bad cycle (a store error, a plugin bug) must not stop scheduling for good.
                log.exception("scheduling_cycle_failed")
                await asyncio.sleep(self._config.retry_interval_s)

    def _next_wait_s(self) -> float:
        """Until the soonest backed-off task is due (due ones were handled this cycle)."""
        now = time.monotonic()
        future = [t for t in self._not_before.values() if t > now]
        soonest = min(future, default=now + self._config.retry_interval_s)
        return max(0.01, min(soonest - now, self._config.retry_interval_s))

    async def _cycle(self) -> None:
        now = time.monotonic()
        snapshot = self._sites.snapshot()
        pending: set[TaskKey] = set()
        for job in self._jobs.active():
            if job.cancel_requested:
                continue
            for task in job.tasks:
                key = (job.id, task.name)
                if task.state != job_state.PENDING or key in self._inflight:
                    continue
                pending.add(key)
                if self._not_before.get(key, 0.0) > now:
                    continue
                spec = next(t for t in job.spec.tasks if t.name == task.name)
                decision = self._framework.place(Request.from_spec(job.spec, spec), snapshot)
                verdicts = [
                    jobs_pb2.SiteVerdict(site=r.site, stage=r.plugin, reason=r.reason)
                    for r in decision.rejections
                ]
                if not decision.ranked:
                    await self._stay_pending(job.id, task.name, verdicts)
                    continue
                self._inflight.add(key)
                await self._slots.acquire()
                runner = asyncio.create_task(
                    self._negotiate(job.id, task.name, decision.ranked, verdicts)
                )
                self._tasks.add(runner)
                runner.add_done_callback(self._tasks.discard)
        # Forget the backoff of tasks that are no longer waiting (placed, cancelled, failed).
        for key in set(self._not_before) - pending - self._inflight:
            self._forget(key)

    async def _stay_pending(
        self, job_id: str, task_name: str, verdicts: list[jobs_pb2.SiteVerdict]
    ) -> None:
        """Record why a task fits nowhere; written only when the reasons change."""

        def mutate(job: jobs_pb2.Job) -> list[Change]:
            task = find_task(job, task_name)
            if task.state != job_state.PENDING or list(task.verdicts) == verdicts:
                return []
            del task.verdicts[:]
            task.verdicts.extend(verdicts)
            reason = summarize(verdicts)
            return [transition(job, task_name, job_state.PENDING, reason)]

        key = (job_id, task_name)
        self._backoff(key)
        try:
            await self._jobs.update(job_id, mutate)
        except FederationError as err:
            log.warning("pending_update_failed", job=job_id, task=task_name, error=str(err))

    def _backoff(self, key: TaskKey) -> None:
        delay = min(self._backoff_s.get(key, 0.25) * 2, self._config.retry_interval_s)
        self._backoff_s[key] = delay
        self._not_before[key] = time.monotonic() + delay

    def _forget(self, key: TaskKey) -> None:
        self._backoff_s.pop(key, None)
        self._not_before.pop(key, None)

    async def _negotiate(
        self,
        job_id: str,
        task_name: str,
        ranked: tuple[str, ...],
        verdicts: list[jobs_pb2.SiteVerdict],
    ) -> None:
        key = (job_id, task_name)
        try:
            for site in ranked[: self._config.max_offers_per_round]:
                outcome = await self._try_site(job_id, task_name, site)
                OFFERS.labels("settled" if outcome is None else "refused").inc()
                if outcome is None:
                    self._forget(key)
                    return
                verdicts.append(jobs_pb2.SiteVerdict(site=site, stage=NEGOTIATE, reason=outcome))
            self._backoff(key)
            await self._back_to_pending(job_id, task_name, verdicts)
        except Exception as err:
            if isinstance(err, FederationError):
                log.warning("negotiation_failed", job=job_id, task=task_name, error=str(err))
            else:
                log.exception("negotiation_crashed", job=job_id, task=task_name)
            self._backoff(key)
            # Never leave the task in SCHEDULING: only PENDING tasks are picked up again.
            with contextlib.suppress(Exception):
                await self._back_to_pending(job_id, task_name, verdicts)
        finally:
            self._inflight.discard(key)
            self._slots.release()

    async def _try_site(self, job_id: str, task_name: str, site: str) -> str | None:
        """One offer/commit round with ``site``; None when delegated (or moot), else why not."""
        session = self._sites.session(site)
        if session is None:
            return "site disconnected before the offer"
        offered = await self._jobs.update(job_id, _mark_scheduling(task_name, site))
        task = find_task(offered, task_name)
        if task.state != job_state.SCHEDULING or task.site != site:
            return None  # cancelled meanwhile
        spec = next(t for t in offered.spec.tasks if t.name == task_name)
        offer = site_link_service_pb2.Offer(
            job_id=job_id,
            task=task_name,
            epoch=task.epoch,
            spec=spec,
            tenant=offered.spec.tenant,
            lease_s=self._config.reservation_lease_s,
        )
        try:
            reply = await session.request(
                site_link_service_pb2.ConnectResponse(offer=offer), self._config.offer_timeout_s
            )
        except TimeoutError:
            return f"no answer to the offer within {self._config.offer_timeout_s:g}s"
        except SessionClosedError:
            return "site disconnected during the offer"
        answer = reply.offer_answer
        if not reply.HasField("offer_answer"):
            return "site answered the offer with the wrong message"
        if not answer.accepted:
            return f"declined: {answer.reason}"
        delegated = await self._jobs.update(
            job_id, _mark_delegated(task_name, site, task.epoch, answer.reservation_id)
        )
        held = find_task(delegated, task_name)
        if held.state != job_state.DELEGATED or held.epoch != task.epoch:
            with contextlib.suppress(SessionClosedError):
                session.send(
                    site_link_service_pb2.ConnectResponse(
                        release=site_link_service_pb2.Release(reservation_id=answer.reservation_id)
                    )
                )
            return None
        commit = site_link_service_pb2.Commit(
            reservation_id=answer.reservation_id, job_id=job_id, task=task_name, epoch=task.epoch
        )
        committed = await self._commit(site, commit)
        if committed is None:
            # Nobody knows whether the site started it; bumping the epoch by placing it again
            # fences off a copy that did start.
            reason = "no answer to the commit"
            log.warning("commit_unanswered", job=job_id, task=task_name, site=site)
            await self._jobs.update(job_id, _back_from_site(task_name, task.epoch, reason))
            return reason
        if committed.commit_answer.started:
            log.info("task_delegated", job=job_id, task=task_name, site=site, epoch=task.epoch)
            return None
        reason = f"commit refused: {committed.commit_answer.reason}"
        await self._jobs.update(job_id, _back_from_site(task_name, task.epoch, reason))
        return reason

    async def _commit(
        self, site: str, commit: site_link_service_pb2.Commit
    ) -> site_link_service_pb2.ConnectRequest | None:
        """Send the commit, once more over a new session if the first try got no answer.

        A site treats a repeated commit of the same reservation as a no-op.
        """
        for _ in range(2):
            session = self._sites.session(site)
            if session is None:
                return None
            request = site_link_service_pb2.ConnectResponse(commit=commit)
            try:
                return await session.request(request, self._config.offer_timeout_s)
            except (TimeoutError, SessionClosedError):
                continue
        return None

    async def _back_to_pending(
        self, job_id: str, task_name: str, verdicts: list[jobs_pb2.SiteVerdict]
    ) -> None:
        def mutate(job: jobs_pb2.Job) -> list[Change]:
            task = find_task(job, task_name)
            if task.state not in (job_state.SCHEDULING, job_state.PENDING):
                return []
            del task.verdicts[:]
            task.verdicts.extend(verdicts)
            task.site = ""
            return [transition(job, task_name, job_state.PENDING, summarize(verdicts))]

        await self._jobs.update(job_id, mutate)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _mark_scheduling(task_name: str, site: str) -> Mutation:
    def mutate(job: jobs_pb2.Job) -> list[Change]:
        task = find_task(job, task_name)
        if task.state not in (job_state.PENDING, job_state.SCHEDULING):
            return []
        task.epoch += 1
        task.site = site
        task.reservation_id = ""
        return [transition(job, task_name, job_state.SCHEDULING, f"offered to {site}")]

    return mutate


def _mark_delegated(task_name: str, site: str, epoch: int, reservation_id: str) -> Mutation:
    def mutate(job: jobs_pb2.Job) -> list[Change]:
        task = find_task(job, task_name)
        if task.state != job_state.SCHEDULING or task.epoch != epoch:
            return []
        task.reservation_id = reservation_id
        del task.verdicts[:]
        return [transition(job, task_name, job_state.DELEGATED, f"{site} accepted")]

    return mutate


def _back_from_site(task_name: str, epoch: int, reason: str) -> Mutation:
    def mutate(job: jobs_pb2.Job) -> list[Change]:
        task = find_task(job, task_name)
        if task.state != job_state.DELEGATED or task.epoch != epoch:
            return []
        task.site = ""
        task.reservation_id = ""
        return [transition(job, task_name, job_state.PENDING, reason)]

    return mutate


def summarize(verdicts: list[jobs_pb2.SiteVerdict]) -> str:
    """One line for people: why no site took the task."""
    if not verdicts:
        return "no sites are connected"
    parts = [f"{v.site}: {v.reason}" for v in verdicts[:3]]
    more = f" (+{len(verdicts) - 3} more)" if len(verdicts) > 3 else ""
    return "no site can take it now: " + "; ".join(parts) + more
