"""Queues over real agents: quotas hold (also under concurrent batches), borrowing what others
leave idle, fair share by weight, priority classes, and bad queues refused with the field.

Each test runs on the embedded store and on etcd (one coordinator under a key prefix of its own
in the run's shared etcd), except those that check only validation or the CLI."""

from __future__ import annotations

import asyncio
import io
import json
import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from rich.console import Console

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2, queues_pb2
from federation.cli.explain import explanation_table
from federation.cli.queues import queues_table
from federation.local import LocalFederation
from federation.testing.cluster import etcd_coordinator_args

from .conftest import (
    admin,
    channel_as,
    etcd_prefix,
    gpu_site,
    jobs,
    python_task,
    running,
    spec,
    tenant_tls,
    until,
    until_event,
    wait_for_job,
)
from .test_cli import fedctl
from .test_refusals import violations

pytestmark = pytest.mark.xdist_group("e2e-queues")

GPUS = 4
SITE = gpu_site("gpu-q", GPUS)
RUNNING = jobs_pb2.JOB_STATE_RUNNING


@pytest.fixture(scope="module", params=["sqlite", "etcd"])
def federation(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalFederation]:
    root = tmp_path_factory.mktemp(f"queues-{request.param}")
    config = root / "coordinator.toml"
    config.write_text(
        '[priority_classes.urgent]\nvalue = 900\nmay_preempt = true\ntenants = ["tenant-y"]\n'
        "[priority_classes.batch]\nvalue = -100\n"
    )
    args = ["--config", str(config)]
    if request.param == "etcd":
        etcd = request.getfixturevalue("shared_etcd")
        args += etcd_coordinator_args(etcd.endpoint, etcd_prefix(), 3.0)
    with running(root / "fed", [SITE], args) as fed:
        yield fed


# Validation and the CLI do not depend on the store: once is enough.
SQLITE_ONLY = pytest.mark.parametrize("federation", ["sqlite"], indirect=True)
ETCD_ONLY = pytest.mark.parametrize("federation", ["etcd"], indirect=True)


def queue(name: str, tenant: str, *quotas: tuple[str, float, float], **extra: object):  # type: ignore[no-untyped-def]
    return queues_pb2.Queue(
        name=name,
        tenant=tenant,
        quotas=[queues_pb2.Quota(resource=r, nominal=n, borrowing_limit=b) for r, n, b in quotas],
        **extra,  # type: ignore[arg-type]
    )


def gpu_job(name: str, queue_name: str, go: Path, **extra: object) -> jobs_pb2.JobSpec:
    """A one-GPU job that runs until ``go`` exists."""
    wait = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"
    task = python_task("t", wait, resources={"accelerator": {"kind": "GPU", "count": 1}})
    return spec(name, [task], queue=queue_name, **extra)


async def states(channel: grpc.aio.Channel, ids: list[str]) -> dict[str, int]:
    stub = jobs(channel)
    return {i: (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=i))).job.state for i in ids}


async def listed(operator: grpc.aio.Channel) -> dict[str, queues_pb2.QueueStatus]:
    reply = await admin(operator).ListQueues(admin_service_pb2.ListQueuesRequest())
    return {q.queue.name: q for q in reply.queues}


BAD_QUEUES = [
    ("negative nominal", queue("bad1", "t", ("gpu", -1, 0)), "queue.quotas[0].nominal"),
    ("NaN borrowing", queue("bad2", "t", ("gpu", 1, math.nan)), "queue.quotas[0].borrowing_limit"),
    ("unknown resource", queue("bad3", "t", ("tpu", 1, 0)), "queue.quotas[0].resource"),
    ("no tenant", queue("bad4", ""), "queue.tenant"),
    ("unknown parent", queue("bad5", "t", parent="nowhere"), "queue.parent"),
    ("bad name", queue("Bad Name", "t"), "queue.name"),
    ("negative weight", queue("bad6", "t", weight=-2.0), "queue.weight"),
]


@SQLITE_ONLY
@pytest.mark.parametrize(("case", "bad", "field"), BAD_QUEUES, ids=[c[0] for c in BAD_QUEUES])
async def test_bad_queues_are_refused_with_the_field(
    operator: grpc.aio.Channel, case: str, bad: queues_pb2.Queue, field: str
) -> None:
    before = await listed(operator)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await admin(operator).CreateQueue(admin_service_pb2.CreateQueueRequest(queue=bad))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in violations(caught.value), violations(caught.value)
    assert await listed(operator) == before  # nothing stored


async def test_a_cycle_of_parents_is_refused(operator: grpc.aio.Channel) -> None:
    stub = admin(operator)
    await stub.CreateQueue(admin_service_pb2.CreateQueueRequest(queue=queue("cyc-a", "t")))
    await stub.CreateQueue(
        admin_service_pb2.CreateQueueRequest(queue=queue("cyc-b", "t", parent="cyc-a"))
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.UpdateQueue(
            admin_service_pb2.UpdateQueueRequest(queue=queue("cyc-a", "t", parent="cyc-b"))
        )
    assert "cycle" in violations(caught.value)["queue.parent"]
    assert (await listed(operator))["cyc-a"].queue.parent == ""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.DeleteQueue(admin_service_pb2.DeleteQueueRequest(name="cyc-a"))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # cyc-b sits under it
    for name in ("cyc-b", "cyc-a"):
        await stub.DeleteQueue(admin_service_pb2.DeleteQueueRequest(name=name))
    assert "cyc-a" not in await listed(operator)


async def test_submits_name_only_the_tenants_queues_and_known_classes(
    federation: LocalFederation, operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    await admin(operator).CreateQueue(
        admin_service_pb2.CreateQueueRequest(queue=queue("owned-by-x", "tenant-x"))
    )
    async with channel_as(federation, tenant_tls(federation, "tenant-z")) as z:
        # urgent may preempt: only the tenants the class lists may name it
        job = gpu_job("not-listed", "", tmp_path, priority_class="urgent")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs(z).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))
        assert "spec.priority_class" in violations(caught.value)
    async with channel_as(federation, tenant_tls(federation, "tenant-y")) as y:
        for job, field in (
            (gpu_job("other", "owned-by-x", tmp_path), "spec.queue"),
            (gpu_job("nowhere", "no-such-queue", tmp_path), "spec.queue"),
            (gpu_job("cls", "", tmp_path, priority_class="vip"), "spec.priority_class"),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await jobs(y).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert field in violations(caught.value)
        raised = gpu_job("raised", "", tmp_path, priority=5)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs(y).SubmitJob(job_service_pb2.SubmitJobRequest(spec=raised))
        assert "spec.priority" in violations(caught.value)  # a tenant may only lower it
        (tmp_path / "go").touch()
        job = gpu_job("urgent", "", tmp_path / "go", priority_class="urgent")
        reply = await jobs(y).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))
        assert reply.job.spec.priority == 900
        assert (await wait_for_job(y, reply.job.id)).state == jobs_pb2.JOB_STATE_SUCCEEDED


async def test_a_tenant_lists_its_own_queues_and_changes_none(
    federation: LocalFederation, operator: grpc.aio.Channel
) -> None:
    """Its quotas and usage are the tenant's to read; others' queues stay hidden, and
    changing any queue is still an operator's."""
    for name, tenant in (("mine-q", "tenant-q"), ("theirs-q", "tenant-r")):
        request = admin_service_pb2.CreateQueueRequest(queue=queue(name, tenant, ("gpu", 2, 1)))
        await admin(operator).CreateQueue(request)
    async with channel_as(federation, tenant_tls(federation, "tenant-q")) as q:
        reply = await admin(q).ListQueues(admin_service_pb2.ListQueuesRequest())
        assert [s.queue.name for s in reply.queues] == ["mine-q"]
        assert reply.queues[0].queue.quotas[0].nominal == 2
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await admin(q).DeleteQueue(admin_service_pb2.DeleteQueueRequest(name="mine-q"))
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    everything = await listed(operator)
    assert {"mine-q", "theirs-q"} <= everything.keys()


async def test_a_quota_holds_under_concurrent_batches_and_says_why(
    federation: LocalFederation, operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """team-a may hold 1 GPU: of 6 one-GPU jobs sent as two batches at once, one runs at a
    time and the others wait with the quota as their reason, though the site has 4."""
    await admin(operator).CreateQueue(
        admin_service_pb2.CreateQueueRequest(queue=queue("qa", "team-a", ("gpu", 1, 0)))
    )
    go = tmp_path / "go"
    async with channel_as(federation, tenant_tls(federation, "team-a")) as a:
        batches = [[gpu_job(f"b{b}-{i}", "qa", go) for i in range(3)] for b in range(2)]
        replies = await asyncio.gather(
            *(
                jobs(a).SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=batch))
                for batch in batches
            )
        )
        ids = [j.id for reply in replies for j in reply.jobs]

        async def one_runs() -> bool:
            return list((await states(a, ids)).values()).count(RUNNING) == 1

        await until(one_runs, "one job running")
        first = await states(a, ids)

        def held(event: jobs_pb2.JobEvent) -> bool:
            return event.state == jobs_pb2.JOB_STATE_PENDING and "gpu quota (1/1)" in event.reason

        for job_id in (i for i, s in first.items() if s != RUNNING):  # each one was tried
            await until_event(a, job_id, held, f"{job_id} held back by the quota")
        now = await states(a, ids)
        assert now == first
        assert sorted(now.values()) == [jobs_pb2.JOB_STATE_PENDING] * 5 + [RUNNING]
        waiting = next(i for i, s in now.items() if s != RUNNING)
        job = (await jobs(a).GetJob(job_service_pb2.GetJobRequest(job_id=waiting))).job
        assert "queue qa at its gpu quota (1/1)" in job.tasks[0].reason
        explained = await jobs(a).ExplainJob(job_service_pb2.ExplainJobRequest(job_id=waiting))
        (held_back,) = explained.tasks[0].held_back
        assert (held_back.stage, held_back.site) == ("Quota", "")
        assert held_back.reason.startswith("queue qa at its gpu quota (1/1)")
        shown = io.StringIO()
        Console(file=shown, width=200).print(explanation_table(explained.tasks[0]))
        assert "held back (Quota): queue qa at its gpu quota (1/1)" in shown.getvalue()
        status = (await listed(operator))["qa"]
        assert status.usage["gpu"] == 1
        assert status.waiting_jobs == 5
        out = io.StringIO()
        Console(file=out, width=200).print(queues_table([status]))
        assert "gpu 1/1" in out.getvalue()
        go.touch()
        finished = [await wait_for_job(a, i) for i in ids]
    assert all(j.state == jobs_pb2.JOB_STATE_SUCCEEDED for j in finished)
    starts = sorted(j.tasks[0].started_at.ToNanoseconds() for j in finished)
    ends = sorted(j.tasks[0].finished_at.ToNanoseconds() for j in finished)
    assert starts[1] >= ends[0]  # the second started only after the first ended


async def test_borrowing_uses_what_others_leave_idle_and_fair_share_splits_by_weight(
    federation: LocalFederation, operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """Three queues beside each other: team-c's and team-d's with a nominal GPU each, team-e's
    with 2, idle. While team-d is idle too, team-c borrows (all 4 GPUs) and no more. Then both
    wait for more than fits, team-c's work submitted first: each gets its own GPU first, and
    team-e's idle 2 go to team-d by weight 3:1 (equal weights would split them 1:1, first come
    would give them to team-c). ``test_policy`` shows what each queue is owed going first."""
    stub = admin(operator)
    for made in (
        queue("qc", "team-c", ("gpu", 1, 3)),
        queue("qd", "team-d", ("gpu", 1, 3), weight=3.0),
        queue("qe", "team-e", ("gpu", 2, 0)),
    ):
        await stub.CreateQueue(admin_service_pb2.CreateQueueRequest(queue=made))
    first, later = tmp_path / "first", tmp_path / "later"
    async with (
        channel_as(federation, tenant_tls(federation, "team-c")) as c,
        channel_as(federation, tenant_tls(federation, "team-d")) as d,
    ):
        wave = [gpu_job(f"c{i}", "qc", first) for i in range(GPUS)]
        wave += [gpu_job(f"c-more{i}", "qc", later) for i in range(GPUS)]
        reply = await jobs(c).SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=wave))
        c_first = [j.id for j in reply.jobs[:GPUS]]
        c_more = [j.id for j in reply.jobs[GPUS:]]

        async def c_holds_all() -> bool:
            return list((await states(c, c_first)).values()).count(RUNNING) == GPUS

        await until(c_holds_all, "team-c on every GPU")  # 1 of its own and 3 borrowed
        status = (await listed(operator))["qc"]
        assert status.borrowed["gpu"] == 3
        held_back = (await jobs(c).GetJob(job_service_pb2.GetJobRequest(job_id=c_more[0]))).job
        assert "queue qc at its gpu quota (4/1), may borrow 3" in held_back.tasks[0].reason
        d_specs = [gpu_job(f"d{i}", "qd", later) for i in range(GPUS)]
        d_reply = await jobs(d).SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=d_specs))
        d_ids = [j.id for j in d_reply.jobs]
        first.touch()  # team-c's first wave ends: its later jobs and team-d's contend

        async def all_busy() -> bool:
            now = await states(operator, [*c_more, *d_ids])
            return list(now.values()).count(RUNNING) == GPUS

        await until(all_busy, "every GPU busy")
        assert list((await states(operator, d_ids)).values()).count(RUNNING) == 3
        later.touch()
        for job_id in [*c_first, *c_more, *d_ids]:
            assert (await wait_for_job(operator, job_id)).state == jobs_pb2.JOB_STATE_SUCCEEDED


@SQLITE_ONLY
def test_fedctl_queues_create_list_update_delete(federation: LocalFederation) -> None:
    """The CLI round trip, with a bad quota refused before anything is sent."""
    made = fedctl(federation, "queues", "create", "cli-q", "--tenant", "t", "--quota", "gpu=2+1")
    assert made.returncode == 0, made.stderr
    listed_json = fedctl(federation, "--json", "queues", "list")
    (mine,) = [q for q in json.loads(listed_json.stdout) if q["queue"]["name"] == "cli-q"]
    assert mine["queue"]["quotas"] == [
        {
            "resource": "gpu",
            "nominal": 2.0,
            "borrowing_limit": 1.0,
            "site": "",  # -o json prints fields at their zero value too
            "domain": "DOMAIN_UNSPECIFIED",
        }
    ]
    updated = fedctl(federation, "queues", "update", "cli-q", "--tenant", "t", "--weight", "4")
    assert updated.returncode == 0, updated.stderr
    table = fedctl(federation, "queues", "list")
    assert "cli-q" in table.stdout
    assert "no quota" in table.stdout  # update replaced it whole
    bad = fedctl(federation, "queues", "create", "cli-r", "--tenant", "t", "--quota", "gpu=lots")
    assert bad.returncode != 0
    assert "--quota 'gpu=lots'" in bad.stderr
    assert fedctl(federation, "queues", "delete", "cli-q").returncode == 0
    assert "cli-q" not in fedctl(federation, "queues", "list").stdout


@ETCD_ONLY
async def test_a_batch_larger_than_one_etcd_commit_is_refused_whole(
    operator: grpc.aio.Channel,
) -> None:
    """etcd's default --max-txn-ops (128) holds 25 to 40 jobs with their index entries: a
    larger batch is RESOURCE_EXHAUSTED, saying what to do, and nothing of it is stored."""
    before = await admin(operator).GetFederationStatus(
        admin_service_pb2.GetFederationStatusRequest()
    )
    specs = [spec(f"big-{i}", [python_task("t", "pass")]) for i in range(60)]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jobs(operator).SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=specs))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "submit fewer jobs per batch" in (caught.value.details() or "")
    assert "max-txn-ops" in (caught.value.details() or "")
    after = await admin(operator).GetFederationStatus(
        admin_service_pb2.GetFederationStatusRequest()
    )
    assert dict(after.jobs_by_state) == dict(before.jobs_by_state)
