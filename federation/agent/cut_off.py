"""The agent's watch on its contact with the coordinators, for ``disconnect.stop_after_s``.

Coordinators answer every heartbeat, so an agent in touch hears from one at least once a
heartbeat interval. The watch counts from the last message the agent handled, not from when a
broken stream was noticed: a silent partition is noticed late, and the copy would run on. Once
the silence is long enough the core stops the tasks whose jobs ask for at most one copy
(``stop_after``); the coordinator waits for them to be gone before it places them elsewhere.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from federation.agent.core import LocalCore
from federation.stop_after import IN_TOUCH_HEARTBEATS, WATCHDOG_S

log = structlog.get_logger()


class CutOffWatch:
    """Asks ``core`` every ``tick_s`` to stop what must not outlive the agent's silence.

    Args:
        core: The site's core (``LocalCore.stop_cut_off``).
        tick_s: Time between two looks; the coordinator's margin counts ``WATCHDOG_S``.
        clock: Monotonic clock (tests pass their own).
    """

    def __init__(
        self,
        core: LocalCore,
        *,
        tick_s: float = WATCHDOG_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._core = core
        self._tick_s = tick_s
        self._clock = clock
        self._heard_at: float | None = None
        self._heartbeat_s = 0.0
        self._stopping: set[asyncio.Task[None]] = set()

    def heard(self, heartbeat_s: float) -> None:
        """A coordinator message was handled just now; ``heartbeat_s``: the interval at which
        the coordinator answers heartbeats (its welcome said)."""
        self._heard_at = self._clock()
        self._heartbeat_s = heartbeat_s

    def cut_off_s(self) -> float:
        """Seconds since the agent last heard from a coordinator, once that silence is longer
        than ``IN_TOUCH_HEARTBEATS`` heartbeat intervals; 0 while in touch, and until it first
        was."""
        if self._heard_at is None:
            return 0.0
        silent_s = self._clock() - self._heard_at
        return silent_s if silent_s >= IN_TOUCH_HEARTBEATS * self._heartbeat_s else 0.0

    async def run(self) -> None:
        """Look every ``tick_s`` until cancelled. A stop runs on its own, so one task's grace
        does not hold up the next look (another task may be due meanwhile)."""
        try:
            while True:
                await asyncio.sleep(self._tick_s)
                if (cut_off_s := self.cut_off_s()) > 0:
                    stopping = asyncio.create_task(self._core.stop_cut_off(cut_off_s))
                    self._stopping.add(stopping)
                    stopping.add_done_callback(self._stopped)
        finally:
            for stopping in list(self._stopping):
                stopping.cancel()

    def _stopped(self, stopping: asyncio.Task[None]) -> None:
        self._stopping.discard(stopping)
        if not stopping.cancelled() and (error := stopping.exception()) is not None:
            log.error("cut_off_stop_failed", exc_info=error)
