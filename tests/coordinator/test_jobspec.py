"""Job spec files and documents: short enum names, file forms and the errors people see."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from federation.api.v1 import jobs_pb2, resources_pb2
from federation.coordinator.jobs.validation import spec_violations
from federation.jobspec import (
    JobSpecFileError,
    domain_name,
    job_spec_from_dict,
    kind_name,
    load_job_specs,
    parse_domain,
    state_name,
)

SPEC_YAML = """\
name: train
tasks:
  - name: trainer
    command: [python, train.py]
    replicas: 2
    resources:
      cpu: 4
      memoryMib: 8192
      accelerator: {kind: GPU, count: 2, models: [H100]}
constraints:
  domains: [edge, DATACENTER]
  nodeLabels: {zone: a}
"""


def spec_doc(name: str = "train", **extra: Any) -> dict[str, Any]:
    return {"name": name, "tasks": [{"name": "main", "command": ["run"]}], **extra}


def test_short_enum_names_expand() -> None:
    """``kind: GPU`` and ``domains: [edge]`` become the full protobuf enum values."""
    spec = job_spec_from_dict(
        {
            "name": "x",
            "tasks": [{"name": "t", "resources": {"accelerator": {"kind": "npu", "count": 1}}}],
            "constraints": {"domains": ["edge", "Cloud"]},
        }
    )
    assert spec.tasks[0].resources.accelerator.kind == resources_pb2.DEVICE_KIND_NPU
    assert list(spec.constraints.domains) == [resources_pb2.DOMAIN_EDGE, resources_pb2.DOMAIN_CLOUD]


def test_full_enum_names_and_numbers_still_work() -> None:
    """Full protobuf enum names and enum numbers are accepted unchanged."""
    spec = job_spec_from_dict(
        {
            "name": "x",
            "tasks": [
                {"name": "a", "resources": {"accelerator": {"kind": "DEVICE_KIND_FPGA"}}},
                {"name": "b", "resources": {"accelerator": {"kind": 5}}},
            ],
            "constraints": {"domains": ["DOMAIN_DATACENTER", 1]},
        }
    )
    assert [t.resources.accelerator.kind for t in spec.tasks] == [
        resources_pb2.DEVICE_KIND_FPGA,
        resources_pb2.DEVICE_KIND_DPU,
    ]
    assert list(spec.constraints.domains) == [
        resources_pb2.DOMAIN_DATACENTER,
        resources_pb2.DOMAIN_EDGE,
    ]


def test_json_field_names_and_proto_names_both_parse() -> None:
    """camelCase JSON names and snake_case proto names map to the same fields."""
    a = job_spec_from_dict(spec_doc(constraints={"nodeLabels": {"zone": "a"}}))
    b = job_spec_from_dict(spec_doc(constraints={"node_labels": {"zone": "a"}}))
    assert a == b
    assert dict(a.constraints.node_labels) == {"zone": "a"}


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        (spec_doc(colour="red"), "colour"),
        (spec_doc(constraints={"domains": ["moon"]}), "DOMAIN_MOON"),
        ({"name": "x", "tasks": [{"resources": {"accelerator": {"kind": "TPU"}}}]}, "TPU"),
        ({"name": "x", "tasks": [{"replicas": -1}]}, "replicas"),
    ],
    ids=["unknown-field", "unknown-domain", "unknown-kind", "negative-uint"],
)
def test_bad_documents_raise_with_the_source(doc: dict[str, Any], needle: str) -> None:
    """Unknown fields, enum names and bad values raise JobSpecFileError naming the source."""
    with pytest.raises(JobSpecFileError) as caught:
        job_spec_from_dict(doc, source="jobs.yaml[2]")
    message = str(caught.value)
    assert message.startswith("jobs.yaml[2]: ")
    assert needle in message


@pytest.mark.parametrize("doc", [["a"], "text", 3, None], ids=["list", "str", "int", "none"])
def test_non_mapping_document_is_refused(doc: object) -> None:
    """A document that is not a mapping is refused with its type named."""
    with pytest.raises(
        JobSpecFileError, match=f"a job spec is a mapping, got {type(doc).__name__}"
    ):
        job_spec_from_dict(doc)


def test_yaml_file_with_one_spec(tmp_path: Path) -> None:
    """A YAML file holding one spec gives that one spec, enums expanded."""
    path = tmp_path / "job.yaml"
    path.write_text(SPEC_YAML)
    (spec,) = load_job_specs(path)
    task = spec.tasks[0]
    assert (spec.name, task.name, list(task.command), task.replicas) == (
        "train",
        "trainer",
        ["python", "train.py"],
        2,
    )
    assert (task.resources.cpu, task.resources.memory_mib) == (4.0, 8192)
    assert task.resources.accelerator == jobs_pb2.AcceleratorRequest(
        kind=resources_pb2.DEVICE_KIND_GPU, count=2, models=["H100"]
    )
    assert list(spec.constraints.domains) == [
        resources_pb2.DOMAIN_EDGE,
        resources_pb2.DOMAIN_DATACENTER,
    ]
    assert dict(spec.constraints.node_labels) == {"zone": "a"}


def test_an_image_is_one_line_of_yaml_and_checked_at_its_field(tmp_path: Path) -> None:
    """``image:`` names the task's image; a malformed one is reported at its field."""
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: c\ntasks:\n"
        "  - {name: a, image: registry.example.org/team/tools:1.2, command: [id]}\n"
        "  - {name: b, image: 'tools:1.2', command: [id]}\n"
    )
    (spec,) = load_job_specs(path)
    assert [t.image for t in spec.tasks] == ["registry.example.org/team/tools:1.2", "tools:1.2"]
    (violation,) = spec_violations(spec)
    assert violation.field == "spec.tasks[1].image"
    assert "does not name its registry" in violation.description


@pytest.mark.parametrize(
    "text",
    [
        "- {name: a, tasks: [{name: t}]}\n- {name: b, tasks: [{name: t}]}\n",
        "jobs:\n  - {name: a, tasks: [{name: t}]}\n  - {name: b, tasks: [{name: t}]}\n",
    ],
    ids=["list", "jobs-key"],
)
def test_yaml_list_and_jobs_mapping_give_every_spec(tmp_path: Path, text: str) -> None:
    """A YAML list of specs and a ``{jobs: [...]}`` mapping both give every spec, in order."""
    path = tmp_path / "batch.yml"
    path.write_text(text)
    assert [s.name for s in load_job_specs(path)] == ["a", "b"]


def test_json_file(tmp_path: Path) -> None:
    """A .json file is read as JSON, with the same short enum names allowed."""
    path = tmp_path / "batch.json"
    docs = [
        spec_doc("a", constraints={"domains": ["cloud"]}),
        spec_doc("b"),
    ]
    path.write_text(json.dumps({"jobs": docs}))
    specs = load_job_specs(path)
    assert [s.name for s in specs] == ["a", "b"]
    assert list(specs[0].constraints.domains) == [resources_pb2.DOMAIN_CLOUD]


def test_unknown_field_in_file_names_file_and_index(tmp_path: Path) -> None:
    """An unknown field in the second spec of a file names the file and index 1."""
    path = tmp_path / "batch.yaml"
    path.write_text("- {name: a}\n- {name: b, replicas: 3}\n")
    with pytest.raises(JobSpecFileError) as caught:
        load_job_specs(path)
    assert str(caught.value).startswith(f"{path}[1]: ")
    assert "replicas" in str(caught.value)


@pytest.mark.parametrize(
    ("name", "text", "kind"),
    [("bad.json", "{not json", "JSON"), ("bad.yaml", "a: [unclosed", "YAML")],
)
def test_unparsable_file_names_file_and_format(
    tmp_path: Path, name: str, text: str, kind: str
) -> None:
    """A file that is not valid JSON or YAML is reported with its path and format."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(JobSpecFileError, match=f"not valid {kind}") as caught:
        load_job_specs(path)
    assert str(path) in str(caught.value)


def test_missing_file_is_a_spec_file_error(tmp_path: Path) -> None:
    """A file that cannot be read raises JobSpecFileError naming it, not OSError."""
    path = tmp_path / "absent.yaml"
    with pytest.raises(JobSpecFileError) as caught:
        load_job_specs(path)
    assert str(caught.value).startswith(f"{path}: ")


def test_empty_yaml_file_is_refused(tmp_path: Path) -> None:
    """An empty YAML file is not silently read as an empty spec."""
    path = tmp_path / "empty.yaml"
    path.write_text("")
    with pytest.raises(JobSpecFileError, match="got NoneType") as caught:
        load_job_specs(path)
    assert str(caught.value).startswith(f"{path}[0]: ")


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("edge", resources_pb2.DOMAIN_EDGE),
        ("Datacenter", resources_pb2.DOMAIN_DATACENTER),
        ("DOMAIN_CLOUD", resources_pb2.DOMAIN_CLOUD),
        ("domain_cloud", resources_pb2.DOMAIN_CLOUD),
    ],
)
def test_parse_domain_accepts_short_and_full_names(text: str, value: int) -> None:
    """Domain names parse case-insensitively, with or without the DOMAIN_ prefix."""
    assert parse_domain(text) == value


@pytest.mark.parametrize("text", ["unspecified", "DOMAIN_UNSPECIFIED", "moon", ""])
def test_parse_domain_refuses_unknown_names(text: str) -> None:
    """Unknown names, and the unspecified value, raise ValueError listing the choices."""
    with pytest.raises(ValueError, match="expected edge, datacenter or cloud"):
        parse_domain(text)


def test_enum_short_names_for_people() -> None:
    """Domains print lower case; device kinds and job states print upper case, unprefixed."""
    assert domain_name(resources_pb2.DOMAIN_DATACENTER) == "datacenter"
    assert kind_name(resources_pb2.DEVICE_KIND_MLU) == "MLU"
    assert state_name(jobs_pb2.JOB_STATE_CANCELLED) == "CANCELLED"


def test_map_entries_named_kind_are_left_alone() -> None:
    """A label, env variable or node label whose key is ``kind`` keeps its value verbatim."""
    spec = job_spec_from_dict(
        {
            "name": "x",
            "labels": {"kind": "training"},
            "tasks": [{"name": "t", "command": ["run"], "env": {"kind": "fast"}}],
            "constraints": {"nodeLabels": {"kind": "gpu-box"}},
        }
    )
    assert spec.labels["kind"] == "training"
    assert spec.tasks[0].env["kind"] == "fast"
    assert spec.constraints.node_labels["kind"] == "gpu-box"


def test_lower_case_full_domain_name_in_a_spec() -> None:
    """A spec may spell a domain as parse_domain accepts it, e.g. ``domain_edge``."""
    spec = job_spec_from_dict(spec_doc(constraints={"domains": ["domain_edge"]}))
    assert list(spec.constraints.domains) == [resources_pb2.DOMAIN_EDGE]


ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def readme_job_specs() -> list[str]:
    """The documentation's YAML blocks that are job specs (they have a top-level ``tasks:``)."""
    blocks = [b for page in DOCS for b in re.findall(r"```ya?ml\n(.*?)```", page.read_text(), re.S)]
    return [b for b in blocks if re.search(r"^tasks:", b, re.M)]


@pytest.mark.parametrize("block", readme_job_specs())
def test_every_job_spec_in_the_readme_is_accepted(block: str) -> None:
    """What the documentation shows a user parses, with its short names, and passes
    validation."""
    doc = yaml.safe_load(block)
    spec = job_spec_from_dict(doc)
    if not spec.name:
        spec.name = "excerpt"  # an excerpt of a spec, shown for one field
    assert spec_violations(spec) == []


def test_the_readme_has_job_specs() -> None:
    assert len(readme_job_specs()) >= 3
