"""Waiting for a busy site: which tasks chose to, what each was promised, and the forecasts
of when room frees at each site (``scheduling.waits`` does the arithmetic)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from federation.api.v1 import admin_service_pb2
from federation.common.keys import TaskKey
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.scheduling.config import WAIT_RECHECK_S, WAIT_SLACK_S
from federation.coordinator.scheduling.cycle_state import Cycle, Placement
from federation.coordinator.scheduling.forecast import SiteHistory
from federation.coordinator.scheduling.waits import (
    Wait,
    Waiter,
    occupants,
    predictable,
    sooner_by_waiting,
    wait_at,
)
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot


class Waiting:
    """The tasks that wait for a busy site, per site in the order they chose to."""

    def __init__(self, jobs: JobRepository, wait_gain: float) -> None:
        self._jobs = jobs
        self._wait_gain = wait_gain
        self._waiting: dict[str, dict[TaskKey, Waiter]] = {}
        """Per busy site, the tasks that chose to wait for it, in the order they chose."""
        self._waits_for: dict[TaskKey, str] = {}
        self._promised: dict[TaskKey, float] = {}
        """Per task that waited for a busy site: by when (monotonic) it was to start there,
        slack included (``within_promise``)."""
        self.history = SiteHistory()
        """How often tasks come to each site and how long they run there."""

    def __contains__(self, key: object) -> bool:
        """Whether the task waits for a busy site now."""
        return key in self._waits_for

    def at(self, sites: Iterable[str]) -> list[TaskKey]:
        """The tasks waiting for any of ``sites``."""
        wanted = set(sites)
        return [key for key, site in self._waits_for.items() if site in wanted]

    def sooner(
        self, request: Request, placement: Placement, ranked: Sequence[str], cycle: Cycle
    ) -> Wait | None:
        """A busy site where the task would finish sooner by waiting (``waits``) than at
        ``ranked[0]``, or None."""
        _, _, estimates, busy, _ = placement
        if cycle.snapshot is None:
            return None
        now = time.time()
        if cycle.occupants is None:
            cycle.occupants = occupants(self._jobs.at_site(), now)
        return sooner_by_waiting(
            request,
            cycle.snapshot,
            busy,
            estimates[ranked[0]].total_s,
            cycle.occupants,
            self._waiters(),
            now,
            self._wait_gain,
        )

    def within_promise(self, key: TaskKey, wait: Wait) -> bool:
        """Whether the task may (still) wait: not yet past the start its first wait promised,
        and the slack. Past it, the task goes where it can start now."""
        now = time.monotonic()
        promised = self._promised.setdefault(
            key, now + wait.wait_s + max(WAIT_SLACK_S, wait.wait_s / 4)
        )
        return now <= promised

    def wait_for(self, key: TaskKey, wait: Wait) -> float:
        """The task waits for ``wait.site``; returns how long until it is weighed again (a
        task's end there wakes it sooner), should what runs there overrun."""
        self._waiting.setdefault(wait.site, {})[key] = wait.waiter
        self._waits_for[key] = wait.site
        return min(wait.wait_s + 1.0, WAIT_RECHECK_S)

    def forecasts(self, sites: Iterable[str]) -> dict[str, admin_service_pb2.SiteForecast]:
        """Per site: when room should next free there, what waits for it, and its history."""
        now = time.time()
        waiting = {site: len(line) for site, line in self._waiting.items()}
        return self.history.forecasts(sites, occupants(self._jobs.at_site(), now), waiting, now)

    def predicted(
        self, key: TaskKey, request: Request, snapshot: Snapshot, busy: list[int]
    ) -> dict[str, Wait]:
        """For ``explain``: when task ``key`` would start and finish at each busy site."""
        if not busy or not predictable(request):
            return {}
        now = time.time()
        holding = occupants(self._jobs.at_site(), now)
        waiting = self._waiters(but=key)
        found = (wait_at(request, snapshot, i, holding, waiting, now) for i in busy)
        return {wait.site: wait for wait in found if wait is not None}

    def _waiters(self, but: TaskKey | None = None) -> dict[str, list[Waiter]]:
        """Per busy site, the tasks waiting for it in the order they chose to (but ``but``)."""
        return {
            site: [waiter for key, waiter in line.items() if key != but]
            for site, line in self._waiting.items()
        }

    def stop_waiting(self, key: TaskKey) -> None:
        site = self._waits_for.pop(key, None)
        if site is not None:
            line = self._waiting[site]
            line.pop(key, None)
            if not line:
                del self._waiting[site]

    def forget(self, key: TaskKey) -> None:
        self._promised.pop(key, None)
        self.stop_waiting(key)
