"""Tasks stopped to make room for another stay away from that room until the other runs.

When a task waiting for room stops tasks at a site, the first of them to stop frees room that
the waiting task may not fit in yet (it waits for the others). Placed again at once, a stopped
task would take that room back; and at a site with a scheduler of its own (Slurm), a stopped
task placed there again beside the waiting one may be started first, by that scheduler's order
rather than the federation's. Either way the stop was for nothing. So a stopped task is not
placed at the site it was stopped at until the task it was stopped for has started there,
gone elsewhere or ended; other sites may take it at once. Kept in memory by the leader: a new
leader's first placements may not hold it back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.common.keys import TaskKey

StatusOf = Callable[[TaskKey], jobs_pb2.TaskStatus | None]
"""The task's status now; None once its job is no longer cached (it ended)."""
KEPT_REASON = "waits until the work it was stopped for starts here"


class StoppedFor:
    """Per stopped task, the site it was stopped at and the task it was stopped for.

    Args:
        status_of: Reads a task's status now.
        is_waiting: Whether a task is still waiting for the room it stopped others for.
    """

    def __init__(self, status_of: StatusOf, is_waiting: Callable[[TaskKey], bool]) -> None:
        self._status_of = status_of
        self._is_waiting = is_waiting
        self._for: dict[TaskKey, tuple[str, TaskKey]] = {}

    def stopped(self, site: str, waiting: TaskKey, victims: Iterable[tuple[str, str, int]]) -> None:
        """``victims`` (job, task, epoch) are being stopped at ``site`` for ``waiting``.

        Entries whose waiting task has started, gone or ended are dropped first: a victim
        that never waits again (its job was cancelled) is not kept for ever."""
        self._for = {k: v for k, v in self._for.items() if self._still_coming(*v)}
        for job_id, task, _ in victims:
            self._for[(job_id, task)] = (site, waiting)

    def room_kept(self, key: TaskKey, sites: Sequence[str]) -> tuple[list[str], list[str]]:
        """Of ``sites``, those ``key`` may be offered to now, and those it may not (yet)."""
        entry = self._for.get(key)
        if entry is None:
            return list(sites), []
        site, waiting = entry
        if not self._still_coming(site, waiting):
            del self._for[key]
            return list(sites), []
        return [s for s in sites if s != site], [s for s in sites if s == site]

    def _still_coming(self, site: str, waiting: TaskKey) -> bool:
        """Whether the task stopped for still waits for ``site``'s room, or is delegated there
        and has not started."""
        status = self._status_of(waiting)
        if status is None:
            return False
        if status.state == job_state.DELEGATED:
            return status.site == site
        return status.state == job_state.PENDING and self._is_waiting(waiting)

    def forget(self, key: TaskKey) -> None:
        """The task no longer waits to be placed (placed, cancelled or ended)."""
        self._for.pop(key, None)
