"""What placement is asked for a task (its request, with the inputs its dependencies and its
checkpoint add) and the estimates it answers, as messages."""

from __future__ import annotations

import functools
from typing import Any

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.coordinator.data.outputs import source_of
from federation.coordinator.jobs.records import find_spec
from federation.coordinator.jobs.validation import TASK_OUTPUT
from federation.coordinator.scheduling.config import CHECKPOINT
from federation.coordinator.scheduling.waits import Wait
from federation.placement.estimates import Estimates
from federation.placement.request import Input, Request


def once_free(estimate: jobs_pb2.Estimate, wait: Wait | None) -> jobs_pb2.Estimate:
    """A busy site's estimate once room frees there, the predicted wait as its queue time."""
    if wait is None:
        return estimate
    return copy_estimate(
        estimate,
        queue_s=wait.wait_s,
        run_s=wait.waiter.run_s,
        total_s=wait.finish_s,
        device_speed=wait.waiter.speed,
    )


def copy_estimate(estimate: jobs_pb2.Estimate, **changes: Any) -> jobs_pb2.Estimate:
    copy = jobs_pb2.Estimate()
    copy.CopyFrom(estimate)
    for name, value in changes.items():
        setattr(copy, name, value)
    return copy


def waiting_on(job: jobs_pb2.Job, task_name: str) -> list[str]:
    """Dependencies of a task that have not succeeded yet."""
    spec = find_spec(job, task_name)
    states = {t.name: t.state for t in job.tasks}
    return [d for d in spec.depends_on if states.get(d) != job_state.SUCCEEDED]


def request_for(job: jobs_pb2.Job, task_name: str) -> Request | None:
    """The placement request for a task, or None while it waits for its dependencies.

    The outputs of the tasks it depends on become its inputs, located where those ran, and so
    does the task's newest recorded checkpoint, which a restart reads.
    """
    specs = {t.name: t for t in job.spec.tasks}
    spec = specs[task_name]
    if spec.depends_on and waiting_on(job, task_name):
        return None
    status = {t.name: t for t in job.tasks}
    inputs = [
        Input(i.dataset, i.bytes, i.site)
        for i in spec.inputs
        if not i.dataset.startswith(TASK_OUTPUT)
    ]
    for dep in spec.depends_on:
        size = specs[dep].output_bytes
        for i in spec.inputs:  # an explicit "task:NAME[.OUTPUT]" input may give the size
            if i.bytes and (found := source_of(i.dataset, specs)) is not None and found[0] == dep:
                size = i.bytes
        if stored := sum(a.bytes for a in status[dep].artifacts):
            size = stored  # what its site reported storing
        if size:
            inputs.append(Input(TASK_OUTPUT + dep, size, status[dep].site))
    checkpoint = status[task_name].checkpoint
    if checkpoint.path and checkpoint.bytes:
        # A restart reads its newest checkpoint from the site that holds it.
        inputs.append(Input(CHECKPOINT + task_name, checkpoint.bytes, checkpoint.site))
    return _request(
        spec.SerializeToString(deterministic=True),
        job.spec.constraints.SerializeToString(deterministic=True),
        job.spec.objective.SerializeToString(deterministic=True),
        tuple(inputs),
    )


@functools.lru_cache(maxsize=4096)
def _request(
    task: bytes, constraints: bytes, objective: bytes, inputs: tuple[Input, ...]
) -> Request:
    """``Request.from_spec`` by what it reads: the tasks of job arrays share one, and a key
    costs a seventh of building a request."""
    job = jobs_pb2.JobSpec(
        constraints=jobs_pb2.Constraints.FromString(constraints),
        objective=jobs_pb2.Objective.FromString(objective),
    )
    return Request.from_spec(job, jobs_pb2.TaskSpec.FromString(task), inputs)


def estimate_proto(estimates: Estimates, site: int) -> jobs_pb2.Estimate:
    return jobs_pb2.Estimate(
        queue_s=float(estimates.queue_s[site]),
        transfer_s=float(estimates.transfer_s[site]),
        run_s=float(estimates.run_s[site]),
        total_s=float(estimates.total_s[site]),
        cost_usd=float(estimates.cost_usd[site]),
        energy_kwh=float(estimates.energy_kwh[site]),
        transfer_bytes=int(estimates.transfer_bytes[site]),
        device_speed=float(estimates.device_speed[site]),
        provision_s=float(estimates.provision_s[site]),
        pull_s=float(estimates.pull_s[site]),
        pull_bytes=int(estimates.pull_bytes[site]),
        image_held=bool(estimates.image_held[site]),
    )
