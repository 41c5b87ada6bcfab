"""What a running service may change in place, the one rule both sides apply: the
coordinator refuses a change outside it with the fields named, and a site declines one.

A site changes a running service without placing it again: added replicas go where they fit
beside the others, removed ones are the highest-numbered, and the rest are replaced one batch
at a time with the new command, environment and policy. What each replica holds (resources,
devices, what its node must carry) and where the task may run stay as placed; changing those
means placing the service again, as a new job.
"""

from __future__ import annotations

from federation.api.v1 import jobs_pb2

IN_PLACE_FIELDS = frozenset({"replicas", "command", "env", "service"})
"""The TaskSpec fields a running service may change."""


def fixed_fields(old: jobs_pb2.TaskSpec, new: jobs_pb2.TaskSpec) -> list[str]:
    """The fields ``new`` changes that may not change in place, by name, in field order."""
    before, after = _set_fields(old), _set_fields(new)
    return [
        field.name
        for field in jobs_pb2.TaskSpec.DESCRIPTOR.fields
        if field.name not in IN_PLACE_FIELDS and before.get(field.name) != after.get(field.name)
    ]


def _set_fields(spec: jobs_pb2.TaskSpec) -> dict[str, object]:
    """Each field set (a message field even when empty: set is not the same as unset)."""
    return {field.name: value for field, value in spec.ListFields()}


def max_unavailable(spec: jobs_pb2.TaskSpec) -> int:
    """How many replicas a rolling update may have not ready at once (0 in the spec: 1)."""
    return spec.service.max_unavailable or 1
