"""A service's policy as both sides read it: the restart rule with the defaults the API names
(the agent restarts by it, the coordinator describes a crash loop by it), and what a running
service may change in place (the coordinator refuses a change outside it with the fields
named, and a site declines one).

A site changes a running service without placing it again: added replicas go where they fit
beside the others, removed ones are the highest-numbered, and the rest are replaced one batch
at a time with the new command, environment and policy. What each replica holds (resources,
devices, what its node must carry) and where the task may run stay as placed; changing those
means placing the service again, as a new job.
"""

from __future__ import annotations

from dataclasses import dataclass

from federation.api.v1 import jobs_pb2

DEFAULT_BACKOFF_S = 1.0
DEFAULT_MAX_BACKOFF_S = 300.0
DEFAULT_MIN_RUN_S = 10.0
DEFAULT_CRASH_LOOP_AFTER = 5


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """A service's restart policy with the defaults the API names filled in."""

    always: bool
    backoff_s: float
    max_backoff_s: float
    min_run_s: float
    crash_loop_after: int

    @classmethod
    def of(cls, policy: jobs_pb2.ServicePolicy) -> RestartPolicy:
        return cls(
            always=policy.restart != jobs_pb2.ServicePolicy.RESTART_ON_FAILURE,
            backoff_s=policy.backoff_s or DEFAULT_BACKOFF_S,
            max_backoff_s=policy.max_backoff_s or DEFAULT_MAX_BACKOFF_S,
            min_run_s=policy.min_run_s or DEFAULT_MIN_RUN_S,
            crash_loop_after=policy.crash_loop_after or DEFAULT_CRASH_LOOP_AFTER,
        )

    def restarts(self, returncode: int) -> bool:
        """Whether a replica that ended with ``returncode`` is started again."""
        return self.always or returncode != 0

    def crash_looping(self, short_runs: int) -> bool:
        return short_runs >= self.crash_loop_after

    def delay_s(self, short_runs: int) -> float:
        """The wait before a restart that follows ``short_runs`` short runs in a row: the
        backoff, doubled for each short run after the first, at most max_backoff_s; the
        longest once the replica is crash-looping."""
        if self.crash_looping(short_runs):
            return self.max_backoff_s
        return min(self.backoff_s * 2.0 ** max(0, short_runs - 1), self.max_backoff_s)


IN_PLACE_FIELDS = frozenset({"replicas", "command", "env", "service"})
"""The TaskSpec fields a running service may change (``service.port`` excepted: clients
found the replicas there)."""


def fixed_fields(old: jobs_pb2.TaskSpec, new: jobs_pb2.TaskSpec) -> list[str]:
    """The fields ``new`` changes that may not change in place, by path, in field order."""
    before, after = _set_fields(old), _set_fields(new)
    out = [
        field.name
        for field in jobs_pb2.TaskSpec.DESCRIPTOR.fields
        if field.name not in IN_PLACE_FIELDS and before.get(field.name) != after.get(field.name)
    ]
    if old.service.port != new.service.port:
        out.append("service.port")
    return out


def in_place(running: jobs_pb2.TaskSpec, change: jobs_pb2.TaskSpec) -> jobs_pb2.TaskSpec:
    """``running`` with the fields a change may make taken from ``change``; the rest stay as
    the site was given them (its offer may differ from the stored spec: learned speeds, the
    device models a quota left)."""
    out = jobs_pb2.TaskSpec()
    out.CopyFrom(running)
    taken = jobs_pb2.TaskSpec()
    taken.CopyFrom(change)
    for field in jobs_pb2.TaskSpec.DESCRIPTOR.fields:
        if field.name in IN_PLACE_FIELDS:
            out.ClearField(field.name)  # type: ignore[arg-type]
        else:
            taken.ClearField(field.name)  # type: ignore[arg-type]
    out.MergeFrom(taken)
    out.service.port = running.service.port
    return out


def only_scaled(old: jobs_pb2.TaskSpec, new: jobs_pb2.TaskSpec) -> bool:
    """Whether ``new`` differs from ``old`` in its replica count alone: the replicas that run
    go on as they are."""
    same = jobs_pb2.TaskSpec()
    same.CopyFrom(new)
    same.replicas = old.replicas
    return same == old


def _set_fields(spec: jobs_pb2.TaskSpec) -> dict[str, object]:
    """Each field set (a message field even when empty: set is not the same as unset)."""
    return {field.name: value for field, value in spec.ListFields()}


def max_unavailable(spec: jobs_pb2.TaskSpec) -> int:
    """How many replicas a rolling update may have not ready at once (0 in the spec: 1)."""
    return spec.service.max_unavailable or 1
