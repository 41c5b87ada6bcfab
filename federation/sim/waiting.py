"""Waiting for a busy site in the replay, by the coordinator's own rule and bookkeeping.

In policies that rank by estimated finish (``Profile.waits``), a task some site could take
now may instead wait for a busy site where it would finish sooner. The decision is the
coordinator's: the busy sites are placement's (``placing.busy_sites``), the finish to beat is
the best site's estimate, and ``waits.sooner_by_waiting`` plays out what the replay's sites
hold, each task there ending when the coordinator would expect it to from its record
(``waits.expected_end``: its start, or now and its input's transfer, plus its estimated
run). The tasks that chose to wait, and by when each was promised its start, are kept in the
coordinator's ``WaitLines``, on the simulated clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from federation.common import job_state
from federation.coordinator.scheduling.placing import busy_sites
from federation.coordinator.scheduling.wait_lines import WaitLines
from federation.coordinator.scheduling.waits import (
    Occupant,
    Wait,
    expected_end,
    sooner_by_waiting,
)
from federation.placement.estimates import estimate
from federation.placement.framework import Decision
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot
from federation.sim.runs import TaskRun

TOTAL, NO_TRANSFER = "total", "no-transfer"
"""How a policy weighs a wait (``Profile.waits``): with its input's transfer, or without."""


class BusySites:
    """The replay's tasks waiting for busy sites, and the coordinator's rule for whether a
    task should. ``at_site``: per site, the tasks it holds (the replay keeps it)."""

    def __init__(
        self,
        snap: Snapshot,
        runs: Sequence[TaskRun],
        at_site: Sequence[set[int]],
        waits: str,
        gain: float,
    ) -> None:
        if waits not in ("", TOTAL, NO_TRANSFER):
            raise ValueError(f"waits must be {TOTAL!r}, {NO_TRANSFER!r} or empty, got {waits!r}")
        self._snap = snap
        self._runs = runs
        self._at_site = at_site
        self._waits = waits
        self._gain = gain
        self.lines: WaitLines[int] = WaitLines()
        """Per busy site, the tasks (by number) that chose to wait for it."""

    def sooner(self, req: Request, decision: Decision, now: float) -> Wait | None:
        """A busy site where ``req`` would finish sooner by waiting than at the best site
        ``decision`` ranked (``waits.sooner_by_waiting``), or None; never in a policy that
        does not wait."""
        if not self._waits or not decision.ranked:
            return None
        busy = busy_sites(decision, req, self._gain)
        if not busy:
            return None
        snap = self._snap
        transfer = self._waits == TOTAL
        estimates = estimate(req, snap)
        best = snap.site_ids.index(decision.ranked[0])
        now_s = float(estimates.total_s[best])
        if not transfer:
            now_s -= float(estimates.transfer_s[best])
        holding = {snap.site_ids[site]: self.occupants(site, now) for site in busy}
        waiting = self.lines.waiters()
        return sooner_by_waiting(
            req, snap, busy, now_s, holding, waiting, now, self._gain, transfer=transfer
        )

    def occupants(self, site: int, now: float) -> list[Occupant]:
        """What the tasks at ``site`` hold and when each should end, the soonest first, as
        the coordinator reads them from its job records (``waits.occupants``)."""
        held = [self.occupant(self._runs[j], now) for j in sorted(self._at_site[site])]
        held.sort(key=lambda h: h.end)
        return held

    def occupant(self, run: TaskRun, now: float) -> Occupant:
        """What ``run`` holds at its site, per replica, and when it should end: by the run
        time the scheduler expected on the devices it got and its input's transfer, as a
        committed estimate states them."""
        grant = run.grant
        assert grant is not None
        started = run.started_s if run.state == job_state.RUNNING else None
        snap = self._snap
        return Occupant(
            end=expected_end(run.estimated_run_s, run.transfer_s, started, now),
            nodes=tuple(snap.node_names[n] for n in grant.nodes),
            cpu=grant.cpu,
            memory_mib=grant.memory_mib,
            devices=run.request.accelerator_count,
            model=str(snap.device_model[grant.devices[0]]) if grant.devices else "",
        )
