"""Why a job's tasks are where they are, or wait: every site with the filters that reject
it or its score by term, the estimates, the waits predicted at busy sites, and what holds a
waiting task back beside placement (``fedctl jobs explain``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.common.keys import TaskKey
from federation.coordinator.data.staged_inputs import Registered, with_copies
from federation.coordinator.jobs import retries
from federation.coordinator.policy.sharing import Sharing, task_demand
from federation.coordinator.scheduling.config import (
    INPUTS,
    OWNER_SHARE,
    PREEMPT,
    QUOTA,
    RETRY,
    SPREAD,
)
from federation.coordinator.scheduling.placing import Placing
from federation.coordinator.scheduling.task_requests import (
    estimate_proto,
    once_free,
    request_for,
    waiting_on,
)
from federation.coordinator.scheduling.waits import Wait
from federation.coordinator.sites.registry import SiteRegistry
from federation.placement.estimates import estimate
from federation.placement.framework import Rejection
from federation.placement.plugins.near_region import NearRegion, describe
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot

PredictedWaits = Callable[[TaskKey, Request, Snapshot, list[int]], dict[str, Wait]]
"""When a task would start and finish at each busy site (``Waiting.predicted``)."""


class Explainer:
    """Explains jobs as the scheduling cycle would place them now."""

    def __init__(
        self,
        sites: SiteRegistry,
        placing: Placing,
        sharing: Sharing,
        predicted_waits: PredictedWaits,
        datasets: Registered | None,
    ) -> None:
        self._sites = sites
        self._placing = placing
        self._sharing = sharing
        self._predicted_waits = predicted_waits
        self._datasets = datasets

    def explain(self, job: jobs_pb2.Job) -> list[jobs_pb2.TaskExplanation]:
        """For each task: every site, with every filter that rejects it (each with its code)
        or its score by term; and placement's estimate at its site against the committed one."""
        snapshot = self._sites.snapshot()
        return [self._task(job, task, snapshot) for task in job.tasks]

    def _task(
        self, job: jobs_pb2.Job, task: jobs_pb2.TaskStatus, snapshot: Snapshot
    ) -> jobs_pb2.TaskExplanation:
        explanation = jobs_pb2.TaskExplanation(task=task.name, state=task.state, site=task.site)
        request = with_copies(
            request_for(job, task.name),
            job.spec.tenant,
            self._datasets,
            self._sites.connected,
        )
        if request is None:
            waiting = waiting_on(job, task.name)
            explanation.note = f"waits for task(s) {', '.join(waiting)} to succeed"
            return explanation
        if job_state.is_terminal(task.state):
            explanation.note = f"ended {jobs_pb2.JobState.Name(task.state)}: {task.reason}"
        elif task.state in job_state.AT_SITE:
            explanation.note = "placed; the scores below are for the federation as it is now"
        request = self._placing.with_learned_speeds(request)  # as the scheduler ranks it
        decision = self._placing.framework.place(request, snapshot)
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
                estimate=once_free(now, waits.get(site)),
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
        return explanation

    def _near_region_note(self, request: Request, snapshot: Snapshot, ranked: Sequence[str]) -> str:
        """The RTT to its region each ranked site was ranked by (explain only); a profile
        without NearRegion ranks by none."""
        region = request.near_region
        scorers = self._placing.framework.scorers
        if not any(s.name == NearRegion.name and w > 0 for s, w in scorers):
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
