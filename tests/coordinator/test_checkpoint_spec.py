"""Checkpoint and disconnect fields of a job spec: parsing, validation, placement input, offer."""

from __future__ import annotations

import pytest

from federation.api.v1 import jobs_pb2
from federation.coordinator.jobs.validation import spec_violations
from federation.coordinator.scheduling.config import CHECKPOINT
from federation.coordinator.scheduling.task_requests import request_for
from federation.jobspec import JobSpecFileError, job_spec_from_dict
from federation.placement.request import Input


def parsed(task: dict[str, object] | None = None, **job: object) -> jobs_pb2.JobSpec:
    doc: dict[str, object] = {
        "name": "j",
        "tasks": [{"name": "t", "command": ["x"], **(task or {})}],
        **job,
    }
    return job_spec_from_dict(doc)


def test_spec_files_spell_the_policy_as_nomad_does() -> None:
    """disconnect {lost_after_s, replace, reconcile} and checkpoint {dir, interval_s} parse."""
    spec = parsed(
        {"checkpoint": {"dir": "out/ckpt", "interval_s": 30}},
        disconnect={"lost_after_s": 90, "replace": False, "reconcile": "keep_original"},
    )
    assert spec.disconnect.lost_after_s == 90
    assert spec.disconnect.HasField("replace")
    assert not spec.disconnect.replace
    assert spec.disconnect.reconcile == jobs_pb2.RECONCILE_KEEP_ORIGINAL
    assert (spec.tasks[0].checkpoint.dir, spec.tasks[0].checkpoint.interval_s) == ("out/ckpt", 30)
    assert parsed(disconnect={"reconcile": "BEST"}).disconnect.reconcile == jobs_pb2.RECONCILE_BEST


def test_an_unknown_rule_is_refused_when_parsed() -> None:
    """A misspelt reconcile rule is a parse error naming the value."""
    with pytest.raises(JobSpecFileError, match="KEEP_NEWEST"):
        parsed(disconnect={"reconcile": "keep_newest"})


@pytest.mark.parametrize(
    ("task", "job", "field", "words"),
    [
        ({"checkpoint": {"dir": "/abs"}}, {}, "spec.tasks[0].checkpoint.dir", "relative path"),
        ({"checkpoint": {"dir": "a/../b"}}, {}, "spec.tasks[0].checkpoint.dir", "no '..'"),
        ({"checkpoint": {"dir": "a//b"}}, {}, "spec.tasks[0].checkpoint.dir", "relative path"),
        (
            {"checkpoint": {"interval_s": -1}},
            {},
            "spec.tasks[0].checkpoint.interval_s",
            "got -1",
        ),
        (
            {},
            {"disconnect": {"lost_after_s": -5}},
            "spec.disconnect.lost_after_s",
            "got -5",
        ),
    ],
)
def test_bad_policies_are_named(
    task: dict[str, object], job: dict[str, object], field: str, words: str
) -> None:
    """Each bad checkpoint or disconnect setting is reported with its field."""
    (violation,) = spec_violations(parsed(task, **job))
    assert violation.field == field
    assert words in violation.description


def test_good_policies_pass() -> None:
    """Defaults, a nested folder and every rule are valid."""
    for rule in ("keep_replacement", "keep_original", "best"):
        spec = parsed(
            {"checkpoint": {"dir": "a/b", "interval_s": 5}},
            disconnect={"lost_after_s": 3, "reconcile": rule},
        )
        assert spec_violations(spec) == []
    assert spec_violations(parsed({"checkpoint": {}})) == []


def test_an_unknown_rule_number_is_refused() -> None:
    """A reconcile value outside the enum (from a raw client) is a violation."""
    spec = parsed()
    spec.disconnect.reconcile = 9  # type: ignore[assignment]
    (violation,) = spec_violations(spec)
    assert violation.field == "spec.disconnect.reconcile"


def test_a_recorded_checkpoint_is_an_input_from_its_site() -> None:
    """Placing a task that has a checkpoint counts moving its bytes from the site holding it."""
    spec = parsed({"checkpoint": {}})
    job = jobs_pb2.Job(id="j", spec=spec)
    task = job.tasks.add(name="t")
    request = request_for(job, "t")
    assert request is not None
    assert request.inputs == ()
    task.checkpoint.CopyFrom(jobs_pb2.CheckpointRecord(path="/ck/s-3", bytes=4096, site="edge-p"))
    request = request_for(job, "t")
    assert request is not None
    assert request.inputs == (Input(CHECKPOINT + "t", 4096, "edge-p"),)


def test_identical_tasks_share_a_request_and_any_difference_shows() -> None:
    """Requests are remembered by what they are built from: tasks of two jobs alike share one;
    a different constraint, objective or resource gives a different request."""

    def request(spec: jobs_pb2.JobSpec, name: str = "j") -> object:
        job = jobs_pb2.Job(id=name, spec=spec)
        job.tasks.add(name="t")
        return request_for(job, "t")

    base = request(parsed({"resources": {"cpu": 2}}), "j1")
    assert request(parsed({"resources": {"cpu": 2}}, name="other"), "j2") is base
    assert request(parsed({"resources": {"cpu": 3}})) != base
    assert request(parsed({"resources": {"cpu": 2}}, constraints={"sites": ["a"]})) != base
    assert request(parsed({"resources": {"cpu": 2}}, objective={"deadline_s": 60})) != base
