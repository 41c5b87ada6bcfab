"""Registry logins for a task's image: checked at their fields, redacted for every reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from federation.api.v1 import jobs_pb2, records_pb2
from federation.coordinator.jobs.redaction import REDACTED, for_reader, redact_for_reader
from federation.coordinator.jobs.retention import _archived
from federation.coordinator.jobs.validation import spec_violations
from federation.jobspec import load_job_specs
from federation.security.identity import Identity, Role

PASSWORD = "s3cret-token-42"
TENANT = Identity(Role.TENANT, "team-a")
OPERATOR = Identity(Role.OPERATOR, "ops")


def _spec(
    *secrets: jobs_pb2.ImagePullSecret, image: str = "r.example.org/team/t:1"
) -> jobs_pb2.JobSpec:
    task = jobs_pb2.TaskSpec(
        name="t",
        command=["id"],
        image=image,
        env={"TOKEN": "env-value"},
        image_pull_secrets=secrets,
    )
    return jobs_pb2.JobSpec(id="j", name="j", tenant="team-a", tasks=[task])


def _login(**fields: str) -> jobs_pb2.ImagePullSecret:
    return jobs_pb2.ImagePullSecret(
        **{"registry": "r.example.org", "username": "bot", "password": PASSWORD, **fields}
    )


def test_a_whole_login_is_accepted() -> None:
    assert spec_violations(_spec(_login(), _login(registry="127.0.0.1:5000"))) == []


@pytest.mark.parametrize(
    ("login", "field", "words"),
    [
        (_login(registry=""), "registry", "is required"),
        (_login(registry="https://r.example.org"), "registry", "not a host name"),
        (_login(username=""), "username", "is required"),
        (_login(username="a:b"), "username", "without ':'"),
        (_login(password=""), "password", "is required"),
        (_login(password="a\nb"), "password", "printable"),
        (_login(password=REDACTED), "password", "give the password itself"),
    ],
)
def test_a_malformed_login_is_refused_at_its_field(
    login: jobs_pb2.ImagePullSecret, field: str, words: str
) -> None:
    (violation,) = spec_violations(_spec(login))
    assert violation.field == f"spec.tasks[0].image_pull_secrets[0].{field}"
    assert words in violation.description
    assert PASSWORD not in violation.description


def test_logins_need_an_image_and_one_per_registry() -> None:
    fields = [v.field for v in spec_violations(_spec(_login(), _login(), image=""))]
    assert fields == [
        "spec.tasks[0].image_pull_secrets",
        "spec.tasks[0].image_pull_secrets[1].registry",
    ]


def _job() -> jobs_pb2.Job:
    return jobs_pb2.Job(id="j", spec=_spec(_login()), submitted_by=str(TENANT))


@pytest.mark.parametrize("reader", [TENANT, OPERATOR], ids=["tenant", "operator"])
def test_every_reader_sees_the_password_redacted(reader: Identity) -> None:
    job = _job()
    shown = for_reader(reader, job)
    (secret,) = shown.spec.tasks[0].image_pull_secrets
    assert (secret.registry, secret.username, secret.password) == ("r.example.org", "bot", REDACTED)
    assert job.spec.tasks[0].image_pull_secrets[0].password == PASSWORD  # the stored job keeps it
    # env values stay the tenant's to read
    assert (shown.spec.tasks[0].env["TOKEN"] == "env-value") == (reader is TENANT)
    listed = [_job()]
    redact_for_reader(reader, listed)
    assert PASSWORD not in str(listed[0])


def test_the_archive_holds_no_password() -> None:
    line = _archived(records_pb2.JobRecord(job=_job()))
    assert PASSWORD not in line
    assert REDACTED in json.dumps(json.loads(line))


def test_yaml_gives_logins_by_their_field_names(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(
        "name: c\ntasks:\n"
        "  - name: a\n    image: r.example.org/team/t:1\n    command: [id]\n"
        "    image_pull_secrets:\n"
        f"      - {{registry: r.example.org, username: bot, password: {PASSWORD}}}\n"
    )
    (spec,) = load_job_specs(path)
    assert spec.tasks[0].image_pull_secrets[0] == _login()
    assert spec_violations(spec) == []
