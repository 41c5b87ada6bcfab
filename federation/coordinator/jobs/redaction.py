"""Env values are secrets: only the job's own tenant (or whoever submitted it) reads them.

Tasks carry passwords and tokens in ``env``; the sites that run them need the values, but other
readers do not: an operator listing jobs, the retention archive, a backup restored elsewhere. So
replies to anyone else, and every archived record, show each value as ``REDACTED`` (the names
stay, so a reader still sees what a task is given).

Registry credentials (``image_pull_secrets``) are redacted for every reader, the tenant too:
only the site that pulls the task's image needs the password, and a reply, event or archive
that never holds it cannot leak it. The registry and username stay, so a reader sees which
login a task pulls with.
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
        # The names first: a protobuf map set while it is walked may skip some of its keys.
        for name in list(task.env):
            task.env[name] = REDACTED


def has_pull_secrets(job: jobs_pb2.Job) -> bool:
    return any(task.image_pull_secrets for task in job.spec.tasks)


def redact_pull_secrets(job: jobs_pb2.Job) -> None:
    """Replace every registry password of ``job``'s tasks with ``REDACTED``, in place."""
    for task in job.spec.tasks:
        for secret in task.image_pull_secrets:
            secret.password = REDACTED


def redact_all(job: jobs_pb2.Job) -> None:
    """Redact, in place, what no reader sees of a job kept past it: env values, passwords."""
    redact_env(job)
    redact_pull_secrets(job)


def may_read_env(caller: Identity, job: jobs_pb2.Job) -> bool:
    """The job's tenant, or the identity that submitted it."""
    if caller.role is Role.TENANT and job.spec.tenant == caller.name:
        return True
    return job.submitted_by == str(caller)


def for_reader(caller: Identity, job: jobs_pb2.Job) -> jobs_pb2.Job:
    """``job`` as ``caller`` may see it: itself, or a copy with its registry passwords and
    (unless ``caller`` may read them) its env values redacted."""
    env = has_env(job) and not may_read_env(caller, job)
    if not env and not has_pull_secrets(job):
        return job
    copy = jobs_pb2.Job()
    copy.CopyFrom(job)
    if env:
        redact_env(copy)
    redact_pull_secrets(copy)
    return copy


def redact_for_reader(caller: Identity, jobs: Iterable[jobs_pb2.Job]) -> None:
    """Redact, in place, the registry passwords of the jobs in a reply, and the env values
    that ``caller`` may not read."""
    for job in jobs:
        if has_env(job) and not may_read_env(caller, job):
            redact_env(job)
        redact_pull_secrets(job)
