"""Room a part of the coordinator keeps for tasks beyond what their stored state says.

Each part that makes reservations keeps its own ``Reservations`` (the scheduler's negotiation
for tasks whose offers are out, a job's change for a running task that adds replicas) and only
that part keeps or lets go of them. The job repository counts them against their queues
(``JobRepository.counts``) and hears of every change through ``watch``.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from federation.common.keys import TaskKey
from federation.coordinator.policy.resources import Demand


class Reservations:
    """Per task (job id, task), what it counts as taking against its queue while it is kept."""

    def __init__(self) -> None:
        self._demands: dict[TaskKey, Demand] = {}
        self._watchers: list[Callable[[str], None]] = []

    def watch(self, changed: Callable[[str], None]) -> None:
        """``changed(job_id)`` after each change of a job's reservations."""
        self._watchers.append(changed)

    def keep(self, reservations: Iterable[tuple[TaskKey, Demand]]) -> None:
        """Keep (or replace) each task's reservation."""
        for key, demand in reservations:
            self._demands[key] = demand
            self._changed(key[0])

    def let_go(self, keys: Iterable[TaskKey]) -> None:
        """Undo ``keep``; a task not kept is ignored."""
        for key in keys:
            if self._demands.pop(key, None) is not None:
                self._changed(key[0])

    @property
    def demands(self) -> Mapping[TaskKey, Demand]:
        """What each kept task counts as taking (read it, never change it)."""
        return self._demands

    def __contains__(self, key: object) -> bool:
        return key in self._demands

    def __iter__(self) -> Iterator[TaskKey]:
        return iter(self._demands)

    def __len__(self) -> int:
        return len(self._demands)

    def _changed(self, job_id: str) -> None:
        for changed in self._watchers:
            changed(job_id)


def merged(kept: Sequence[Reservations]) -> Mapping[TaskKey, Demand]:
    """What the tasks of ``kept`` count as, the first that keeps a task deciding for it."""
    holding = [r._demands for r in kept if r._demands]
    return holding[0] if len(holding) == 1 else ChainMap(*holding) if holding else {}
