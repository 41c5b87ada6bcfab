"""Watchers read their events in batches of those already queued, and learn when they end."""

from __future__ import annotations

import pytest

from federation.api.v1 import jobs_pb2
from federation.coordinator.jobs.events import EventHub, WatchOverflowError
from federation.errors import UnavailableError


def _events(job_id: str, count: int) -> list[jobs_pb2.JobEvent]:
    return [jobs_pb2.JobEvent(job_id=job_id, sequence=i + 1) for i in range(count)]


async def test_batch_takes_what_is_queued_in_order_up_to_the_limit() -> None:
    """next_batch returns the queued events in order, at most ``limit`` at a time."""
    hub = EventHub()
    sub = hub.subscribe(lambda job: True)
    hub.publish(jobs_pb2.Job(id="a"), _events("a", 5))
    first = await sub.next_batch(limit=3)
    second = await sub.next_batch(limit=3)
    assert [e.sequence for e in first] == [1, 2, 3]
    assert [e.sequence for e in second] == [4, 5]


async def test_events_before_the_end_are_delivered_then_the_reason_is_raised() -> None:
    """A closed hub still hands out what it had queued; the next read raises its reason."""
    hub = EventHub()
    sub = hub.subscribe(lambda job: True)
    hub.publish(jobs_pb2.Job(id="a"), _events("a", 2))
    hub.close(UnavailableError("stepped down"))
    assert [e.sequence for e in await sub.next_batch()] == [1, 2]
    with pytest.raises(UnavailableError, match="stepped down"):
        await sub.next_batch()
    with pytest.raises(UnavailableError):
        await sub.next()


async def test_a_watcher_that_falls_behind_is_dropped() -> None:
    """Past its queue bound a watcher gets what fitted, then WatchOverflowError."""
    hub = EventHub()
    sub = hub.subscribe(lambda job: True)
    bound = sub.queue.maxsize
    hub.publish(jobs_pb2.Job(id="a"), _events("a", bound + 10))
    delivered = []
    while len(delivered) < bound - 1:
        delivered += await sub.next_batch()
    assert [e.sequence for e in delivered] == list(range(1, bound))
    with pytest.raises(WatchOverflowError):
        await sub.next_batch()
