"""Job spec validation: each rule on its own, and every problem reported at once."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from federation.api.v1 import jobs_pb2, resources_pb2
from federation.coordinator.jobs.validation import (
    MAX_CHECKED_TASK_BYTES,
    _valid_task,
    spec_violations,
    validate_spec,
)
from federation.errors import FieldViolation, InvalidArgumentError

Mutation = Callable[[jobs_pb2.JobSpec], None]


def valid_spec() -> jobs_pb2.JobSpec:
    """A spec using most fields, every one of them valid."""
    return jobs_pb2.JobSpec(
        id="train-1",
        name="Train the model",
        tenant="team-a",
        priority=10,
        tasks=[
            jobs_pb2.TaskSpec(
                name="trainer",
                command=["python", "train.py"],
                env={"EPOCHS": "3", "_PRIVATE": "x"},
                replicas=2,
                resources=jobs_pb2.ResourceRequest(
                    cpu=4,
                    memory_mib=8192,
                    accelerator=jobs_pb2.AcceleratorRequest(
                        kind=resources_pb2.DEVICE_KIND_GPU, count=2, models=["H100"]
                    ),
                ),
                estimated_duration_s=60,
                timeout_s=3600,
            ),
            jobs_pb2.TaskSpec(name="eval.v2", command=["python", "eval.py"]),
        ],
        constraints=jobs_pb2.Constraints(
            domains=[resources_pb2.DOMAIN_DATACENTER, resources_pb2.DOMAIN_CLOUD],
            sites=["dc-1"],
        ),
        labels={"team": "a"},
    )


def fields(violations: list[FieldViolation]) -> list[str]:
    return [v.field for v in violations]


def test_valid_spec_has_no_violations() -> None:
    """A spec that breaks no rule yields no violations and validates silently."""
    spec = valid_spec()
    assert spec_violations(spec) == []
    validate_spec(spec)


def _set(path: str, value: object) -> Mutation:
    """A mutation that sets a dotted attribute path of the spec."""

    def mutate(spec: jobs_pb2.JobSpec) -> None:
        *parents, last = path.split(".")
        target: object = spec
        for part in parents:
            target = (
                target.tasks[int(part[6:-1])]  # type: ignore[attr-defined]
                if part.startswith("tasks[")
                else getattr(target, part)
            )
        setattr(target, last, value)

    return mutate


def _call(fn: Callable[[jobs_pb2.JobSpec], object]) -> Mutation:
    def mutate(spec: jobs_pb2.JobSpec) -> None:
        fn(spec)

    return mutate


CASES: list[tuple[str, Mutation, str, str]] = [
    ("id-bad-chars", _set("id", "Train_1"), "spec.id", "not a valid name"),
    ("id-leading-dash", _set("id", "-train"), "spec.id", "not a valid name"),
    ("id-trailing-dot", _set("id", "train."), "spec.id", "not a valid name"),
    ("id-too-long", _set("id", "a" * 64), "spec.id", "64 characters long; at most 63"),
    ("tenant-bad", _set("tenant", "Team A"), "spec.tenant", "not a valid name"),
    ("name-missing", _set("name", ""), "spec.name", "is required"),
    ("name-too-long", _set("name", "x" * 64), "spec.name", "64 characters; at most 63"),
    ("priority-high", _set("priority", 1001), "spec.priority", "between -1000 and 1000"),
    ("priority-low", _set("priority", -1001), "spec.priority", "got -1001"),
    ("task-name-missing", _set("tasks[0].name", ""), "spec.tasks[0].name", "is required"),
    (
        "task-name-pattern",
        _set("tasks[0].name", "Trainer!"),
        "spec.tasks[0].name",
        "not a valid name",
    ),
    (
        "task-name-too-long",
        _set("tasks[1].name", "t" * 64),
        "spec.tasks[1].name",
        "at most 63",
    ),
    (
        "command-empty",
        _call(lambda s: s.tasks[0].ClearField("command")),
        "spec.tasks[0].command",
        "is empty",
    ),
    (
        "command-empty-program",
        _call(lambda s: s.tasks[0].command.__setitem__(0, "")),
        "spec.tasks[0].command",
        "is empty",
    ),
    (
        "command-too-long",
        _call(lambda s: s.tasks[0].command.append("x" * 64 * 1024)),
        "spec.tasks[0].command",
        "longer than 65536 bytes",
    ),
    (
        "env-key",
        _call(lambda s: s.tasks[0].env.__setitem__("1BAD", "v")),
        "spec.tasks[0].env",
        "'1BAD' is not a valid environment variable",
    ),
    (
        "retry-attempts-high",
        _set("tasks[0].retry.max_attempts", 101),
        "spec.tasks[0].retry.max_attempts",
        "between 0 and 100, got 101",
    ),
    (
        "retry-backoff-negative",
        _set("tasks[0].retry.backoff_s", -1.0),
        "spec.tasks[0].retry.backoff_s",
        "between 0 and 86400, got -1",
    ),
    (
        "retry-backoff-nan",
        _set("tasks[0].retry.backoff_s", float("nan")),
        "spec.tasks[0].retry.backoff_s",
        "got nan",
    ),
    (
        "retry-cap-below-backoff",
        _call(
            lambda s: s.tasks[0].retry.MergeFrom(
                jobs_pb2.RetryPolicy(backoff_s=60, max_backoff_s=5)
            )
        ),
        "spec.tasks[0].retry.max_backoff_s",
        "shorter than backoff_s (5 < 60)",
    ),
    (
        "stop-after-beyond-default-lost-after",
        _set("disconnect.stop_after_s", 61.0),
        "spec.disconnect.stop_after_s",
        "longer than lost_after_s (61 > 60): a replacement would run beside the cut-off copy",
    ),
    (
        "stop-after-beyond-lost-after",
        _call(
            lambda s: s.disconnect.MergeFrom(
                jobs_pb2.DisconnectPolicy(lost_after_s=20, stop_after_s=30)
            )
        ),
        "spec.disconnect.stop_after_s",
        "(30 > 20)",
    ),
    (
        "stop-after-negative",
        _set("disconnect.stop_after_s", -1.0),
        "spec.disconnect.stop_after_s",
        "between 0 and 10000000, got -1",
    ),
    (
        "replicas-high",
        _set("tasks[0].replicas", 1025),
        "spec.tasks[0].replicas",
        "between 0 and 1024, got 1025",
    ),
    (
        "cpu-negative",
        _set("tasks[0].resources.cpu", -1.0),
        "spec.tasks[0].resources.cpu",
        "got -1",
    ),
    (
        "cpu-high",
        _set("tasks[0].resources.cpu", 4096.5),
        "spec.tasks[0].resources.cpu",
        "between 0 and 4096",
    ),
    (
        "cpu-nan",
        _set("tasks[0].resources.cpu", float("nan")),
        "spec.tasks[0].resources.cpu",
        "got nan",
    ),
    (
        "cpu-inf",
        _set("tasks[0].resources.cpu", float("inf")),
        "spec.tasks[0].resources.cpu",
        "got inf",
    ),
    (
        "memory-high",
        _set("tasks[0].resources.memory_mib", 16 * 1024 * 1024 + 1),
        "spec.tasks[0].resources.memory_mib",
        "must be between 0 and",
    ),
    (
        "device-count-zero",
        _set("tasks[0].resources.accelerator.count", 0),
        "spec.tasks[0].resources.accelerator.count",
        "between 1 and 64, got 0",
    ),
    (
        "share-memory-without-fraction",
        _set("tasks[0].resources.accelerator.memory_mib", 4096),
        "spec.tasks[0].resources.accelerator.memory_mib",
        "give it with fraction",
    ),
    (
        "device-count-high",
        _set("tasks[0].resources.accelerator.count", 65),
        "spec.tasks[0].resources.accelerator.count",
        "got 65",
    ),
    (
        "device-kind-unknown",
        _set("tasks[0].resources.accelerator.kind", 42),
        "spec.tasks[0].resources.accelerator.kind",
        "unknown accelerator kind 42",
    ),
    (
        "device-kind-unspecified",
        _set("tasks[0].resources.accelerator.kind", resources_pb2.DEVICE_KIND_UNSPECIFIED),
        "spec.tasks[0].resources.accelerator.kind",
        "unknown accelerator kind 0",
    ),
    (
        "duration-negative",
        _set("tasks[0].estimated_duration_s", -1.0),
        "spec.tasks[0].estimated_duration_s",
        "between 0 and 1000000000",
    ),
    (
        "timeout-nan",
        _set("tasks[0].timeout_s", float("nan")),
        "spec.tasks[0].timeout_s",
        "got nan",
    ),
    (
        "duplicate-task",
        _set("tasks[1].name", "trainer"),
        "spec.tasks[1].name",
        "duplicate task 'trainer'",
    ),
    (
        "no-tasks",
        _call(lambda s: s.ClearField("tasks")),
        "spec.tasks",
        "at least one task",
    ),
    (
        "too-many-tasks",
        _call(
            lambda s: s.tasks.extend(
                jobs_pb2.TaskSpec(name=f"t{i}", command=["x"]) for i in range(63)
            )
        ),
        "spec.tasks",
        "at most 64 tasks",
    ),
    (
        "domain-unknown",
        _call(lambda s: s.constraints.domains.append(42)),  # type: ignore[arg-type]
        "spec.constraints.domains[2]",
        "unknown domain 42",
    ),
    (
        "domain-unspecified",
        _call(lambda s: s.constraints.domains.insert(0, resources_pb2.DOMAIN_UNSPECIFIED)),
        "spec.constraints.domains[0]",
        "unknown domain 0",
    ),
    (
        "site-name",
        _call(lambda s: s.constraints.sites.append("DC 2")),
        "spec.constraints.sites[1]",
        "not a valid name",
    ),
    (
        "too-many-labels",
        _call(lambda s: s.labels.update({f"k{i}": "v" for i in range(64)})),
        "spec.labels",
        "at most 64 labels",
    ),
    (
        "depends-on-unknown",
        _call(lambda s: s.tasks[1].depends_on.append("nope")),
        "spec.tasks[1].depends_on[0]",
        "no task 'nope' in this job",
    ),
    (
        "reads-output-without-depending",
        _call(lambda s: s.tasks[1].inputs.add(dataset="task:trainer")),
        "spec.tasks[1].inputs[0].dataset",
        "add it to depends_on",
    ),
    (
        "dependency-cycle",
        _call(
            lambda s: (
                s.tasks[0].depends_on.append("eval.v2"),
                s.tasks[1].depends_on.append("trainer"),
            )
        ),
        "spec.tasks",
        "dependency cycle: trainer -> eval.v2 -> trainer",
    ),
    (
        "image-short-name",
        _call(lambda s: setattr(s.tasks[1], "image", "busybox:1.36")),
        "spec.tasks[1].image",
        "does not name its registry",
    ),
    (
        "image-bad-tag",
        _call(lambda s: setattr(s.tasks[1], "image", "registry.example.org/tools:b@d")),
        "spec.tasks[1].image",
        "is not sha256: and 64 hex digits",
    ),
    (
        "image-upper-case",
        _call(lambda s: setattr(s.tasks[1], "image", "registry.example.org/Tools:1")),
        "spec.tasks[1].image",
        "repository 'Tools' is not valid",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "field", "text"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_each_rule_reports_exactly_its_field(mutate: Mutation, field: str, text: str) -> None:
    """Breaking one rule of a valid spec yields exactly one violation, on that field."""
    spec = valid_spec()
    mutate(spec)
    violations = spec_violations(spec)
    assert fields(violations) == [field]
    assert text in violations[0].description


@pytest.mark.parametrize(
    "name", ["a", "a" * 63, "a.b_c-d", "0", "9z"], ids=["one", "max", "punct", "digit", "mixed"]
)
def test_names_at_the_edges_of_the_pattern_are_accepted(name: str) -> None:
    """Ids and task names of one to 63 allowed characters are valid."""
    spec = valid_spec()
    spec.id = name
    spec.tasks[0].name = name
    assert spec_violations(spec) == []


@pytest.mark.parametrize(
    "image",
    [
        "registry.example.org/tools:1.2",
        "127.0.0.1:5000/team/tools",
        "localhost/tools@sha256:" + "0" * 64,
        "docker.io/library/busybox:1.36@sha256:" + "f" * 64,
    ],
)
def test_images_naming_their_registry_are_accepted(image: str) -> None:
    spec = valid_spec()
    spec.tasks[0].image = image
    assert spec_violations(spec) == []


def test_retries_and_a_stop_within_lost_after_are_accepted() -> None:
    spec = valid_spec()
    spec.tasks[0].retry.MergeFrom(
        jobs_pb2.RetryPolicy(max_attempts=5, backoff_s=5, max_backoff_s=5)
    )
    spec.disconnect.MergeFrom(jobs_pb2.DisconnectPolicy(lost_after_s=30, stop_after_s=30))
    assert spec_violations(spec) == []


def test_empty_id_and_tenant_are_allowed() -> None:
    """The id and tenant are optional: the coordinator fills them in."""
    spec = valid_spec()
    spec.id = ""
    spec.tenant = ""
    assert spec_violations(spec) == []


def test_accelerator_with_only_zero_fields_is_not_checked() -> None:
    """An accelerator message left at its defaults means no accelerator, not count 0."""
    spec = valid_spec()
    spec.tasks[0].resources.accelerator.Clear()
    assert spec.tasks[0].resources.HasField("accelerator")
    assert spec_violations(spec) == []


def test_bounds_are_inclusive() -> None:
    """Values exactly on each upper bound are accepted."""
    spec = valid_spec()
    task = spec.tasks[0]
    task.replicas = 1024
    task.resources.cpu = 4096
    task.resources.memory_mib = 16 * 1024 * 1024
    task.resources.accelerator.count = 64
    spec.priority = -1000
    spec.tasks.extend(jobs_pb2.TaskSpec(name=f"t{i}", command=["x"]) for i in range(62))
    assert len(spec.tasks) == 64
    assert spec_violations(spec) == []


def test_every_violation_is_reported_not_just_the_first() -> None:
    """A spec with many problems lists each of them, in field order."""
    spec = valid_spec()
    spec.id = "Bad Id"
    spec.name = ""
    spec.tasks[0].ClearField("command")
    spec.tasks[0].resources.cpu = -2
    spec.tasks[0].resources.accelerator.kind = 42  # type: ignore[assignment]
    spec.tasks[0].resources.accelerator.count = 0
    spec.tasks[1].name = "trainer"
    spec.tasks[1].replicas = 5000
    spec.constraints.domains.append(42)  # type: ignore[arg-type]
    assert fields(spec_violations(spec)) == [
        "spec.id",
        "spec.name",
        "spec.tasks[0].command",
        "spec.tasks[0].resources.cpu",
        "spec.tasks[0].resources.accelerator.kind",
        "spec.tasks[0].resources.accelerator.count",
        "spec.tasks[1].replicas",
        "spec.tasks[1].name",
        "spec.constraints.domains[2]",
    ]


def test_a_valid_task_checked_before_is_not_checked_again() -> None:
    """A sweep submits one task spec over and over: once found valid, it is not checked
    again, whatever job it comes in."""
    first, second = valid_spec(), valid_spec()
    second.name, second.id = "another job", "train-2"
    assert spec_violations(first) == []
    hits = _valid_task.cache_info().hits
    assert spec_violations(second, "specs[3]") == []
    assert _valid_task.cache_info().hits == hits + len(second.tasks)


def test_an_invalid_task_seen_before_is_reported_whole_at_its_new_place() -> None:
    first, second = valid_spec(), valid_spec()
    for spec in (first, second):
        spec.tasks[0].resources.cpu = -2
        spec.tasks[0].env["1st"] = "x"
    second.tasks.insert(0, jobs_pb2.TaskSpec(name="prepare", command=["true"]))
    assert fields(spec_violations(first, "specs[0]")) == [
        "specs[0].tasks[0].env",
        "specs[0].tasks[0].resources.cpu",
    ]
    again = spec_violations(second, "specs[7]")
    assert fields(again) == ["specs[7].tasks[1].env", "specs[7].tasks[1].resources.cpu"]
    assert again[1].description == "must be between 0 and 4096, got -2"


def test_a_task_too_large_to_keep_is_checked_all_the_same() -> None:
    spec = valid_spec()
    spec.tasks[0].env["LARGE"] = "x" * (MAX_CHECKED_TASK_BYTES + 1)
    looked_up = _looked_up()
    assert spec_violations(spec) == []
    spec.tasks[0].ClearField("command")
    assert fields(spec_violations(spec)) == ["spec.tasks[0].command"]
    assert _looked_up() == looked_up + 2  # the second, small task, in each check


def _looked_up() -> int:
    info = _valid_task.cache_info()
    return info.hits + info.misses


def test_validate_spec_raises_with_every_violation_under_the_given_path() -> None:
    """validate_spec raises InvalidArgumentError carrying all violations, prefixed by path."""
    spec = valid_spec()
    spec.name = ""
    spec.priority = 5000
    with pytest.raises(InvalidArgumentError) as caught:
        validate_spec(spec, "specs[3]")
    assert fields(list(caught.value.violations)) == ["specs[3].name", "specs[3].priority"]
    assert "specs[3].name: is required" in str(caught.value)


def test_too_many_tasks_validates_only_the_first_64() -> None:
    """Past the task limit, one violation is reported and the surplus tasks are not checked."""
    spec = valid_spec()
    spec.tasks.extend(jobs_pb2.TaskSpec(name=f"t{i}", command=["x"]) for i in range(62))
    spec.tasks.add(name="BAD NAME")  # the 65th task, beyond the limit
    assert fields(spec_violations(spec)) == ["spec.tasks"]


@pytest.mark.parametrize(
    "mutate",
    [
        _set("id", "train\n"),
        _set("tasks[0].name", "trainer\n"),
        _call(lambda s: s.constraints.sites.append("dc-2\n")),
        _call(lambda s: s.tasks[0].env.__setitem__("PATH\n", "v")),
    ],
    ids=["id", "task-name", "site", "env-key"],
)
def test_names_with_a_trailing_newline_are_rejected(mutate: Mutation) -> None:
    """A name or env key ending in a newline is not a valid name."""
    spec = valid_spec()
    mutate(spec)
    assert len(spec_violations(spec)) == 1


def test_bound_violation_shows_the_offending_value_exactly() -> None:
    """A memory request one MiB over the limit is reported with its exact value."""
    spec = valid_spec()
    spec.tasks[0].resources.memory_mib = 16 * 1024 * 1024 + 1
    (violation,) = spec_violations(spec)
    assert "got 16777217" in violation.description


def test_self_dependency_is_named_and_is_a_cycle() -> None:
    """A task depending on itself is reported where it says so, and as the cycle it makes."""
    spec = valid_spec()
    spec.tasks[0].depends_on.append("trainer")
    assert [(v.field, v.description) for v in spec_violations(spec)] == [
        ("spec.tasks[0].depends_on[0]", "a task cannot depend on itself"),
        ("spec.tasks", "dependency cycle: trainer -> trainer"),
    ]
