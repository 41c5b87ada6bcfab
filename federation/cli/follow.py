"""Following jobs to their end: ``jobs submit --wait``, ``jobs wait`` and ``jobs watch ID``.

The exit status says how the jobs ended, so a script need not poll: 0 every job succeeded,
``EXIT_FAILED`` some job failed, ``EXIT_CANCELLED`` none failed but some was cancelled (1 stays
fedctl's own error, 2 a usage error).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from federation.api.v1 import job_service_pb2, job_service_pb2_grpc, jobs_pb2
from federation.watch import events_of

EXIT_FAILED = 3
EXIT_CANCELLED = 4
ENDED = frozenset(
    {jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED}
)


async def follow(
    stub: job_service_pb2_grpc.JobServiceAsyncStub,
    job_ids: Collection[str],
    on_event: Callable[[jobs_pb2.JobEvent], None],
) -> dict[str, int]:
    """Pass every event of ``job_ids`` (their current state first) to ``on_event`` until each
    job has ended; return each job's final state."""
    waiting = set(job_ids)
    ended: dict[str, int] = {}
    request = job_service_pb2.WatchJobsRequest(job_ids=list(job_ids), include_current=True)
    async for event in events_of(stub.WatchJobs(request)):
        on_event(event)
        if event.job_id in waiting and event.job_state in ENDED:
            ended[event.job_id] = event.job_state
            waiting.discard(event.job_id)
            if not waiting:
                break
    return ended


def exit_status(ended: dict[str, int]) -> int:
    """0, ``EXIT_FAILED`` or ``EXIT_CANCELLED`` for jobs that ended so."""
    states = set(ended.values())
    if jobs_pb2.JOB_STATE_FAILED in states:
        return EXIT_FAILED
    if jobs_pb2.JOB_STATE_CANCELLED in states:
        return EXIT_CANCELLED
    return 0
