"""Job spec files (YAML or JSON) to ``JobSpec`` messages, and enum names for people.

The file format is the protobuf JSON mapping of ``JobSpec`` with short enum names allowed:
``kind: GPU`` for ``DEVICE_KIND_GPU``, ``domains: [edge]`` for ``DOMAIN_EDGE``,
``reconcile: keep_original`` for ``RECONCILE_KEEP_ORIGINAL``, a task's ``kind: service`` for
``TASK_KIND_SERVICE`` and its ``service.restart: always`` for ``RESTART_ALWAYS``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import json_format

from federation.api.v1 import jobs_pb2, resources_pb2


class JobSpecFileError(ValueError):
    """A spec file cannot be read as a job spec."""


def short_name(enum: Any, value: int, prefix: str) -> str:
    """``DEVICE_KIND_GPU`` -> ``GPU``; a value outside the enum -> ``unknown(9)``."""
    if value not in enum.values():
        return f"unknown({value})"
    return str(enum.Name(value)).removeprefix(prefix)


def domain_name(value: int) -> str:
    """Short lower-case name of a ``Domain`` value, e.g. ``edge``."""
    return short_name(resources_pb2.Domain, value, "DOMAIN_").lower()


def parse_domain(text: str) -> resources_pb2.Domain.ValueType:
    """``edge`` or ``DOMAIN_EDGE`` -> the enum value; raises ValueError when unknown."""
    name = text.upper()
    if not name.startswith("DOMAIN_"):
        name = "DOMAIN_" + name
    known = set(resources_pb2.Domain.keys()) - {"DOMAIN_UNSPECIFIED"}
    if name not in known:
        raise ValueError(f"unknown domain {text!r} (expected edge, datacenter or cloud)")
    return resources_pb2.Domain.Value(name)


def kind_name(value: int) -> str:
    """Short upper-case name of a ``DeviceKind`` value."""
    return short_name(resources_pb2.DeviceKind, value, "DEVICE_KIND_")


def state_name(value: int) -> str:
    """Short upper-case name of a ``JobState`` value, e.g. ``RUNNING``."""
    return short_name(jobs_pb2.JobState, value, "JOB_STATE_")


def _full_name(value: Any, prefix: str) -> Any:
    if isinstance(value, str) and not value.upper().startswith(prefix):
        return prefix + value.upper()
    return value.upper() if isinstance(value, str) else value


def _expand_enums(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Rewrite short enum names where the spec has enums: kinds, domains, reconcile rules,
    spread topologies.

    Only those two places: a user's own maps (labels, env) may well have a key named "kind".
    """
    out = dict(doc)
    tasks = out.get("tasks")
    if isinstance(tasks, list):
        out["tasks"] = [_expand_task(task) for task in tasks]
    disconnect = out.get("disconnect")
    if isinstance(disconnect, Mapping) and "reconcile" in disconnect:
        out["disconnect"] = {
            **disconnect,
            "reconcile": _full_name(disconnect["reconcile"], "RECONCILE_"),
        }
    constraints = out.get("constraints")
    if isinstance(constraints, Mapping) and isinstance(constraints.get("domains"), list):
        domains = [_full_name(d, "DOMAIN_") for d in constraints["domains"]]
        out["constraints"] = {**constraints, "domains": domains}
    return out


def _expand_task(task: Any) -> Any:
    if not isinstance(task, Mapping):
        return task
    if "kind" in task:
        task = {**task, "kind": _full_name(task["kind"], "TASK_KIND_")}
    service = task.get("service")
    if isinstance(service, Mapping) and "restart" in service:
        task = {
            **task,
            "service": {**service, "restart": _full_name(service["restart"], "RESTART_")},
        }
    spread = task.get("spread")
    if isinstance(spread, Mapping) and "topology" in spread:
        topology = _full_name(spread["topology"], "TOPOLOGY_")
        task = {**task, "spread": {**spread, "topology": topology}}
    if not isinstance(task.get("resources"), Mapping):
        return task
    resources = task["resources"]
    accelerator = resources.get("accelerator")
    if not isinstance(accelerator, Mapping) or "kind" not in accelerator:
        return task
    kind = _full_name(accelerator["kind"], "DEVICE_KIND_")
    return {**task, "resources": {**resources, "accelerator": {**accelerator, "kind": kind}}}


def job_spec_from_dict(doc: Any, *, source: str = "spec") -> jobs_pb2.JobSpec:
    """Build a ``JobSpec`` from a parsed document; unknown fields or enum names raise."""
    if not isinstance(doc, Mapping):
        raise JobSpecFileError(f"{source}: a job spec is a mapping, got {type(doc).__name__}")
    try:
        return json_format.ParseDict(_expand_enums(doc), jobs_pb2.JobSpec())
    except json_format.ParseError as err:
        raise JobSpecFileError(f"{source}: {err}") from None


def load_job_specs(path: Path) -> list[jobs_pb2.JobSpec]:
    """Read one spec, a list of specs, or ``{jobs: [...]}`` from a YAML or JSON file."""
    try:
        text = path.read_text()
    except OSError as err:
        raise JobSpecFileError(f"{path}: {err.strerror}") from None
    try:
        doc = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as err:
        kind = "JSON" if path.suffix == ".json" else "YAML"
        raise JobSpecFileError(f"{path}: not valid {kind}: {err}") from None
    if isinstance(doc, Mapping) and "jobs" in doc:
        doc = doc["jobs"]
    docs = doc if isinstance(doc, list) else [doc]
    return [job_spec_from_dict(d, source=f"{path}[{i}]") for i, d in enumerate(docs)]
