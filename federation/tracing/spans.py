"""The names every span of a job shares: its root, its attributes' keys and value types, and
the ids that put a job's spans, from every process, in one trace."""

from __future__ import annotations

import hashlib

ROOT = "job.submit"
"""The span every trace starts with, and the one whose id ``job_trace`` derives."""

JOB_ID = "federation.job_id"
TASK = "federation.task"
SITE = "federation.site"
EPOCH = "federation.epoch"

Value = str | bool | int | float | list[str] | list[float]
"""What an attribute may hold."""


def job_trace(job_id: str) -> tuple[int, int]:
    """The trace id of ``job_id``'s trace and the span id of its root (``job.submit``)."""
    digest = hashlib.sha256(job_id.encode()).digest()
    return int.from_bytes(digest[:16]) or 1, int.from_bytes(digest[16:24]) or 1  # never 0
