"""Declared outputs and the inputs that read them (``task:NAME.OUTPUT``): names only, no I/O.

See ``federation.coordinator.data.staged_inputs`` for how they travel between sites.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from federation.api.v1 import jobs_pb2
from federation.common.keys import DATASET

TASK_OUTPUT = "task:"
S3 = "s3://"
"""An input naming a registered dataset by its location; stored as ``dataset:NAME``."""
OUTPUT_NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9_-]{0,61}[a-z0-9])?$")
"""Output names: no '.', so "task:NAME.OUTPUT" splits at the last one."""
PROTOCOL = 4
"""The site-link protocol that carries outputs, staged inputs and URL signing."""


def source_of(
    dataset: str, specs: Mapping[str, jobs_pb2.TaskSpec]
) -> tuple[str, jobs_pb2.Output | None] | None:
    """For a ``task:`` input: the task it reads and the declared output staged from it (None
    for a task that declares none: the input only weighs on placement). None when ``dataset``
    names no task of ``specs`` (a plain dataset, or a bad one that validation reports)."""
    if not dataset.startswith(TASK_OUTPUT):
        return None
    name = dataset.removeprefix(TASK_OUTPUT)
    if (spec := specs.get(name)) is not None:
        return name, spec.outputs[0] if len(spec.outputs) == 1 else None
    task, _, output = name.rpartition(".")
    if (spec := specs.get(task)) is None:
        return None
    found = next((o for o in spec.outputs if o.name == output), None)
    return (task, found) if found is not None else None


def names_dataset(reference: str) -> bool:
    """Whether a task input names a registered dataset (by name or by location)."""
    return reference.startswith((DATASET, S3))


def staged(spec: jobs_pb2.TaskSpec, specs: Mapping[str, jobs_pb2.TaskSpec]) -> bool:
    """Whether any input of ``spec`` is an output or a dataset to stage (most tasks: none)."""
    return any(
        i.dataset.startswith(DATASET)
        or ((found := source_of(i.dataset, specs)) is not None and found[1] is not None)
        for i in spec.inputs
    )


def in_job_folder(key: str, tenant: str, job_id: str, task: str) -> bool:
    """Whether ``key`` ends ``TENANT/JOB/TASK/EPOCH/OUTPUT``: an object of this job."""
    parts = key.split("/")
    depth = len(task.split("/"))
    if ".." in parts or len(parts) < 4 + depth:
        return False
    head = parts[-(4 + depth) :]
    return (
        head[0] == (tenant or "_") and head[1] == job_id and head[2 : 2 + depth] == task.split("/")
    )
