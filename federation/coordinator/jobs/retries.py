"""Runs again for failed tasks: how many a task gets, and how long it waits before each.

A task's ``retry`` policy counts failures only: a non-zero exit or a timeout. Copies stopped for
other reasons (preemption, a lost site, an agent cut off from every coordinator) are placed
again without using up an attempt.
"""

from __future__ import annotations

from federation.api.v1 import jobs_pb2

DEFAULT_BACKOFF_S = 10.0
DEFAULT_MAX_BACKOFF_S = 600.0


def max_attempts(spec: jobs_pb2.TaskSpec) -> int:
    """Runs the task gets in all, the first included."""
    return max(1, spec.retry.max_attempts)


def backoff_s(spec: jobs_pb2.TaskSpec, failed: int) -> float:
    """Seconds to wait after the ``failed``-th failure: the backoff, doubled each time after."""
    first = spec.retry.backoff_s or DEFAULT_BACKOFF_S
    longest = spec.retry.max_backoff_s or DEFAULT_MAX_BACKOFF_S
    return float(min(first * 2 ** min(failed - 1, 32), max(longest, first)))


def due_in_s(task: jobs_pb2.TaskStatus, now_s: float) -> float:
    """Seconds a failed task still waits out its backoff at wall time ``now_s`` (0: none)."""
    if not task.HasField("retry_at"):
        return 0.0
    return max(0.0, task.retry_at.ToNanoseconds() / 1e9 - now_s)
