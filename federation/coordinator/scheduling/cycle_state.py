"""What one scheduling cycle builds as it goes, and what a placement of a task is: the state
the cycle's parts pass one another."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from federation.api.v1 import jobs_pb2
from federation.coordinator.policy.sharing import Tentative
from federation.coordinator.scheduling.waits import Occupant
from federation.placement.framework import Code
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot

Placement = tuple[
    tuple[jobs_pb2.SiteVerdict, ...],
    tuple[str, ...],
    dict[str, jobs_pb2.Estimate],
    tuple[int, ...],
    bool,
]
"""Verdicts, the sites to try (best first), their estimates, the sites short only of room
(snapshot indices) that a wait may choose, and whether every site refused for what room that
comes free cannot change (``UNFIT``)."""
UNFIT = frozenset(
    {
        Code.DOMAIN_NOT_ALLOWED,
        Code.REGION_NOT_ALLOWED,
        Code.SITE_NOT_ALLOWED,
        Code.NO_DEVICE_OF_MODEL,
        Code.INSUFFICIENT_DEVICE_MEMORY,
        Code.DEVICE_SELECTOR_UNMATCHED,
        Code.NODE_LABELS_UNMATCHED,
    }
)
"""Reasons a site refuses a task that no task ending there changes: the task's own bounds, or
hardware the site does not have. A task every site refuses so is not woken when room comes
free (``Line.clear_front``), only by its retry timer: a backlog of such tasks at the front
of the line would otherwise be placed again at every task's end, and keep the room from the
tasks behind them."""


@dataclass(slots=True)
class Cycle:
    """What one scheduling cycle builds as it goes."""

    tentative: Tentative = field(default_factory=dict)
    """What it admitted against queues' quotas, not yet held by a negotiation."""
    snapshot: Snapshot | None = None
    placements: dict[Request, Placement] = field(default_factory=dict)
    occupants: dict[str, list[Occupant]] | None = None
    """What the tasks at each site hold and until when, gathered once a wait is weighed."""
    guests: dict[str, dict[str, float]] | None = None
    """Per site that keeps an owner share, what other tenants' tasks hold there (with what
    this cycle sent there), gathered once a task of another tenant may go there."""
    devices_left: dict[str, dict[str, float]] | None = None
    """Per site, its free whole devices by kind less those this cycle's offers were sent for,
    gathered once a task that needs whole devices is offered (``with_devices_left``)."""
    deferred: list[Callable[[], None]] | None = None
    """While a gang's parts are considered: the preemptions they would start, started only
    when every part has a site or room coming (``Scheduler._consider_gang``: all or nothing)."""

    def now_or_with_gang(self, start: Callable[[], None]) -> None:
        """Start a preemption now, or, while a gang's parts are considered, once every part
        has a site or room coming (``deferred``)."""
        if self.deferred is None:
            start()
        else:
            self.deferred.append(start)
