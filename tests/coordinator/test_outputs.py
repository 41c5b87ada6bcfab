"""Declared outputs and the inputs that read them: what validation refuses, which output an
input names, and which keys a job may have signed."""

from __future__ import annotations

import pytest

from federation.api.v1 import jobs_pb2
from federation.coordinator.data.outputs import in_job_folder, source_of
from federation.coordinator.jobs.validation import spec_violations


def pipeline(**use: object) -> jobs_pb2.JobSpec:
    make = jobs_pb2.TaskSpec(
        name="make.v2",
        command=["make"],
        outputs=[
            jobs_pb2.Output(name="data", path="out.bin"),
            jobs_pb2.Output(name="logs", path="logs"),
        ],
    )
    reader = jobs_pb2.TaskSpec(name="use", command=["use"], depends_on=["make.v2"])
    reader.inputs.append(jobs_pb2.DataInput(**use))  # type: ignore[arg-type]
    return jobs_pb2.JobSpec(name="p", tasks=[make, reader])


def problems(spec: jobs_pb2.JobSpec) -> dict[str, str]:
    return {v.field: v.description for v in spec_violations(spec)}


def test_an_input_names_a_declared_output_by_task_and_name() -> None:
    assert problems(pipeline(dataset="task:make.v2.data", path="in/data.bin")) == {}
    specs = {t.name: t for t in pipeline().tasks}
    found = source_of("task:make.v2.logs", specs)
    assert found is not None
    assert found[0] == "make.v2"
    assert found[1] is not None
    assert found[1].path == "logs"
    assert source_of("camera", specs) is None


def test_a_task_alone_names_its_only_output_or_none() -> None:
    single = jobs_pb2.TaskSpec(name="a", outputs=[jobs_pb2.Output(name="o", path="p")])
    bare = jobs_pb2.TaskSpec(name="b")
    specs = {"a": single, "b": bare}
    found = source_of("task:a", specs)
    assert found is not None
    assert found[1] is not None
    assert found[1].name == "o"
    assert source_of("task:b", specs) == ("b", None)  # placement only, as before


@pytest.mark.parametrize(
    ("use", "field", "text"),
    [
        (
            {"dataset": "task:make.v2.nope"},
            "dataset",
            "declares no output 'nope' (it declares: data, logs)",
        ),
        ({"dataset": "task:make.v2"}, "dataset", "declares 2 outputs; name one"),
        ({"dataset": "task:make.v2.data", "path": "../x"}, "path", "without '..'"),
        ({"dataset": "task:make.v2.data", "path": "/etc/x"}, "path", "must be relative"),
        ({"dataset": "camera", "path": "x"}, "path", "is only for a task's output"),
    ],
)
def test_bad_inputs_are_refused_with_their_field(
    use: dict[str, str], field: str, text: str
) -> None:
    found = problems(pipeline(**use))
    assert text in found[f"spec.tasks[1].inputs[0].{field}"], found


def test_an_input_of_an_output_needs_its_task_depended_on() -> None:
    spec = pipeline(dataset="task:make.v2.data")
    del spec.tasks[1].depends_on[:]
    assert "add it to depends_on" in problems(spec)["spec.tasks[1].inputs[0].dataset"]


@pytest.mark.parametrize(
    ("output", "field", "text"),
    [
        (jobs_pb2.Output(name="a.b", path="x"), "name", "(no '.')"),
        (jobs_pb2.Output(name="data", path="y"), "name", "'data' is declared twice"),
        (jobs_pb2.Output(name="c", path=""), "path", "is required"),
        (jobs_pb2.Output(name="c", path="a/../../x"), "path", "without '..'"),
    ],
)
def test_bad_outputs_are_refused_with_their_field(
    output: jobs_pb2.Output, field: str, text: str
) -> None:
    spec = pipeline(dataset="task:make.v2.data")
    spec.tasks[0].outputs.append(output)
    assert text in problems(spec)[f"spec.tasks[0].outputs[2].{field}"]


def test_a_service_declares_no_outputs() -> None:
    spec = pipeline(dataset="task:make.v2.data")
    spec.tasks[1].outputs.append(jobs_pb2.Output(name="x", path="x"))
    spec.tasks[1].kind = jobs_pb2.TASK_KIND_SERVICE
    assert "never succeeds" in problems(spec)["spec.tasks[1].outputs"]


def test_only_keys_of_the_jobs_own_folder_are_signed() -> None:
    assert in_job_folder("federation/acme/job-1/make/3/data", "acme", "job-1", "make")
    assert in_job_folder("acme/job-1/train/1/2/data", "acme", "job-1", "train/1")  # a part
    assert in_job_folder("p/_/job-1/make/3/data", "", "job-1", "make")
    assert not in_job_folder("federation/globex/job-1/make/3/data", "acme", "job-1", "make")
    assert not in_job_folder("federation/acme/job-2/make/3/data", "acme", "job-1", "make")
    assert not in_job_folder("federation/acme/job-1/other/3/data", "acme", "job-1", "make")
    assert not in_job_folder("acme/job-1/make/../data", "acme", "job-1", "make")
    assert not in_job_folder("job-1/make/3/data", "acme", "job-1", "make")
