"""The lines of tasks waiting for busy sites, and what each wait promised: bookkeeping with
the clock passed in, kept by the coordinator (``waiting.Waiting``) and the simulator alike."""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Generic, TypeVar

from federation.coordinator.scheduling.config import WAIT_RECHECK_S, WAIT_SLACK_S
from federation.coordinator.scheduling.waits import Wait, Waiter

K = TypeVar("K", bound=Hashable)


def recheck_in(wait: Wait) -> float:
    """How long until a task that waits for a busy site is weighed again, should what runs
    there overrun (a task's end there wakes it sooner)."""
    return min(wait.wait_s + 1.0, WAIT_RECHECK_S)


def promised_by(wait: Wait, now: float) -> float:
    """By when a task that starts waiting now for ``wait`` should start: its wait and the
    slack (``WAIT_SLACK_S``, or a quarter of the wait if longer)."""
    return now + wait.wait_s + max(WAIT_SLACK_S, wait.wait_s / 4)


class WaitLines(Generic[K]):
    """Per busy site, the tasks that chose to wait for it (keys ``K``) in the order they
    chose; and per task that waited, by when its first wait promised it would start."""

    def __init__(self) -> None:
        self._waiting: dict[str, dict[K, Waiter]] = {}
        self._waits_for: dict[K, str] = {}
        self._promised: dict[K, float] = {}

    def __contains__(self, key: object) -> bool:
        """Whether the task waits for a busy site now."""
        return key in self._waits_for

    def at(self, sites: Iterable[str]) -> list[K]:
        """The tasks waiting for any of ``sites``, in the order they chose to."""
        wanted = set(sites)
        return [key for key, site in self._waits_for.items() if site in wanted]

    def lengths(self) -> dict[str, int]:
        """Per busy site, how many tasks wait for it."""
        return {site: len(line) for site, line in self._waiting.items()}

    def waiters(self, but: K | None = None) -> dict[str, list[Waiter]]:
        """Per busy site, the tasks waiting for it in the order they chose to (but ``but``)."""
        return {
            site: [waiter for key, waiter in line.items() if key != but]
            for site, line in self._waiting.items()
        }

    def within_promise(self, key: K, wait: Wait, now: float) -> bool:
        """Whether the task may (still) wait: not yet past the start its first wait promised
        (``promised_by``), on the clock ``now`` is read from. Past it, the task goes where it
        can start now."""
        return now <= self._promised.setdefault(key, promised_by(wait, now))

    def wait_for(self, key: K, wait: Wait) -> float:
        """The task waits for ``wait.site``; returns how long until it is weighed again."""
        self._waiting.setdefault(wait.site, {})[key] = wait.waiter
        self._waits_for[key] = wait.site
        return recheck_in(wait)

    def stop_waiting(self, key: K) -> None:
        site = self._waits_for.pop(key, None)
        if site is not None:
            line = self._waiting[site]
            line.pop(key, None)
            if not line:
                del self._waiting[site]

    def forget(self, key: K) -> None:
        self._promised.pop(key, None)
        self.stop_waiting(key)
