"""Reading a ``WatchJobs`` stream event by event."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

from federation.api.v1 import job_service_pb2, jobs_pb2


async def events_of(
    watch: AsyncIterable[job_service_pb2.WatchJobsResponse],
) -> AsyncIterator[jobs_pb2.JobEvent]:
    """The events of a watch one by one, in order (a stream message may carry many)."""
    async for reply in watch:
        for event in reply.events:
            yield event
