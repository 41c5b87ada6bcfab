"""Quotas of one site and of one device model, over real agents: the coordinator offers a task
only where its queue's quotas leave room, and a task that accepts two models is counted by
the one it runs on (listing a second model no longer sidesteps a model quota)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2, queues_pb2
from federation.local import LocalFederation, SiteSpec

from .conftest import (
    admin,
    channel_as,
    gpu_site,
    jobs,
    python_task,
    running,
    spec,
    tenant_tls,
    until,
    wait_for_job,
)
from .test_cli import fedctl

pytestmark = pytest.mark.xdist_group("e2e-scoped-quotas")

A100, H100 = "A100-80GB", "H100-80GB"
MIXED = SiteSpec(
    "sq-mixed",
    "datacenter",
    nodes=[
        {
            "name": "box",
            "cpu_cores": 64,
            "memory_mib": 524288,
            "devices": [
                {"kind": "GPU", "vendor": "nvidia", "model": m, "memory_mib": 81920, "count": 2}
                for m in (A100, H100)
            ],
        }
    ],
)
SLOW = gpu_site("sq-slow", 2, "V100")  # placement prefers the mixed site's faster devices
RUNNING = jobs_pb2.JOB_STATE_RUNNING


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    with running(tmp_path_factory.mktemp("scoped"), [MIXED, SLOW]) as fed:
        yield fed


def gpu_job(
    name: str, queue: str, go: Path, models: list[str], **extra: object
) -> jobs_pb2.JobSpec:
    """A one-GPU job (of ``models``, any if empty) that runs until ``go`` exists."""
    wait = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"
    gpu = {"kind": "GPU", "count": 1, "models": models}
    task = python_task("t", wait, resources={"accelerator": gpu}, estimated_duration_s=100)
    return spec(name, [task], queue=queue, **extra)


async def submit(channel: grpc.aio.Channel, specs: list[jobs_pb2.JobSpec]) -> list[str]:
    reply = await jobs(channel).SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=specs))
    return [j.id for j in reply.jobs]


async def get(channel: grpc.aio.Channel, ids: list[str]) -> list[jobs_pb2.Job]:
    stub = jobs(channel)
    return [(await stub.GetJob(job_service_pb2.GetJobRequest(job_id=i))).job for i in ids]


async def all_running(channel: grpc.aio.Channel, ids: list[str]) -> list[jobs_pb2.Job]:
    """Once every job of ``ids`` runs with its devices reported: the jobs then."""

    async def check() -> bool:
        return all(
            j.tasks[0].state == RUNNING and j.tasks[0].models for j in await get(channel, ids)
        )

    await until(check, "the jobs running with their devices reported")
    return await get(channel, ids)


async def all_succeed(channel: grpc.aio.Channel, ids: list[str]) -> None:
    finished = [await wait_for_job(channel, i) for i in ids]
    assert [j.state for j in finished] == [jobs_pb2.JOB_STATE_SUCCEEDED] * len(ids)


async def create(operator: grpc.aio.Channel, queue: queues_pb2.Queue) -> None:
    await admin(operator).CreateQueue(admin_service_pb2.CreateQueueRequest(queue=queue))


async def test_a_site_quota_sends_the_rest_elsewhere(
    federation: LocalFederation, operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """At most one GPU at sq-mixed: of three jobs that would all rather run there (its four
    GPUs are free and faster), one does and two go to the slower site; a fourth that may run
    only there waits, saying which quota holds it."""
    quota = queues_pb2.Quota(resource="gpu", nominal=1, site="sq-mixed")
    await create(operator, queues_pb2.Queue(name="per-site", tenant="team-s", quotas=[quota]))
    go = tmp_path / "go"
    async with channel_as(federation, tenant_tls(federation, "team-s")) as channel:
        ids = await submit(channel, [gpu_job(f"s-{i}", "per-site", go, []) for i in range(3)])
        seen = await all_running(channel, ids)
        assert Counter(j.tasks[0].site for j in seen) == {"sq-mixed": 1, "sq-slow": 2}
        pinned = gpu_job("pinned", "per-site", go, [], constraints={"sites": ["sq-mixed"]})
        [waiting] = await submit(channel, [pinned])
        words = "sq-mixed: queue per-site at its gpu at site sq-mixed quota (1/1)"

        async def says_why() -> bool:
            return words in (await get(channel, [waiting]))[0].tasks[0].reason

        await until(says_why, "the pinned job to wait for its site quota")
        request = job_service_pb2.ExplainJobRequest(job_id=waiting)
        explained = await jobs(channel).ExplainJob(request)
        [held_back] = explained.tasks[0].held_back
        assert (held_back.site, held_back.stage) == ("sq-mixed", "Quota")
        assert held_back.reason.startswith(words.removeprefix("sq-mixed: "))
        go.touch()
        await all_succeed(channel, [*ids, waiting])


async def test_a_model_quota_counts_the_model_given(
    federation: LocalFederation, operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """At most one H100: three jobs that accept an A100 or an H100, at the site that has two
    of each, get one H100 and two A100s (the site alone would give the faster H100s first)."""
    quota = queues_pb2.Quota(resource=f"gpu/{H100}", nominal=1)
    await create(operator, queues_pb2.Queue(name="per-model", tenant="team-m", quotas=[quota]))
    go = tmp_path / "go"
    pinned = {"constraints": {"sites": ["sq-mixed"]}}
    specs = [gpu_job(f"m-{i}", "per-model", go, [A100, H100], **pinned) for i in range(3)]
    async with channel_as(federation, tenant_tls(federation, "team-m")) as channel:
        ids = await submit(channel, specs)
        seen = await all_running(channel, ids)
        assert Counter(m for j in seen for m in j.tasks[0].models) == {H100: 1, A100: 2}
        reply = await admin(operator).ListQueues(admin_service_pb2.ListQueuesRequest())
        status = next(q for q in reply.queues if q.queue.name == "per-model")
        assert status.usage[f"gpu/{H100}"] == 1
        go.touch()
        await all_succeed(channel, ids)


def test_fedctl_writes_and_shows_scoped_quotas(federation: LocalFederation) -> None:
    made = fedctl(
        federation,
        "queues",
        "create",
        "cli-scoped",
        "--tenant",
        "t",
        "--quota",
        "gpu@site/sq-mixed=2",
        "--quota",
        "gpu@domain/cloud=1+1",
    )
    assert made.returncode == 0, made.stderr
    table = fedctl(federation, "queues", "list").stdout
    assert "gpu at site sq-mixed 0/2" in table
    assert "gpu in domain cloud 0/1+1" in table
    bad = fedctl(
        federation, "queues", "create", "cli-bad", "--tenant", "t", "--quota", "gpu@planet/x=1"
    )
    assert bad.returncode != 0
    assert "@site/NAME or @domain/edge|datacenter|cloud" in bad.stderr
    bad = fedctl(
        federation, "queues", "create", "cli-bad", "--tenant", "t", "--quota", "gpu@domain/moon=1"
    )
    assert bad.returncode != 0
    assert "--quota 'gpu@domain/moon=1'" in bad.stderr
