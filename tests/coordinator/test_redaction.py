"""Env values redacted: every one, whatever the number of names."""

from __future__ import annotations

from federation.api.v1 import jobs_pb2
from federation.coordinator.jobs.redaction import REDACTED, redact_env


def test_every_env_value_is_redacted_and_every_name_kept() -> None:
    """A protobuf map set while it is walked skips keys: with upb, most jobs of a few dozen
    names kept a value or more before the names were listed first."""
    for count in range(1, 40):
        job = jobs_pb2.Job()
        for task_index in range(3):
            task = job.spec.tasks.add(name=f"t{task_index}")
            for i in range(count):
                task.env[f"SECRET_{task_index}_{i}"] = f"value-{i}"
        redact_env(job)
        for task_index, task in enumerate(job.spec.tasks):
            assert dict(task.env) == {f"SECRET_{task_index}_{i}": REDACTED for i in range(count)}, (
                count
            )
