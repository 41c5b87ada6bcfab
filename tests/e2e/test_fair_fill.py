"""A fleet that frees all at once goes to the queues by weight, over real agents.

Every queue waits with more jobs than the scheduler tries at once when room frees (its front of
the line) while jobs in no queue hold every GPU of three sites; then those all end together.
Twice the fill went wrong this way: the front was taken in fair order without counting what
each job it took would hold, so the queue with the smallest share filled all of it and took
every GPU it could borrow; and room a task's reservation held at a site it did not choose went
to whichever waiting task's retry timer came due first."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2
from federation.coordinator.scheduling.config import FRONT_OF_LINE
from federation.local import LocalFederation

from .conftest import admin, channel_as, gpu_site, jobs, running, tenant_tls, until
from .test_queues import gpu_job, queue, states

pytestmark = pytest.mark.xdist_group("e2e-fair-fill")

SITES = [gpu_site("ff-a", 4), gpu_site("ff-b", 4), gpu_site("ff-h", 4, "H100-80GB")]
GPUS = 12
WEIGHTS = {"team-a": 1.0, "team-b": 1.0, "team-c": 2.0}
RUNNING = jobs_pb2.JOB_STATE_RUNNING


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    root = tmp_path_factory.mktemp("fair-fill")
    with running(root / "fed", SITES) as fed:
        yield fed


async def test_a_fleet_freed_at_once_fills_by_weight(
    federation: LocalFederation, operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    total = sum(WEIGHTS.values())
    fair = {t: GPUS * w / total for t, w in WEIGHTS.items()}  # 3, 3 and 6
    for tenant, weight in WEIGHTS.items():
        # Each may borrow up to the whole fleet: only fair share keeps the split.
        limits = ("gpu", fair[tenant], GPUS - fair[tenant])
        made = queue(f"q-{tenant}", tenant, limits, weight=weight)
        await admin(operator).CreateQueue(admin_service_pb2.CreateQueueRequest(queue=made))
    release, go = tmp_path / "release", tmp_path / "go"
    holds = [gpu_job(f"hold{i}", "", release) for i in range(GPUS)]
    reply = await jobs(operator).SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=holds))
    hold_ids = [j.id for j in reply.jobs]

    async def held() -> bool:
        return list((await states(operator, hold_ids)).values()).count(RUNNING) == GPUS

    await until(held, "every GPU held by a job in no queue")
    async with (
        channel_as(federation, tenant_tls(federation, "team-a")) as a,
        channel_as(federation, tenant_tls(federation, "team-b")) as b,
        channel_as(federation, tenant_tls(federation, "team-c")) as c,
    ):
        many = FRONT_OF_LINE + 8  # more than the front of the line in every queue
        replies = await asyncio.gather(
            *(
                jobs(channel).SubmitJobs(
                    job_service_pb2.SubmitJobsRequest(
                        specs=[gpu_job(f"{t}-{i}", f"q-{t}", go) for i in range(many)]
                    )
                )
                for t, channel in zip(WEIGHTS, (a, b, c), strict=True)
            )
        )
        owner = {j.id for r in replies for j in r.jobs}
        last = [r.jobs[-1].id for r in replies]

        async def all_waiting() -> bool:
            found = [
                (await jobs(operator).GetJob(job_service_pb2.GetJobRequest(job_id=i))).job
                for i in last
            ]
            return all(j.tasks[0].reason.startswith("no site can take it now") for j in found)

        await until(all_waiting, "every queue's last job found no room")
        release.touch()

        async def running_by_queue() -> Counter[str]:
            request = job_service_pb2.ListJobsRequest(states=[RUNNING], page_size=1000)
            listed = (await jobs(operator).ListJobs(request)).jobs
            return Counter(j.spec.queue for j in listed if j.id in owner)

        async def filled() -> bool:
            return sum((await running_by_queue()).values()) == GPUS

        await until(filled, "every GPU running a queue's job")
        split = await running_by_queue()
        assert split == Counter({f"q-{t}": int(n) for t, n in fair.items()}), split
        go.touch()
