"""Negotiating delegation, the only part of the scheduling cycle that talks to sites: rounds
of offers to the ranked sites, the commit of the best acceptance (DELEGATED written first, at
the round's epoch), the release of the others, and what goes back in line.

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
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeAlias

import structlog

from federation import tracing
from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.common import job_state
from federation.common.keys import TaskKey
from federation.coordinator.data.checkpoint_copies import PROTOCOL as CKPT_PROTOCOL
from federation.coordinator.data.checkpoint_copies import restore_input
from federation.coordinator.data.outputs import PROTOCOL as DATA_PROTOCOL
from federation.coordinator.data.outputs import staged
from federation.coordinator.data.staged_inputs import Registered, resolve
from federation.coordinator.jobs.gangs import host_of, rendezvous
from federation.coordinator.jobs.records import Mutation, find_spec, find_task
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.policy.reservations import Reservations
from federation.coordinator.scheduling import site_calls
from federation.coordinator.scheduling.config import SchedulerConfig
from federation.coordinator.scheduling.delegation import (
    back_from_site,
    back_to_pending,
    delegated_as,
    mark_delegated,
    task_of,
    trace_commit,
    trace_offer,
)
from federation.coordinator.scheduling.learning import SpeedLearner
from federation.coordinator.scheduling.offers import (
    Negotiation,
    by_promise,
    commit_estimate,
    devices_of,
    for_site,
    sooner_untried,
    whole_gangs,
)
from federation.coordinator.scheduling.rounds import offer_rounds
from federation.coordinator.scheduling.site_calls import OfferReply
from federation.coordinator.scheduling.task_requests import copy_estimate
from federation.coordinator.scheduling.verdicts import refusal
from federation.coordinator.sites.registry import SessionClosedError, SiteRegistry
from federation.errors import FederationError
from federation.metrics import GANG_RESERVATIONS_LET_GO, OFFERS

log = structlog.get_logger()

Offers: TypeAlias = dict[str, list[tuple[Negotiation, site_link_service_pb2.Offer]]]
"""Per site, the offers of a round, each with its negotiation."""
Commits: TypeAlias = list[tuple[Negotiation, site_link_service_pb2.Commit]]


class Outcomes(Protocol):
    """What the scheduling cycle learns from its negotiations as they go."""

    def unsettled(self, key: TaskKey) -> None:
        """The task found no site: it waits in line again (backed off)."""

    def over(self, negotiations: list[Negotiation]) -> None:
        """These negotiations ended, each once: their tasks may be tried again, and what the
        cycle kept for those settled (delegated, or moot) is forgotten."""

    def released(self) -> None:
        """A reservation was let go: room came free at its site."""

    def frees(self) -> int:
        """How often room has come free so far (``released`` counts too)."""

    def arrived(self, site: str) -> None:
        """A commit leaves for ``site``: a task comes to it."""

    def batch_over(self, unsettled: bool, room_freed: bool) -> None:
        """A batch ended: whether tasks of it went back in line, and whether room came free
        while they were out."""


class Negotiator:
    """Runs the negotiations of the cycle's batches, many at once."""

    def __init__(
        self,
        jobs: JobRepository,
        sites: SiteRegistry,
        learner: SpeedLearner,
        config: SchedulerConfig,
        outcomes: Outcomes,
        datasets: Registered | None = None,
    ) -> None:
        self._jobs = jobs
        self._sites = sites
        self._learner = learner
        self._config = config
        self._outcomes = outcomes
        self._datasets = datasets
        """The registered datasets, whose holders sign URLs for tasks reading them."""
        self.push_outputs: Callable[[str, str], None] = lambda job_id, task: None
        """Pushes a task's outputs out of a store other sites cannot reach (the job
        manager's, set once it exists)."""
        self._tasks: set[asyncio.Task[None]] = set()
        self.reservations = Reservations()
        """The tasks under negotiation, with what each was admitted with: counted against
        their queues and held out of the line (they stay PENDING in the store, since offers
        need no write). One every site declined counts until its negotiation ends:
        uncounted, the queues beside its queue borrowed the room and a reclaim followed once
        it was let go (``bench/fairness.py``, no minimum run: 8-9 reclaims a run, against
        none)."""
        jobs.counts(self.reservations, out_of_line=True)

    def start(self, batch: list[Negotiation]) -> None:
        """Negotiate ``batch`` in the background; its tasks are held out of the line."""
        self.reservations.keep((n.key, n.holds) for n in batch)
        runner = asyncio.create_task(self._negotiate(batch, self._outcomes.frees()))
        self._tasks.add(runner)
        runner.add_done_callback(self._tasks.discard)

    async def _negotiate(self, batch: list[Negotiation], frees: int) -> None:
        """Rounds of offers until every task is delegated or has run out of sites. ``frees``:
        how often room had come free when the batch was formed."""
        unsettled: list[Negotiation] = []
        try:
            await self._rounds(batch)
            self._let_go_incomplete_gangs(batch)
            unsettled = [n for n in batch if not n.settled]
            for n in unsettled:
                self._outcomes.unsettled(n.key)
            try:
                # Record why no site took them, and the epochs their offers used.
                if unsettled:
                    await self._back_to_pending(unsettled)
            except Exception as err:
                log.warning("requeue_failed", tasks=len(unsettled), error=str(err))
        finally:
            self._let_go(batch)
        self._outcomes.batch_over(bool(unsettled), self._outcomes.frees() != frees)

    def _let_go_incomplete_gangs(self, batch: list[Negotiation]) -> None:
        """Gang parts that hold a reservation while a part of their gang found no site let
        it go: all or nothing."""
        letting_go = [n for n in batch if n.gang is not None and not n.committing and n.chosen]
        # Named before any is let go: a part let go below is not the one that found no site.
        missing = {
            n.key: next((m.task for m in n.gang or () if m.chosen is None), "?") for n in letting_go
        }
        for n in letting_go:
            assert n.chosen is not None
            if (job := self._jobs.cached(n.job_id)) is not None:
                held_s = time.monotonic() - n.chosen_at
                GANG_RESERVATIONS_LET_GO.inc(devices_of(find_spec(job, n.task)) * held_s)
            self._release(*n.chosen)
            why = f"accepted, but let go: part {missing[n.key]} of its gang found no site"
            n.verdicts.append(refusal(n.chosen[0], why))
            n.chosen = None

    def _let_go(self, negotiations: list[Negotiation]) -> None:
        """These negotiations are over: their room is free, and tasks left PENDING can be
        picked up again. Each is let go once: by then another may hold its task."""
        ending = [n for n in negotiations if not n.over]
        for n in ending:
            n.over = True
        self.reservations.let_go(n.key for n in ending)
        self._outcomes.over(ending)

    async def _rounds(self, batch: list[Negotiation]) -> None:
        """Every round the batch's tasks need; a failure ends them, leaving tasks unsettled."""
        try:
            # One round more than the sites ranked: a slower site let go is asked last.
            for first, stop in offer_rounds(
                self._config.max_offers_per_round + 1, self._config.offers_at_once
            ):
                open_ = [
                    n
                    for n in batch
                    if not n.settled
                    and first < len(n.candidates)
                    and (n.gang is None or n.chosen is None)  # a gang part holding room waits
                ]
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

    async def _round(self, negotiations: list[Negotiation], first: int, stop: int) -> None:
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
                    n.verdicts.append(refusal(site, "site disconnected before the offer"))
                else:
                    live.append(site)
            if live:
                offered_to[n.key] = live
        offers, active = self._offers(negotiations, offered_to)
        await self._ask(offers, active, offered_to)

    def _offers(
        self, negotiations: list[Negotiation], offered_to: dict[TaskKey, list[str]]
    ) -> tuple[Offers, list[Negotiation]]:
        """Each task's offer to each of its sites ``offered_to`` (those that cannot take its
        data dropped), at a new epoch; and the tasks offered."""
        offers: Offers = {}
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
                own = for_site(offer, n.estimates.get(site), n.models.get(site), cordoned)
                offers.setdefault(site, []).append((n, own))
        return offers, active

    async def _ask(
        self, offers: Offers, active: list[Negotiation], offered_to: dict[TaskKey, list[str]]
    ) -> None:
        """Send each site its offers; decide each task once every site it was offered to has
        answered, so that a slow site holds up only the tasks offered to it."""
        unanswered = {n.key: len(offered_to[n.key]) for n in active}
        accepted: dict[TaskKey, list[tuple[str, str]]] = {}
        asking = {
            asyncio.ensure_future(
                site_calls.offer(
                    self._sites, site, [o for _, o in items], self._config.offer_timeout_s
                )
            ): site
            for site, items in offers.items()
        }
        # Each site's answer is queued as it comes: waiting on the set of those left over
        # and over (asyncio.wait) cost the square of the sites asked.
        answers: asyncio.Queue[asyncio.Task[list[OfferReply]]] = asyncio.Queue()
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
                            n.verdicts.append(refusal(site, why))
                        if tracing.on():
                            trace_offer(n, site, asked_ns, answer, why)
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
        negotiations: list[Negotiation],
        offered_to: dict[TaskKey, list[str]],
        accepted: dict[TaskKey, list[tuple[str, str]]],
    ) -> None:
        """For tasks whose sites have all answered: commit the best acceptance of each and
        release the others."""
        for n in negotiations:
            if n.key not in accepted:
                continue
            best, *others = by_promise(n, offered_to[n.key], accepted[n.key])
            if not others and (sooner := sooner_untried(n, best[0], offered_to[n.key])):
                # Its own answer is slower than a site not asked yet was estimated: ask
                # that one first, and this one again last.
                self._release(*best)
                del accepted[n.key]
                n.deferred.add(best[0])
                n.candidates = (*n.candidates, best[0])
                n.verdicts.append(
                    refusal(
                        best[0],
                        f"accepted, but would finish in {n.estimates[best[0]].total_s:.0f} s, "
                        f"later than {sooner} was estimated to; asked last",
                    )
                )
                continue
            n.chosen, n.chosen_at = best, time.monotonic()
            for site, reservation in others:
                self._release(site, reservation)
                why = f"accepted, but {best[0]} finishes sooner or ranked higher"
                n.verdicts.append(refusal(site, why))
        chosen = [n for n in negotiations if n.key in accepted]
        await self._delegate([n for n in chosen if n.gang is None] + whole_gangs(chosen))
        # Delegated ones need no more of the batch, which may wait on slower sites.
        self._let_go([n for n in negotiations if n.settled])

    async def _delegate(self, negotiations: list[Negotiation]) -> None:
        """Write DELEGATED for each task's chosen site, then send the commits.

        Once its commit has left, a task goes back to PENDING only when its site refuses the
        commit. A commit that gets no answer may have started the task: it stays DELEGATED
        at its epoch, and the site's next hello, which lists every task it holds, settles it
        (``JobManager.reconcile``: RUNNING if the site has it, PENDING at once if not); a site
        that stays away is left to the lost-site monitor, as after a failover."""
        if not negotiations:
            return
        started_ns = tracing.now_ns()
        ranks = self._rendezvous(negotiations)
        marks = []
        for n in negotiations:
            assert n.chosen is not None
            site, reservation = n.chosen
            estimated = n.estimates.get(site)
            mark = mark_delegated(n.task, site, n.epoch, n.revision, reservation, estimated)
            marks.append((n.job_id, mark))
        written = await self._jobs.update_many(marks)
        back: list[tuple[str, Mutation]] = []
        ready = self._commits(negotiations, written, ranks, back, started_ns)
        commits = await self._with_data(ready, written, back)
        await self._send_commits(commits, back, started_ns)
        if back:
            await self._jobs.update_many(back)

    def _commits(
        self,
        negotiations: list[Negotiation],
        written: dict[str, jobs_pb2.Job | FederationError],
        ranks: dict[TaskKey, tuple[list[str], int]],
        back: list[tuple[str, Mutation]],
        started_ns: int,
    ) -> Commits:
        """The commit of each task written DELEGATED as negotiated, to a site still
        connected; the others are released, or go ``back`` to PENDING."""
        ready: Commits = []
        for n in negotiations:
            assert n.chosen is not None
            site, reservation = n.chosen
            task = task_of(written, n)
            if task is None or not delegated_as(task, n):
                self._release(site, reservation)
                n.settled = task is not None  # moved on meanwhile; a failed write requeues
                continue
            if self._sites.session(site) is None:
                # No commit leaves, so the site cannot run it: later rounds may offer it on.
                why = "site disconnected before the commit"
                trace_commit(n, site, started_ns, why)
                back.append((n.job_id, back_from_site(n.task, n.epoch, why)))
                n.verdicts.append(refusal(site, why))
                continue
            commit = site_link_service_pb2.Commit(
                reservation_id=reservation, job_id=n.job_id, task=n.task, epoch=n.epoch
            )
            if (gang_rank := ranks.get(n.key)) is not None:
                commit.gang_peers.extend(gang_rank[0])
                commit.gang_rank = gang_rank[1]
            ready.append((n, commit))
        return ready

    async def _with_data(
        self,
        ready: Commits,
        written: dict[str, jobs_pb2.Job | FederationError],
        back: list[tuple[str, Mutation]],
    ) -> dict[str, Commits]:
        """Per site, its commits with the URLs of their staged inputs and checkpoints, which
        each holder signs over its own link, all holders at once. A task whose input holder
        is away is released and goes ``back`` to PENDING."""
        staging: dict[int, Awaitable[list[site_link_service_pb2.StagedInput] | str]] = {}
        restoring: dict[int, Awaitable[site_link_service_pb2.StagedInput]] = {}
        timeout_s = self._config.offer_timeout_s
        for i, (n, _) in enumerate(ready):
            assert n.chosen is not None
            site = n.chosen[0]
            job = written[n.job_id]
            assert isinstance(job, jobs_pb2.Job)  # its task was found in it
            if (spec := find_spec(job, n.task)).inputs and staged(spec, _specs(job)):
                push = functools.partial(self.push_outputs, job.id)
                staging[i] = resolve(
                    job, n.task, self._sites, timeout_s, self._datasets, to_site=site, push=push
                )
            task = find_task(job, n.task)
            session = self._sites.session(site)
            if task.checkpoint.HasField("stored") and session and session.protocol >= CKPT_PROTOCOL:
                restoring[i] = restore_input(
                    job, n.task, task.checkpoint, self._sites, timeout_s, to_site=site
                )
        resolved = {}
        if staging:
            resolved = dict(zip(staging, await asyncio.gather(*staging.values()), strict=True))
        restores = dict(zip(restoring, await asyncio.gather(*restoring.values()), strict=True))
        commits: dict[str, Commits] = {}
        for i, (n, commit) in enumerate(ready):
            assert n.chosen is not None
            site, reservation = n.chosen
            inputs = resolved.get(i, [])
            if isinstance(inputs, str):  # a holder is away: wait, and be placed again
                self._release(site, reservation)
                back.append((n.job_id, back_from_site(n.task, n.epoch, inputs)))
                n.verdicts.append(refusal(site, inputs))
                continue
            commit.inputs.extend(inputs)
            if (restore := restores.get(i)) is not None:
                commit.restore.CopyFrom(restore)
                if restore.error:
                    log.warning(
                        "checkpoint_not_restorable", job=n.job_id, task=n.task, why=restore.error
                    )
            self._outcomes.arrived(site)
            commits.setdefault(site, []).append((n, commit))
            n.settled = True  # from here on, only the site's refusal puts it back to PENDING
        return commits

    async def _send_commits(
        self, commits: dict[str, Commits], back: list[tuple[str, Mutation]], started_ns: int
    ) -> None:
        """Send each site its commits together; a refused one goes ``back`` to PENDING."""
        answers = await asyncio.gather(
            *(
                site_calls.commit(
                    self._sites, site, [c for _, c in items], self._config.offer_timeout_s
                )
                for site, items in commits.items()
            )
        )
        for (site, items), site_answers in zip(commits.items(), answers, strict=True):
            for (n, commit), answer in zip(items, site_answers, strict=True):
                if answer is None:
                    # It may have started: DELEGATED stands until the site's hello says.
                    log.warning(
                        "commit_unanswered", job=n.job_id, task=n.task, site=site, epoch=n.epoch
                    )
                    trace_commit(n, site, started_ns, "no answer to the commit")
                    continue
                if answer.commit_answer.started:
                    log.debug("task_delegated", job=n.job_id, task=n.task, site=site, epoch=n.epoch)
                    trace_commit(n, site, started_ns, "")
                    continue
                why = f"commit refused: {answer.commit_answer.reason}"
                trace_commit(n, site, started_ns, why)
                log.warning("commit_failed", job=n.job_id, task=n.task, site=site, reason=why)
                n.settled = False  # the site does not run it: later rounds may offer it on
                back.append((n.job_id, back_from_site(n.task, commit.epoch, why)))
                n.verdicts.append(refusal(site, why))

    def _rendezvous(self, negotiations: list[Negotiation]) -> dict[TaskKey, tuple[list[str], int]]:
        """Per gang part being committed: every replica's host:port of its gang, and its
        first rank (``federation.coordinator.jobs.gangs.rendezvous``)."""
        out: dict[TaskKey, tuple[list[str], int]] = {}
        for n in negotiations:
            if n.gang is None or n.key in out or (job := self._jobs.cached(n.job_id)) is None:
                continue
            parts, hosts = [], {}
            for m in n.gang:
                assert m.chosen is not None
                site = m.chosen[0]
                parts.append((m.task, site, find_spec(job, m.task).replicas))
                if (session := self._sites.session(site)) is not None:
                    hosts[site] = host_of(session.probe_endpoint, session.peer)
            port = find_spec(job, n.task).spread.rendezvous_port
            peers, first = rendezvous(parts, hosts, port)
            for m in n.gang:
                out[m.key] = (peers, first[m.task])
        return out

    def _speaking_data(self, n: Negotiation, sites: list[str]) -> list[str]:
        """The sites whose agents can store outputs and stage inputs; a verdict for others."""
        out = []
        for site in sites:
            session = self._sites.session(site)
            if session is not None and session.protocol < DATA_PROTOCOL:
                why = f"its agent speaks site-link protocol {session.protocol}; outputs and "
                n.verdicts.append(refusal(site, why + f"staged inputs need {DATA_PROTOCOL}"))
            else:
                out.append(site)
        return out

    def _commit_estimate(
        self, n: Negotiation, site: str, answer: site_link_service_pb2.OfferAnswer
    ) -> None:
        """The site's answer into its estimate, with the error learned for that model."""
        commit_estimate(n, site, answer.run_s, answer.device_model)
        estimated = n.estimates.get(site)
        if estimated is not None and answer.device_model:
            job = self._jobs.cached(n.job_id)
            spec = next((t for t in job.spec.tasks if t.name == n.task), None) if job else None
            workload = spec.workload_class if spec is not None else ""
            error = self._learner.error(workload, answer.device_model, site=site)
            if error != estimated.run_error:
                n.estimates[site] = copy_estimate(estimated, run_error=error)

    def _release(self, site: str, reservation_id: str) -> None:
        # Room another task of the negotiation may have been refused for: it goes to the
        # front of the line once the negotiation ends (``_negotiate``).
        self._outcomes.released()
        session = self._sites.session(site)
        if session is not None:
            with contextlib.suppress(SessionClosedError):
                session.send(
                    site_link_service_pb2.CoordinatorMessage(
                        release=site_link_service_pb2.Release(reservation_id=reservation_id)
                    )
                )

    async def _back_to_pending(self, negotiations: list[Negotiation]) -> None:
        results = await self._jobs.update_many(
            [(n.job_id, back_to_pending(n)) for n in negotiations]
        )
        for job_id, result in results.items():
            if isinstance(result, FederationError):
                log.warning("requeue_failed", job=job_id, error=str(result))

    def running(self) -> list[asyncio.Task[None]]:
        """Its negotiations under way (the loop cancels them when it closes)."""
        return list(self._tasks)


def _specs(job: jobs_pb2.Job) -> dict[str, jobs_pb2.TaskSpec]:
    return {t.name: t for t in job.spec.tasks}
