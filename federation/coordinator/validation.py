"""Field-level validation of job specs: every problem found, not just the first."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator

from federation.api.v1 import jobs_pb2, resources_pb2
from federation.errors import FieldViolation, InvalidArgumentError

NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_NAME = 63
MAX_TASKS = 64
MAX_REPLICAS = 1024
MAX_CPU = 4096.0
MAX_MEMORY_MIB = 16 * 1024 * 1024
MAX_DEVICES_PER_REPLICA = 64
MAX_COMMAND_BYTES = 64 * 1024
MAX_PRIORITY = 1000
MAX_LABELS = 64
DEVICE_KINDS = set(resources_pb2.DeviceKind.values()) - {resources_pb2.DEVICE_KIND_UNSPECIFIED}
DOMAINS = set(resources_pb2.Domain.values()) - {resources_pb2.DOMAIN_UNSPECIFIED}


def name_problem(value: str) -> str | None:
    """Why ``value`` is not a valid object name, or None."""
    if len(value) > MAX_NAME:
        return f"is {len(value)} characters long; at most {MAX_NAME} allowed"
    if not NAME_RE.fullmatch(value):
        return (
            f"{value!r} is not a valid name: use lower-case letters, digits, '.', '_' and '-', "
            "starting and ending with a letter or digit"
        )
    return None


def _show(value: float) -> str:
    """Exact for whole numbers (no 1.67772e+07), plain otherwise."""
    return str(int(value)) if math.isfinite(value) and float(value).is_integer() else str(value)


def _number(field: str, value: float, low: float, high: float) -> Iterator[FieldViolation]:
    if not math.isfinite(value) or value < low or value > high:
        yield FieldViolation(
            field, f"must be between {_show(low)} and {_show(high)}, got {_show(value)}"
        )


def _task_violations(task: jobs_pb2.TaskSpec, path: str) -> Iterator[FieldViolation]:
    if not task.name:
        yield FieldViolation(f"{path}.name", "is required")
    elif problem := name_problem(task.name):
        yield FieldViolation(f"{path}.name", problem)
    if not task.command or not task.command[0]:
        yield FieldViolation(f"{path}.command", "is empty; give the program and its arguments")
    elif sum(len(arg.encode()) for arg in task.command) > MAX_COMMAND_BYTES:
        yield FieldViolation(f"{path}.command", f"is longer than {MAX_COMMAND_BYTES} bytes")
    for key in task.env:
        if not ENV_KEY_RE.fullmatch(key):
            yield FieldViolation(f"{path}.env", f"{key!r} is not a valid environment variable")
    yield from _number(f"{path}.replicas", task.replicas, 0, MAX_REPLICAS)
    res = task.resources
    yield from _number(f"{path}.resources.cpu", res.cpu, 0, MAX_CPU)
    yield from _number(f"{path}.resources.memory_mib", res.memory_mib, 0, MAX_MEMORY_MIB)
    acc = res.accelerator
    if res.HasField("accelerator") and (acc.count or acc.kind or acc.models or acc.vendor):
        if acc.kind not in DEVICE_KINDS:
            yield FieldViolation(
                f"{path}.resources.accelerator.kind",
                f"unknown accelerator kind {acc.kind}; expected GPU, NPU, MLU, FPGA or DPU",
            )
        if acc.count < 1 or acc.count > MAX_DEVICES_PER_REPLICA:
            yield FieldViolation(
                f"{path}.resources.accelerator.count",
                f"must be between 1 and {MAX_DEVICES_PER_REPLICA}, got {acc.count}",
            )
    yield from _number(f"{path}.estimated_duration_s", task.estimated_duration_s, 0, 1e9)
    yield from _number(f"{path}.timeout_s", task.timeout_s, 0, 1e9)


def spec_violations(spec: jobs_pb2.JobSpec, path: str = "spec") -> list[FieldViolation]:
    """Every problem with ``spec``; an empty list means it is valid."""
    out: list[FieldViolation] = []
    if spec.id and (problem := name_problem(spec.id)):
        out.append(FieldViolation(f"{path}.id", problem))
    if not spec.name:
        out.append(FieldViolation(f"{path}.name", "is required"))
    elif len(spec.name) > MAX_NAME:
        out.append(
            FieldViolation(f"{path}.name", f"is {len(spec.name)} characters; at most {MAX_NAME}")
        )
    if spec.tenant and (problem := name_problem(spec.tenant)):
        out.append(FieldViolation(f"{path}.tenant", problem))
    out.extend(_number(f"{path}.priority", spec.priority, -MAX_PRIORITY, MAX_PRIORITY))
    if not spec.tasks:
        out.append(FieldViolation(f"{path}.tasks", "a job needs at least one task"))
    elif len(spec.tasks) > MAX_TASKS:
        out.append(FieldViolation(f"{path}.tasks", f"at most {MAX_TASKS} tasks per job"))
    seen: set[str] = set()
    for i, task in enumerate(spec.tasks[:MAX_TASKS]):
        out.extend(_task_violations(task, f"{path}.tasks[{i}]"))
        if task.name in seen:
            out.append(FieldViolation(f"{path}.tasks[{i}].name", f"duplicate task {task.name!r}"))
        seen.add(task.name)
    for i, domain in enumerate(spec.constraints.domains):
        if domain not in DOMAINS:
            out.append(
                FieldViolation(f"{path}.constraints.domains[{i}]", f"unknown domain {domain}")
            )
    for i, site in enumerate(spec.constraints.sites):
        if problem := name_problem(site):
            out.append(FieldViolation(f"{path}.constraints.sites[{i}]", problem))
    if len(spec.labels) > MAX_LABELS:
        out.append(FieldViolation(f"{path}.labels", f"at most {MAX_LABELS} labels"))
    return out


def validate_spec(spec: jobs_pb2.JobSpec, path: str = "spec") -> None:
    """Raise ``InvalidArgumentError`` listing every problem with ``spec``."""
    if violations := spec_violations(spec, path):
        raise InvalidArgumentError(violations)
