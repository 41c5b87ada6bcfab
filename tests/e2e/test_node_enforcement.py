"""The node has the final say: a task runs only on a node that meets what it requires."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.local import LocalFederation, SiteSpec

from .conftest import jobs, python_task, running, spec, until_event, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-node-enforcement")

# "a-plain" comes first in every tie, so a packer that ignored requirements would pick it.
SITE = SiteSpec(
    "mixed",
    "datacenter",
    nodes=[
        {"name": "a-plain", "cpu_cores": 4, "memory_mib": 8192},
        {
            "name": "b-cuda",
            "cpu_cores": 4,
            "memory_mib": 8192,
            "labels": {"cuda": "12.4", "torch": "2.4.1"},
        },
    ],
)


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    """This module's own federation (``operator`` from conftest connects to it)."""
    with running(tmp_path_factory.mktemp("nodes"), [SITE]) as fed:
        yield fed


@pytest.mark.parametrize(
    ("name", "task", "extra"),
    [
        ("needs-cuda", {"requires": {"cuda": ">=12.1"}}, {}),
        ("needs-torch", {}, {"constraints": {"node_labels": {"torch": "2.4.1"}}}),
    ],
)
async def test_task_runs_on_the_node_that_qualifies(
    operator: grpc.aio.Channel, name: str, task: dict[str, object], extra: dict[str, object]
) -> None:
    """Each task goes to the one node that meets it, though the other node is free and first
    in every tie; the job records the node of each replica."""
    job_spec = spec(name, [python_task("t", "print('ok')", **task)], **extra)
    reply = await jobs(operator).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job_spec))
    job = await wait_for_job(operator, reply.job.id)
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, job.tasks[0].reason
    assert list(job.tasks[0].nodes) == ["b-cuda"]


async def test_no_qualifying_node_leaves_the_task_pending_with_the_node_reason(
    operator: grpc.aio.Channel,
) -> None:
    """A requirement no node meets keeps the task PENDING; the reason names it."""
    job_spec = spec("needs-cuda-13", [python_task("t", "print()", requires={"cuda": ">=13"})])
    stub = jobs(operator)
    reply = await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=job_spec))

    def held_for_cuda(event: jobs_pb2.JobEvent) -> bool:
        return event.state == jobs_pb2.JOB_STATE_PENDING and "cuda" in event.reason

    # The scheduler has tried it: it recorded the task PENDING with the sites' verdicts.
    seen = await until_event(operator, reply.job.id, held_for_cuda, "the scheduler's verdicts")
    job = seen.job
    assert job.state == jobs_pb2.JOB_STATE_PENDING
    task = job.tasks[0]
    reasons = [task.reason, *(v.reason for v in task.verdicts)]
    assert any("cuda" in reason and "13" in reason for reason in reasons), reasons
    assert [v.site for v in task.verdicts] == ["mixed"]
    assert (task.site, list(task.nodes), task.epoch) == ("", [], 0)  # never offered anywhere
    assert all(e.state == jobs_pb2.JOB_STATE_PENDING for e in seen.events), seen.events
    await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=reply.job.id))
