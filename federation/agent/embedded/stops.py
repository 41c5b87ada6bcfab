"""Stopping tasks: a coordinator's cancel, the stops of a site cut off from every
coordinator (``federation.stop_after``), and those of an elastic node its provider took back.
Each asks the task's supervisor to stop it; the task ends CANCELLED."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from federation.agent.embedded.reservations import Reservations
from federation.agent.embedded.task import Task
from federation.common.keys import RunKey
from federation.stop_after import STOP_GRACE_S, announce_stop

log = structlog.get_logger()


class Stops:
    """Stops the core's tasks for the coordinator's sake or the site's own.

    Args:
        reservations: The reservations a stop drops with its tasks.
        tasks: The tasks by key.
        kill_grace_s: Time between SIGTERM and SIGKILL when a task is stopped.
        changed: Called when a stop drops reservations.
    """

    def __init__(
        self,
        reservations: Reservations,
        tasks: dict[RunKey, Task],
        kill_grace_s: float,
        changed: Callable[[], None],
    ) -> None:
        self._reservations = reservations
        self._tasks = tasks
        self._kill_grace_s = kill_grace_s
        self._changed = changed

    async def cancel(self, job_id: str, task: str, epoch: int, reason: str) -> None:
        """Stops the task and waits until it has ended CANCELLED.

        Epoch 0 means any epoch; an unknown, finished or other-epoch task is left alone. A
        reservation for the task is dropped too, so it can no longer be committed.
        """

        def targeted(key: RunKey) -> bool:
            return key[:2] == (job_id, task) and epoch in (0, key[2])

        dropped = [r.id for r in self._reservations if targeted(r.key)]
        for reservation_id in dropped:
            self._reservations.drop(reservation_id)
        if dropped:
            self._changed()
        victims = [t for key, t in self._tasks.items() if targeted(key) and t.active]
        if not victims and not dropped:
            log.debug("cancel_ignored", job_id=job_id, task=task, epoch=epoch)
        for victim in victims:
            victim.drain_first = True
        await self.stop(victims, reason, self._kill_grace_s)

    async def stop_cut_off(self, cut_off_s: float) -> None:
        """Stops every task whose job asks for it after ``cut_off_s`` seconds cut off from every
        coordinator, and waits until they have ended CANCELLED, reported interrupted: the
        coordinator places them elsewhere once they are surely gone (``stop_after``)."""
        victims = [
            t
            for t in self._tasks.values()
            if t.active and t.cancel_reason is None and 0 < t.stop_after_s <= cut_off_s
        ]
        for victim in victims:
            victim.interrupted = True
            victim.cancel_reason = announce_stop(victim.key, cut_off_s, victim.stop_after_s)
            victim.grace_s = min(self._kill_grace_s, STOP_GRACE_S)
            victim.cancelled.set()
        await asyncio.gather(*(victim.finished.wait() for victim in victims))

    def node_taken_back(self, node: str, why: str) -> None:
        """An elastic node its provider lost (a spot node taken back), launchable again: the
        tasks on it stop and are reported interrupted, so the coordinator places them again
        (from their newest checkpoints) as capacity lost; reservations there are dropped."""
        for reservation in self._reservations:
            if any(slot.node == node for slot in reservation.slots):
                self._reservations.drop(reservation.id)
        victims = [
            t
            for t in self._tasks.values()
            if t.active and t.cancel_reason is None and any(s.node == node for s in t.slots)
        ]
        for victim in victims:
            victim.interrupted = True
            victim.cancel_reason = f"node {node} was taken back by its provider: {why}"
            victim.grace_s = min(self._kill_grace_s, STOP_GRACE_S)
            victim.cancelled.set()
        self._changed()

    async def stop(self, victims: list[Task], reason: str, grace_s: float) -> None:
        """Asks each task's supervisor to stop it and waits until all have ended."""
        for victim in victims:
            victim.cancel_reason, victim.grace_s = reason, grace_s
            victim.cancelled.set()
        await asyncio.gather(*(victim.finished.wait() for victim in victims))
