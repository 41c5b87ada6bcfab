"""Following jobs to their end: ``jobs submit --wait``, ``jobs wait`` and ``jobs watch ID``.

The exit status says how the jobs ended, so a script need not poll: 0 every job succeeded,
``EXIT_FAILED`` some job failed, ``EXIT_CANCELLED`` none failed but some was cancelled (1 stays
fedctl's own error, 2 a usage error).
"""

from __future__ import annotations

from federation.api.v1 import jobs_pb2

EXIT_FAILED = 3
EXIT_CANCELLED = 4


def exit_status(ended: dict[str, jobs_pb2.JobState.ValueType]) -> int:
    """0, ``EXIT_FAILED`` or ``EXIT_CANCELLED`` for jobs that ended so."""
    states = set(ended.values())
    if jobs_pb2.JOB_STATE_FAILED in states:
        return EXIT_FAILED
    if jobs_pb2.JOB_STATE_CANCELLED in states:
        return EXIT_CANCELLED
    return 0
