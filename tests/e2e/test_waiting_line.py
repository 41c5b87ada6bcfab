"""The waiting line: freed capacity goes to the highest priority, then the earliest submitted,
never to whichever task's retry timer comes due first (nor by job id)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.local import LocalFederation, SiteSpec

from .conftest import jobs, python_task, running, spec, until_event, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-waiting-line")

ONE_SLOT = SiteSpec("one-slot", "datacenter", nodes=[{"name": "n", "cpu_cores": 1}])


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    with running(tmp_path_factory.mktemp("line"), [ONE_SLOT]) as federation:
        yield federation


@pytest_asyncio.fixture
async def operator(fed: LocalFederation) -> AsyncIterator[grpc.aio.Channel]:
    async with fed.operator().channel() as channel:
        yield channel


async def test_priority_then_submission_order(operator: grpc.aio.Channel, tmp_path: Path) -> None:
    stub = jobs(operator)
    go = tmp_path / "go"
    wait = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"
    one_cpu = {"resources": {"cpu": 1}}
    blocker = spec("blocker", [python_task("t", wait, **one_cpu)], id="blocker")
    await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=blocker))
    await wait_for_job(operator, "blocker", until=frozenset({jobs_pb2.JOB_STATE_RUNNING}))
    # Ids sort the other way round from the line, so an id-ordered line would fail.
    waiting = [("a-low", -1000), ("z-first", 0), ("b-second", 0), ("y-high", 1000)]
    for job_id, priority in waiting:
        job = spec(job_id, [python_task("t", "pass", **one_cpu)], id=job_id, priority=priority)
        await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))
        await asyncio.sleep(0.05)

    def fit_nowhere(event: jobs_pb2.JobEvent) -> bool:
        return event.task == "t" and "no site can take it now" in event.reason

    for job_id, _ in waiting:  # each was tried and fit nowhere: each waits on a retry timer
        seen = await until_event(operator, job_id, fit_nowhere, f"{job_id} tried")
        assert seen.job.state == jobs_pb2.JOB_STATE_PENDING
    go.touch()
    finished = [await wait_for_job(operator, job_id) for job_id, _ in waiting]
    assert all(j.state == jobs_pb2.JOB_STATE_SUCCEEDED for j in finished)
    started = sorted(finished, key=lambda j: j.tasks[0].started_at.ToNanoseconds())
    assert [j.id for j in started] == ["y-high", "z-first", "b-second", "a-low"]
