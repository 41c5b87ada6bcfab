"""The scheduling cycle's settings and the stage names of its verdicts."""

from __future__ import annotations

from dataclasses import dataclass

from federation.coordinator.scheduling.waits import WAIT_GAIN
from federation.resources import KINDS

NEGOTIATE = "Negotiate"
QUOTA = "Quota"
"""The stage of a verdict that holds a task back for its queue's quota, at every site."""
OWNER_SHARE = "OwnerShare"
SPREAD = "Spread"
GANG = "Gang"
"""The stage of a gang part's verdict when another part of its gang has no site."""
PREEMPT = "Preempt"
"""The stage of the verdict naming the tasks stopped to make room for a waiting one."""
RECLAIMED = "a queue taking back the nominal quota it lent"
"""Why a task on borrowed quota was stopped (naming no other job or queue)."""
WAIT = "Wait"
"""The stage of the verdict of a task that waits for a busy site (``waits``)."""
RETRY = "Retry"
"""The stage of what holds back a failed task waiting out its backoff (explain only)."""
INPUTS = "Inputs"
"""The stage of the verdict of a task whose inputs are held by a site not connected now."""
WAIT_RECHECK_S = 30.0
"""Longest a task waits for a busy site before its choice is weighed again; a task's end
there wakes it sooner."""
WAIT_SLACK_S = 5.0
"""A task waits for a busy site at most this long past the start its first wait promised
(or a quarter of that wait, if longer): what runs there may overrun its estimate for ever,
and each recheck would promise "any moment now" again."""
FRONT_OF_LINE = 64
"""Waiting jobs whose retry timers a task's end clears (``capacity_freed``)."""
QUEUE_GAUGES_EVERY_S = 5.0
"""How often the scheduling loop refreshes the queues' gauges (listing queues does too)."""
TIMER_PACE = 20
"""After a cycle, a retry timer alone starts the next one no sooner than this many times the
cycle's walk of the line later: a backlog whose timers come due one after another then costs
a walk now and then (at most 1/21 of the loop), not one walk after another."""
CHECKPOINT = "checkpoint:"
"""Placement input naming the newest checkpoint of a task that restarts from it."""
MAX_REMEMBERED_PLACEMENTS = 10_000
"""Distinct requests whose placement on the current snapshot is kept for later cycles."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    offer_timeout_s: float = 5.0
    """How long a site may take to answer an offer or a commit."""
    reservation_lease_s: float = 10.0
    """How long a site holds a reservation that no commit follows."""
    max_offers_per_round: int = 5
    """Sites tried, best first, before a task goes back to PENDING."""
    offers_at_once: int = 3
    """Sites offered a task at the same time once the best site has declined it; the best one
    that accepts gets the commit (see ``offer_rounds``)."""
    retry_interval_s: float = 5.0
    """Longest wait before pending tasks are tried again without any change."""
    unfit_retry_interval_s: float = 60.0
    """The same for tasks every site refused for what room coming free cannot change
    (``UNFIT``); each of their waits is cut by up to a fifth at random, to spread them."""
    max_concurrent_negotiations: int = 2048
    batch_window_s: float = 0.002
    """Shortest time between two scheduling cycles (see ``Scheduler.run``)."""
    preemption_min_run_s: float = 60.0
    """A task runs at least this long before it may be preempted, so work does not thrash."""
    reclaim_min_run_s: float = 120.0
    """A task on borrowed quota runs at least this long before its lender takes it back."""
    wait_gain: float = WAIT_GAIN
    """A task waits for a busy site where it would finish by this share of its finish on the
    best site free now (``waits``); 0: tasks never wait while some site can take them."""


DEVICE_KINDS = frozenset(KINDS.values())
