"""Env values are secrets: only the job's own tenant (or whoever submitted it) reads them.

Tasks carry passwords and tokens in ``env``; the sites that run them need the values, but other
readers do not: an operator listing jobs, the retention archive, a backup restored elsewhere. So
replies to anyone else, and every archived record, show each value as ``REDACTED`` (the names
stay, so a reader still sees what a task is given).
"""

from __future__ import annotations

from collections.abc import Iterable

from federation.api.v1 import jobs_pb2
from federation.security.identity import Identity, Role

REDACTED = "<redacted>"


def has_env(job: jobs_pb2.Job) -> bool:
    return any(task.env for task in job.spec.tasks)


def redact_env(job: jobs_pb2.Job) -> None:
    """Replace every env value of ``job``'s tasks with ``REDACTED``, in place."""
    for task in job.spec.tasks:
        for name in task.env:
            task.env[name] = REDACTED


def may_read_env(caller: Identity, job: jobs_pb2.Job) -> bool:
    """The job's tenant, or the identity that submitted it."""
    if caller.role is Role.TENANT and job.spec.tenant == caller.name:
        return True
    return job.submitted_by == str(caller)


def for_reader(caller: Identity, job: jobs_pb2.Job) -> jobs_pb2.Job:
    """``job`` as ``caller`` may see it: itself, or a copy with its env values redacted."""
    if not has_env(job) or may_read_env(caller, job):
        return job
    copy = jobs_pb2.Job()
    copy.CopyFrom(job)
    redact_env(copy)
    return copy


def redact_for_reader(caller: Identity, jobs: Iterable[jobs_pb2.Job]) -> None:
    """Redact, in place, the env values of the jobs in a reply that ``caller`` may not read."""
    for job in jobs:
        if has_env(job) and not may_read_env(caller, job):
            redact_env(job)
