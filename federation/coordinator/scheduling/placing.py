"""Placing a task: the placement framework's call, its decisions kept while the snapshot
stands, estimates with learned speeds, and users' selectors evaluated off the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import structlog

from federation.api.v1 import jobs_pb2
from federation.coordinator.scheduling.config import MAX_REMEMBERED_PLACEMENTS
from federation.coordinator.scheduling.cycle_state import UNFIT, Placement
from federation.coordinator.scheduling.learning import SpeedLearner
from federation.coordinator.scheduling.task_requests import estimate_proto
from federation.coordinator.scheduling.waits import predictable
from federation.placement.estimates import estimate
from federation.placement.framework import Decision, Framework
from federation.placement.request import Request
from federation.placement.selectors import VERDICTS, selector_matches
from federation.placement.snapshot import Snapshot

log = structlog.get_logger()


class Placing:
    """Places requests on snapshots, remembering what it placed on the current one."""

    def __init__(
        self,
        framework: Framework,
        learner: SpeedLearner,
        max_offers: int,
        wait_gain: float,
        wake: Callable[[], None],
    ) -> None:
        self.framework = framework
        self._learner = learner
        self._max_offers = max_offers
        self._wait_gain = wait_gain
        self._wake = wake
        self._placed_on: Snapshot | None = None
        self._placements: dict[Request, Placement] = {}
        self._selectors_evaluating: set[str] = set()
        """Selectors whose verdicts on some device class are being found (in a thread)."""
        self._tasks: set[asyncio.Task[None]] = set()

    def with_learned_speeds(self, request: Request) -> Request:
        """``request`` estimated with learned speeds where the task sets none of its own."""
        speeds = self._learner.overrides(request.workload_class, dict(request.speed))
        if speeds == dict(request.speed):
            return request
        return dataclasses.replace(request, speed=tuple(sorted(speeds.items())))

    def placements_on(self, snapshot: Snapshot) -> dict[Request, Placement]:
        """Placements already made on ``snapshot``, by request: placement depends on nothing
        else, and while no view changes (the snapshot is the same object) a cycle that finds
        a request it has seen need not place it again."""
        if snapshot is not self._placed_on or len(self._placements) > MAX_REMEMBERED_PLACEMENTS:
            self._placed_on = snapshot
            self._placements = {}
        return self._placements

    def place(self, request: Request, snapshot: Snapshot) -> Placement:
        """Placement's verdicts, the sites to try (best first) and their estimates."""
        decision = self.framework.place(request, snapshot)
        verdicts = tuple(
            jobs_pb2.SiteVerdict(site=r.site, stage=r.plugin, reason=r.reason, code=r.code)
            for r in decision.rejections  # the first per site: job records stay small
        )
        ranked = decision.ranked[: self._max_offers]
        if not ranked:
            unfit = bool(verdicts) and all(v.code in UNFIT for v in verdicts)
            return verdicts, (), {}, (), unfit
        estimates = estimate(request, snapshot)
        by_site = {
            site: estimate_proto(estimates, snapshot.site_index(site) or 0) for site in ranked
        }
        busy = busy_sites(decision, request, self._wait_gain)
        return verdicts, ranked, by_site, busy, False

    def selector_unevaluated(self, source: str, snapshot: Snapshot) -> bool:
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
            self._wake()

    async def evaluate_selectors(self, job: jobs_pb2.Job, snapshot: Snapshot) -> None:
        """Find the verdicts of the job's selectors on every device class of ``snapshot``, in
        a thread, so that ``explain`` does not evaluate them on the event loop."""
        attribute_sets = [c.attributes for c in snapshot.classes]
        for task in job.spec.tasks:
            if source := task.resources.accelerator.selector:
                await asyncio.to_thread(selector_matches, source, attribute_sets)

    def running(self) -> list[asyncio.Task[None]]:
        """Its selector evaluations under way (the loop cancels them when it closes)."""
        return list(self._tasks)


def busy_sites(decision: Decision, request: Request, wait_gain: float) -> tuple[int, ...]:
    """The sites a task may wait for (``waits``): those only short of room now. Only for
    tasks a wait can be predicted for: finding them reads every site's shortfall, which most
    placements never need."""
    if wait_gain <= 0 or not predictable(request):
        return ()
    return tuple(decision.short_of_room().tolist())
