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
from federation.coordinator.jobs import (
    Change,
    JobRepository,
    Mutation,
    find_task,
    next_epoch,
    transition,
    unplace,
)
from federation.coordinator.sites import SessionClosedError, SiteRegistry, SiteSession
from federation.coordinator.validation import TASK_OUTPUT
from federation.errors import FederationError
from federation.metrics import OFFERS
from federation.placement.estimates import Estimates, estimate
from federation.placement.framework import Framework
from federation.placement.request import Input, Request

log = structlog.get_logger()

NEGOTIATE = "Negotiate"
CHECKPOINT = "checkpoint:"
"""Placement input naming the newest checkpoint of a task that restarts from it."""
TaskKey = tuple[str, str]


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    offer_timeout_s: float = 5.0
    """How long a site may take to answer an offer or a commit."""
    reservation_lease_s: float = 10.0
    """How long a site holds a reservation that no commit follows."""
    max_offers_per_round: int = 5
    """Sites tried, best first, before a task goes back to PENDING."""
    offers_at_once: int = 3
    """Sites offered a task at the same time; the best one that accepts gets the commit."""
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
        jobs = self._jobs.pending()
        # Built only when something waits: every view delta wakes the loop, and flattening
        # the whole federation into arrays is the expensive part of a cycle.
        snapshot = self._sites.snapshot() if jobs else None
        pending: set[TaskKey] = set()
        for job in jobs:
            if job.cancel_requested:
                continue
            for task in job.tasks:
                key = (job.id, task.name)
                if task.state != job_state.PENDING or key in self._inflight:
                    continue
                request = request_for(job, task.name)
                if request is None:
                    continue  # waits for its dependencies; a report of theirs wakes us
                pending.add(key)
                if self._not_before.get(key, 0.0) > now:
                    continue
                assert snapshot is not None
                decision = self._framework.place(request, snapshot)
                verdicts = [
                    jobs_pb2.SiteVerdict(site=r.site, stage=r.plugin, reason=r.reason)
                    for r in decision.rejections
                ]
                if not decision.ranked:
                    await self._stay_pending(job.id, task.name, verdicts)
                    continue
                estimates = estimate(request, snapshot)
                by_site = {
                    site: estimate_proto(estimates, snapshot.site_index(site) or 0)
                    for site in decision.ranked[: self._config.max_offers_per_round]
                }
                self._inflight.add(key)
                await self._slots.acquire()
                runner = asyncio.create_task(
                    self._negotiate(job.id, task.name, decision.ranked, verdicts, by_site)
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
        estimates: dict[str, jobs_pb2.Estimate],
    ) -> None:
        key = (job_id, task_name)
        candidates = list(ranked[: self._config.max_offers_per_round])
        step = max(1, self._config.offers_at_once)
        try:
            for first in range(0, len(candidates), step):
                batch = candidates[first : first + step]
                refusals = await self._round(job_id, task_name, batch, estimates)
                OFFERS.labels("settled" if refusals is None else "refused").inc()
                if refusals is None:
                    self._forget(key)
                    return
                verdicts.extend(
                    jobs_pb2.SiteVerdict(site=site, stage=NEGOTIATE, reason=why)
                    for site, why in refusals.items()
                )
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

    async def _round(
        self,
        job_id: str,
        task_name: str,
        sites: list[str],
        estimates: dict[str, jobs_pb2.Estimate],
    ) -> dict[str, str] | None:
        """Offer to ``sites`` at once, commit the best acceptance, release the others.

        Returns None when the task was delegated (or the question became moot), else why
        each site did not take it. All offers of a round share one epoch: only the site that
        gets the commit may ever run it.
        """
        sessions = {site: self._sites.session(site) for site in sites}
        refusals = {s: "site disconnected before the offer" for s, v in sessions.items() if not v}
        live = [site for site in sites if sessions[site] is not None]
        if not live:
            return refusals
        offered = await self._jobs.update(job_id, _mark_scheduling(task_name, live))
        task = find_task(offered, task_name)
        if task.state != job_state.SCHEDULING:
            return None  # cancelled meanwhile
        spec = next(t for t in offered.spec.tasks if t.name == task_name)
        offer = site_link_service_pb2.Offer(
            job_id=job_id,
            task=task_name,
            epoch=task.epoch,
            spec=spec,
            tenant=offered.spec.tenant,
            lease_s=self._config.reservation_lease_s,
            restore=task.checkpoint if task.checkpoint.path else None,
        )
        answers = await asyncio.gather(*(self._offer(sessions[s], offer) for s in live))
        accepted: list[tuple[str, str]] = []
        for site, (reservation, why) in zip(live, answers, strict=True):
            if reservation:
                accepted.append((site, reservation))
            else:
                refusals[site] = why
        if not accepted:
            return refusals
        chosen, reservation = accepted[0]  # ``live`` is in rank order: the best acceptance
        for site, other in accepted[1:]:
            self._release(site, other)
            refusals[site] = f"accepted, but {chosen} ranked higher"
        delegated = await self._jobs.update(
            job_id,
            _mark_delegated(task_name, chosen, task.epoch, reservation, estimates.get(chosen)),
        )
        held = find_task(delegated, task_name)
        if held.state != job_state.DELEGATED or held.epoch != task.epoch:
            self._release(chosen, reservation)
            return None
        commit = site_link_service_pb2.Commit(
            reservation_id=reservation, job_id=job_id, task=task_name, epoch=task.epoch
        )
        committed = await self._commit(chosen, commit)
        if committed is not None and committed.commit_answer.started:
            log.info("task_delegated", job=job_id, task=task_name, site=chosen, epoch=task.epoch)
            return None
        # No answer: nobody knows whether the site started it; placing it again bumps the
        # epoch, which fences off a copy that did start.
        why = "no answer to the commit"
        if committed is not None:
            why = f"commit refused: {committed.commit_answer.reason}"
        log.warning("commit_failed", job=job_id, task=task_name, site=chosen, reason=why)
        await self._jobs.update(job_id, _back_from_site(task_name, task.epoch, why))
        refusals[chosen] = why
        return refusals

    async def _offer(
        self, session: SiteSession | None, offer: site_link_service_pb2.Offer
    ) -> tuple[str, str]:
        """(reservation id, "") when the site accepts, else ("", why not)."""
        assert session is not None
        request = site_link_service_pb2.CoordinatorMessage()
        request.offer.CopyFrom(offer)
        try:
            reply = await session.request(request, self._config.offer_timeout_s)
        except TimeoutError:
            return "", f"no answer to the offer within {self._config.offer_timeout_s:g}s"
        except SessionClosedError:
            return "", "site disconnected during the offer"
        if not reply.HasField("offer_answer"):
            return "", "site answered the offer with the wrong message"
        answer = reply.offer_answer
        if not answer.accepted:
            return "", f"declined: {answer.reason}"
        return answer.reservation_id, ""

    def _release(self, site: str, reservation_id: str) -> None:
        session = self._sites.session(site)
        if session is not None:
            with contextlib.suppress(SessionClosedError):
                session.send(
                    site_link_service_pb2.CoordinatorMessage(
                        release=site_link_service_pb2.Release(reservation_id=reservation_id)
                    )
                )

    def explain(self, job: jobs_pb2.Job) -> list[jobs_pb2.TaskExplanation]:
        """For each task: every site, with the filter that rejected it or its score by term."""
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
            decision = self._framework.place(request, snapshot)
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
            for rejection in decision.rejections:
                explanation.sites.add(
                    site=rejection.site,
                    plugin=rejection.plugin,
                    reason=rejection.reason,
                    estimate=estimate_proto(estimates, snapshot.site_index(rejection.site) or 0),
                )
            out.append(explanation)
        return out

    async def _commit(
        self, site: str, commit: site_link_service_pb2.Commit
    ) -> site_link_service_pb2.AgentMessage | None:
        """Send the commit, once more over a new session if the first try got no answer.

        A site treats a repeated commit of the same reservation as a no-op.
        """
        for _ in range(2):
            session = self._sites.session(site)
            if session is None:
                return None
            request = site_link_service_pb2.CoordinatorMessage(commit=commit)
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
            unplace(task)
            return [transition(job, task_name, job_state.PENDING, summarize(verdicts))]

        await self._jobs.update(job_id, mutate)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _mark_scheduling(task_name: str, sites: list[str]) -> Mutation:
    def mutate(job: jobs_pb2.Job) -> list[Change]:
        task = find_task(job, task_name)
        if task.state not in (job_state.PENDING, job_state.SCHEDULING):
            return []
        next_epoch(task)
        unplace(task)
        return [transition(job, task_name, job_state.SCHEDULING, f"offered to {', '.join(sites)}")]

    return mutate


def _mark_delegated(
    task_name: str,
    site: str,
    epoch: int,
    reservation_id: str,
    estimated: jobs_pb2.Estimate | None,
) -> Mutation:
    def mutate(job: jobs_pb2.Job) -> list[Change]:
        task = find_task(job, task_name)
        if task.state != job_state.SCHEDULING or task.epoch != epoch:
            return []
        task.site = site
        task.reservation_id = reservation_id
        if estimated is not None:
            task.estimate.CopyFrom(estimated)
        del task.verdicts[:]
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


def summarize(verdicts: list[jobs_pb2.SiteVerdict]) -> str:
    """One line for people: why no site took the task."""
    if not verdicts:
        return "no sites are connected"
    parts = [f"{v.site}: {v.reason}" for v in verdicts[:3]]
    more = f" (+{len(verdicts) - 3} more)" if len(verdicts) > 3 else ""
    return "no site can take it now: " + "; ".join(parts) + more


def waiting_on(job: jobs_pb2.Job, task_name: str) -> list[str]:
    """Dependencies of a task that have not succeeded yet."""
    spec = next(t for t in job.spec.tasks if t.name == task_name)
    states = {t.name: t.state for t in job.tasks}
    return [d for d in spec.depends_on if states.get(d) != job_state.SUCCEEDED]


def request_for(job: jobs_pb2.Job, task_name: str) -> Request | None:
    """The placement request for a task, or None while it waits for its dependencies.

    The outputs of the tasks it depends on become its inputs, located where those ran, and so
    does the task's newest recorded checkpoint, which a restart reads.
    """
    if waiting_on(job, task_name):
        return None
    specs = {t.name: t for t in job.spec.tasks}
    status = {t.name: t for t in job.tasks}
    spec = specs[task_name]
    inputs = [
        Input(i.dataset, i.bytes, i.site)
        for i in spec.inputs
        if not i.dataset.startswith(TASK_OUTPUT)
    ]
    for dep in spec.depends_on:
        size = specs[dep].output_bytes
        for i in spec.inputs:  # an explicit "task:NAME" input may give the size
            if i.dataset == TASK_OUTPUT + dep and i.bytes:
                size = i.bytes
        if size:
            inputs.append(Input(TASK_OUTPUT + dep, size, status[dep].site))
    checkpoint = status[task_name].checkpoint
    if checkpoint.path and checkpoint.bytes:
        # A restart reads its newest checkpoint from the site that holds it.
        inputs.append(Input(CHECKPOINT + task_name, checkpoint.bytes, checkpoint.site))
    return Request.from_spec(job.spec, spec, inputs)


def estimate_proto(estimates: Estimates, site: int) -> jobs_pb2.Estimate:
    return jobs_pb2.Estimate(
        queue_s=float(estimates.queue_s[site]),
        transfer_s=float(estimates.transfer_s[site]),
        run_s=float(estimates.run_s[site]),
        total_s=float(estimates.total_s[site]),
        cost_usd=float(estimates.cost_usd[site]),
        energy_kwh=float(estimates.energy_kwh[site]),
        transfer_bytes=int(estimates.transfer_bytes[site]),
    )
