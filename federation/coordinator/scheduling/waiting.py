"""Waiting for a busy site: which tasks chose to, what each was promised, and the forecasts
of when room frees at each site (``scheduling.waits`` does the arithmetic)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from federation.api.v1 import admin_service_pb2
from federation.common.keys import TaskKey
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.scheduling.cycle_state import Cycle, Placement
from federation.coordinator.scheduling.forecast import SiteHistory
from federation.coordinator.scheduling.wait_lines import WaitLines
from federation.coordinator.scheduling.waits import (
    Wait,
    occupants,
    predictable,
    sooner_by_waiting,
    wait_at,
)
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot


class Waiting:
    """The tasks that wait for a busy site, per site in the order they chose to: the lines
    (``WaitLines``) on the coordinator's clocks, what runs at the sites read from the job
    records."""

    def __init__(self, jobs: JobRepository, wait_gain: float) -> None:
        self._jobs = jobs
        self._wait_gain = wait_gain
        self._lines: WaitLines[TaskKey] = WaitLines()
        """Per busy site, the tasks that chose to wait for it; per task that waited, by when
        (monotonic) it was to start there, slack included (``within_promise``)."""
        self.history = SiteHistory()
        """How often tasks come to each site and how long they run there."""

    def __contains__(self, key: object) -> bool:
        """Whether the task waits for a busy site now."""
        return key in self._lines

    def at(self, sites: Iterable[str]) -> list[TaskKey]:
        """The tasks waiting for any of ``sites``."""
        return self._lines.at(sites)

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
            self._lines.waiters(),
            now,
            self._wait_gain,
        )

    def within_promise(self, key: TaskKey, wait: Wait) -> bool:
        """Whether the task may (still) wait: not yet past the start its first wait promised,
        and the slack. Past it, the task goes where it can start now."""
        return self._lines.within_promise(key, wait, time.monotonic())

    def wait_for(self, key: TaskKey, wait: Wait) -> float:
        """The task waits for ``wait.site``; returns how long until it is weighed again (a
        task's end there wakes it sooner), should what runs there overrun."""
        return self._lines.wait_for(key, wait)

    def forecasts(self, sites: Iterable[str]) -> dict[str, admin_service_pb2.SiteForecast]:
        """Per site: when room should next free there, what waits for it, and its history."""
        now = time.time()
        waiting = self._lines.lengths()
        return self.history.forecasts(sites, occupants(self._jobs.at_site(), now), waiting, now)

    def predicted(
        self, key: TaskKey, request: Request, snapshot: Snapshot, busy: list[int]
    ) -> dict[str, Wait]:
        """For ``explain``: when task ``key`` would start and finish at each busy site."""
        if not busy or not predictable(request):
            return {}
        now = time.time()
        holding = occupants(self._jobs.at_site(), now)
        waiting = self._lines.waiters(but=key)
        found = (wait_at(request, snapshot, i, holding, waiting, now) for i in busy)
        return {wait.site: wait for wait in found if wait is not None}

    def stop_waiting(self, key: TaskKey) -> None:
        self._lines.stop_waiting(key)

    def forget(self, key: TaskKey) -> None:
        self._lines.forget(key)
