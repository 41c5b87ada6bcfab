"""Validation of service tasks: each bad field refused with its path."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from federation.api.v1 import jobs_pb2
from federation.coordinator.jobs.validation import spec_violations

Mutation = Callable[[jobs_pb2.TaskSpec], object]


def service_spec() -> jobs_pb2.JobSpec:
    """A job with a batch task and a service using every field of its policy, all valid."""
    policy = jobs_pb2.ServicePolicy(
        restart=jobs_pb2.ServicePolicy.RESTART_ON_FAILURE,
        backoff_s=0.5,
        max_backoff_s=30,
        min_run_s=5,
        crash_loop_after=3,
        readiness=jobs_pb2.ReadinessCheck(http_path="/healthz", period_s=2, timeout_s=1),
        max_unavailable=2,
        near_region="eu-west",
    )
    return jobs_pb2.JobSpec(
        name="serve",
        tasks=[
            jobs_pb2.TaskSpec(name="prepare", command=["prep"]),
            jobs_pb2.TaskSpec(
                name="web",
                command=["serve"],
                replicas=2,
                kind=jobs_pb2.TASK_KIND_SERVICE,
                service=policy,
                depends_on=["prepare"],
            ),
        ],
    )


def web(mutate: Mutation) -> Callable[[jobs_pb2.JobSpec], object]:
    return lambda spec: mutate(spec.tasks[1])


P = "spec.tasks[1]"
CASES: list[tuple[str, Callable[[jobs_pb2.JobSpec], object], str, str]] = [
    ("unknown-kind", web(lambda t: setattr(t, "kind", 7)), f"{P}.kind", "unknown kind 7"),
    (
        "unknown-restart",
        web(lambda t: setattr(t.service, "restart", 9)),
        f"{P}.service.restart",
        "unknown policy 9; expected always or on_failure",
    ),
    (
        "policy-on-batch",
        lambda s: s.tasks[0].service.SetInParent(),
        "spec.tasks[0].service",
        "only for a task of kind service",
    ),
    ("port-high", web(lambda t: setattr(t.service, "port", 65536)), f"{P}.service.port", "65535"),
    (
        "tcp-port-zero",
        web(lambda t: setattr(t.service.readiness, "tcp_port", 0)),
        f"{P}.service.readiness.tcp_port",
        "between 1 and 65535, got 0",
    ),
    (
        "tcp-port-high",
        web(lambda t: setattr(t.service.readiness, "tcp_port", 70000)),
        f"{P}.service.readiness.tcp_port",
        "got 70000",
    ),
    (
        "http-path-relative",
        web(lambda t: setattr(t.service.readiness, "http_path", "healthz")),
        f"{P}.service.readiness.http_path",
        "starting with '/'",
    ),
    (
        "command-empty",
        web(lambda t: t.service.readiness.command.SetInParent()),
        f"{P}.service.readiness.command.argv",
        "is empty",
    ),
    (
        "backoff-nan",
        web(lambda t: setattr(t.service, "backoff_s", float("nan"))),
        f"{P}.service.backoff_s",
        "got nan",
    ),
    (
        "backoff-negative",
        web(lambda t: setattr(t.service, "backoff_s", -1.0)),
        f"{P}.service.backoff_s",
        "got -1",
    ),
    (
        "max-backoff-inf",
        web(lambda t: setattr(t.service, "max_backoff_s", float("inf"))),
        f"{P}.service.max_backoff_s",
        "got inf",
    ),
    (
        "max-below-backoff",
        web(lambda t: setattr(t.service, "max_backoff_s", 0.1)),
        f"{P}.service.max_backoff_s",
        "shorter than backoff_s",
    ),
    (
        "period-negative",
        web(lambda t: setattr(t.service.readiness, "period_s", -2.0)),
        f"{P}.service.readiness.period_s",
        "got -2",
    ),
    (
        "max-unavailable-over-replicas",
        web(lambda t: setattr(t.service, "max_unavailable", 3)),
        f"{P}.service.max_unavailable",
        "between 0 and 2, got 3",
    ),
    (
        "service-timeout",
        web(lambda t: setattr(t, "timeout_s", 60.0)),
        f"{P}.timeout_s",
        "runs until it is cancelled",
    ),
    (
        "service-retry",
        web(lambda t: t.retry.SetInParent()),
        f"{P}.retry",
        "restarted by service.restart",
    ),
    (
        "service-spread",
        web(lambda t: t.spread.SetInParent()),
        f"{P}.spread",
        "run at one site",
    ),
    (
        "batch-after-service",
        lambda s: s.tasks.add(name="report", command=["r"], depends_on=["web"]),
        "spec.tasks[2].depends_on[0]",
        "'web' is a service, which never succeeds",
    ),
]


def test_a_valid_service_has_no_violations() -> None:
    assert spec_violations(service_spec()) == []


@pytest.mark.parametrize(
    ("mutate", "field", "text"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_each_service_rule_reports_its_field(
    mutate: Callable[[jobs_pb2.JobSpec], object], field: str, text: str
) -> None:
    spec = service_spec()
    mutate(spec)
    violations = spec_violations(spec)
    assert [v.field for v in violations] == [field]
    assert text in violations[0].description


@pytest.mark.parametrize(
    "check",
    [
        jobs_pb2.ReadinessCheck(tcp_port=1),
        jobs_pb2.ReadinessCheck(tcp_port=65535),
        jobs_pb2.ReadinessCheck(command=jobs_pb2.CommandCheck(argv=["true"])),
    ],
    ids=["tcp-1", "tcp-65535", "command"],
)
def test_other_readiness_checks_are_accepted(check: jobs_pb2.ReadinessCheck) -> None:
    spec = service_spec()
    spec.tasks[1].service.readiness.CopyFrom(check)
    assert spec_violations(spec) == []
