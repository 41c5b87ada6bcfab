"""Job spec files (YAML or JSON) to ``JobSpec`` messages, and enum names for people.

The file format is the protobuf JSON mapping of ``JobSpec`` with short enum names allowed:
``kind: GPU`` for ``DEVICE_KIND_GPU`` and ``domains: [edge]`` for ``DOMAIN_EDGE``.
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


def short_name(enum_value_name: str, prefix: str) -> str:
    """``DEVICE_KIND_GPU`` -> ``GPU``; ``DOMAIN_EDGE`` -> ``edge`` (domains are lower case)."""
    name = enum_value_name.removeprefix(prefix)
    return name.lower() if prefix == "DOMAIN_" else name


def domain_name(value: int) -> str:
    """Short lower-case name of a ``Domain`` value."""
    return short_name(resources_pb2.Domain.Name(value), "DOMAIN_")  # type: ignore[arg-type]


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
    return short_name(resources_pb2.DeviceKind.Name(value), "DEVICE_KIND_")  # type: ignore[arg-type]


def state_name(value: int) -> str:
    """Short upper-case name of a ``JobState`` value, e.g. ``RUNNING``."""
    return short_name(jobs_pb2.JobState.Name(value), "JOB_STATE_")  # type: ignore[arg-type]


def _expand_enums(doc: Any) -> Any:
    """Rewrite short enum names in a spec document into their full protobuf names."""
    if isinstance(doc, list):
        return [_expand_enums(item) for item in doc]
    if not isinstance(doc, Mapping):
        return doc
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key == "kind" and isinstance(value, str) and not value.startswith("DEVICE_KIND_"):
            value = "DEVICE_KIND_" + value.upper()
        elif key == "domains" and isinstance(value, list):
            value = [
                "DOMAIN_" + v.upper() if isinstance(v, str) and not v.startswith("DOMAIN_") else v
                for v in value
            ]
        out[key] = _expand_enums(value)
    return out


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
