"""Reading a ``WatchJobs`` stream event by event."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

from federation.api.v1 import job_service_pb2, jobs_pb2


async def events_of(
    watch: AsyncIterable[job_service_pb2.WatchJobsResponse],
) -> AsyncIterator[jobs_pb2.JobEvent]:
    """The events of a watch one by one, in order (a stream message may carry many).

    When the reader stops early, the call is cancelled at once: a stream left to the garbage
    collector stays open at the coordinator, where it counts against the caller's streams.
    """
    try:
        async for reply in watch:
            for event in reply.events:
                yield event
    finally:
        cancel = getattr(watch, "cancel", None)
        if cancel is not None:
            cancel()
