"""In-process fan-out of job events to ``WatchJobs`` streams."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from federation.api.v1 import jobs_pb2
from federation.errors import FederationError, ResourceExhaustedError
from federation.jobspec import state_name

log = structlog.get_logger()

JobFilter = Callable[[jobs_pb2.Job], bool]
LIFECYCLE = frozenset(
    {
        jobs_pb2.JOB_STATE_DELEGATED,
        jobs_pb2.JOB_STATE_RUNNING,
        jobs_pb2.JOB_STATE_SUCCEEDED,
        jobs_pb2.JOB_STATE_FAILED,
        jobs_pb2.JOB_STATE_CANCELLED,
    }
)
"""Events logged at info besides a job's first (its submission): the coordinator's log tells
each job's path without a watch."""
WATCH_BATCH = 512
"""Events per WatchJobs message at most."""


class WatchOverflowError(ResourceExhaustedError):
    """A watcher fell too far behind and was dropped."""

    reason = "WATCH_OVERFLOW"


@dataclass(eq=False)
class Subscription:
    """One watcher: a bounded queue of events and which jobs it may see."""

    accepts: JobFilter
    queue: asyncio.Queue[jobs_pb2.JobEvent | None] = field(
        default_factory=lambda: asyncio.Queue(maxsize=10_000)
    )
    overflowed: bool = False
    ended: FederationError | None = None
    """Why the hub was closed under this watcher, if it was."""
    end_reached: bool = False
    """The end marker was taken from the queue: every later read raises."""

    async def next(self) -> jobs_pb2.JobEvent:
        """The next event; raises ``WatchOverflowError`` once the watcher was dropped.

        Raises:
            WatchOverflowError: The watcher fell behind and was dropped.
            FederationError: The hub was closed (``ended``), e.g. on stepping down.
        """
        event = None if self.end_reached else await self.queue.get()
        if event is None:
            self.end_reached = True
            if self.ended is not None:
                raise self.ended
            raise WatchOverflowError("watch fell behind; watch again with include_current")
        return event

    async def next_batch(self, limit: int = WATCH_BATCH) -> list[jobs_pb2.JobEvent]:
        """The next event and up to ``limit`` - 1 more already queued, in order. Raises as
        ``next`` does, after the events queued before the end were handed out."""
        batch = [await self.next()]
        while len(batch) < limit and not self.queue.empty():
            event = self.queue.get_nowait()
            if event is None:
                self.end_reached = True  # the next call raises
                break
            batch.append(event)
        return batch


class EventHub:
    """Delivers each committed job event to every subscription that may see the job."""

    def __init__(self) -> None:
        self._subscriptions: set[Subscription] = set()
        self._followers: dict[str, set[asyncio.Event]] = {}
        """Per job: set whenever the job is written, events or not (``follow``)."""
        self.closed: FederationError | None = None

    def follow(self, job_id: str) -> asyncio.Event:
        """An event set each time the job is written, even without a job event (a
        service's endpoints); the caller clears it, and ``unfollow``s when done."""
        changed = asyncio.Event()
        self._followers.setdefault(job_id, set()).add(changed)
        return changed

    def unfollow(self, job_id: str, changed: asyncio.Event) -> None:
        followers = self._followers.get(job_id)
        if followers is not None:
            followers.discard(changed)
            if not followers:
                del self._followers[job_id]

    def subscribe(self, accepts: JobFilter) -> Subscription:
        sub = Subscription(accepts)
        self._subscriptions.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscriptions.discard(sub)

    def publish(self, job: jobs_pb2.Job, events: list[jobs_pb2.JobEvent]) -> None:
        """Called after the events are durable, never before."""
        for event in events:
            if event.state in LIFECYCLE or event.sequence == 1:
                log.info(
                    "job_event",
                    job_id=event.job_id,
                    task=event.task,
                    state=state_name(event.state),
                    job_state=state_name(event.job_state),
                    site=event.site,
                    reason=event.reason[:200],
                )
        for changed in self._followers.get(job.id, ()):
            changed.set()
        for sub in list(self._subscriptions):
            if sub.overflowed or not sub.accepts(job):
                continue
            for event in events:
                if sub.queue.qsize() >= sub.queue.maxsize - 1:
                    # Keep one slot for the end marker so the watcher learns it was dropped.
                    sub.overflowed = True
                    sub.queue.put_nowait(None)
                    self._subscriptions.discard(sub)
                    break
                sub.queue.put_nowait(event)

    def close(self, reason: FederationError) -> None:
        """End every watcher with ``reason`` once it has read what it was already sent."""
        self.closed = reason
        for followers in self._followers.values():
            for changed in followers:
                changed.set()
        for sub in self._subscriptions:
            sub.ended = reason
            with contextlib.suppress(asyncio.QueueFull):  # publish keeps a slot free for this
                sub.queue.put_nowait(None)
        self._subscriptions.clear()
