"""Service jobs end to end: real agents keep a service's replicas running, check them and
publish their endpoints; fedctl lists them; a watcher follows them; bad specs are refused."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from federation.api.v1 import (
    job_service_pb2,
    jobs_pb2,
    serving_service_pb2,
    serving_service_pb2_grpc,
)
from federation.local import LocalFederation, SiteSpec
from federation.testing.services import HTTP_REPLICA

from .conftest import channel_as, jobs, python_task, running, spec, tenant_tls, until, wait_for_job
from .test_cli import fedctl

pytestmark = pytest.mark.xdist_group("e2e-services")

BACKOFF_S = 1.0
NODE = {"name": "web-box", "cpu_cores": 16, "memory_mib": 65536}


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    with running(tmp_path_factory.mktemp("svc"), [SiteSpec("svc-a", "edge", nodes=[NODE])]) as f:
        yield f


def service(name: str, code: str, replicas: int = 2, **policy: object) -> dict[str, object]:
    return python_task(
        name,
        code,
        replicas=replicas,
        kind="TASK_KIND_SERVICE",
        service=policy,
        resources={"cpu": 1, "memory_mib": 64},
    )


def answer(endpoint: jobs_pb2.Endpoint) -> str:
    url = f"http://{endpoint.address}:{endpoint.port}/"
    with urllib.request.urlopen(url, timeout=2) as reply:
        return str(reply.read().decode())


async def endpoints(channel: grpc.aio.Channel, job_id: str) -> list[jobs_pb2.Endpoint]:
    stub = serving_service_pb2_grpc.ServingServiceStub(channel)
    reply = await stub.ListEndpoints(serving_service_pb2.ListEndpointsRequest(job_id=job_id))
    return list(reply.endpoints)


async def watching(
    channel: grpc.aio.Channel, job_id: str
) -> tuple[asyncio.Task[None], list[list[jobs_pb2.Endpoint]]]:
    """Follows WatchEndpoints in the background, once its first list has come: every list it
    sends is appended to the list returned (cancel the task to stop)."""
    stub = serving_service_pb2_grpc.ServingServiceStub(channel)
    watch = stub.WatchEndpoints(serving_service_pb2.WatchEndpointsRequest(job_id=job_id))
    seen: list[list[jobs_pb2.Endpoint]] = []

    async def follow() -> None:
        async for change in watch:
            seen.append(list(change.endpoints))

    follower = asyncio.create_task(follow())
    await until(lambda: asyncio.sleep(0, bool(seen)), "the watch's first list")
    return follower, seen


def replica_process(fed: LocalFederation, job_id: str, replica: int) -> psutil.Process:
    """The replica's own process, found by the environment the agent gave it."""
    for process in psutil.process_iter():
        try:
            env = process.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        if env.get("FEDERATION_JOB_ID") == job_id and env.get("FEDERATION_REPLICA") == str(replica):
            return process
    raise AssertionError(f"no process for replica {replica} of {job_id}")


async def test_a_killed_replica_comes_back_while_the_other_serves(fed: LocalFederation) -> None:
    """Two HTTP replicas behind an HTTP readiness check: fedctl lists both with addresses that
    answer; one killed is back ready within backoff + 5 s, the other answering all along; a
    watcher sees the change; cancel stops both."""
    readiness = {"httpPath": "/", "periodS": 0.2}
    job_spec = spec("web", [service("web", HTTP_REPLICA, backoffS=BACKOFF_S, readiness=readiness)])
    async with fed.operator().channel() as channel:
        job = (await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job_spec))).job

        async def both_ready() -> bool:
            return [e.ready for e in await endpoints(channel, job.id)] == [True, True]

        await until(both_ready, "both replicas ready")
        listed = json.loads(fedctl(fed, "-o", "json", "jobs", "endpoints", job.id).stdout)
        assert [(e["site"], e["address"], e.get("replica", 0)) for e in listed["endpoints"]] == [
            ("svc-a", "127.0.0.1", 0),
            ("svc-a", "127.0.0.1", 1),
        ]
        first, second = await endpoints(channel, job.id)
        assert (answer(first), answer(second)) == ("0", "1")
        table = fedctl(fed, "jobs", "endpoints", job.id).stdout
        assert f"127.0.0.1:{first.port}" in table
        assert f"127.0.0.1:{second.port}" in table

        follower, seen = await watching(channel, job.id)
        replica_process(fed, job.id, 0).kill()
        killed_at = time.monotonic()
        while True:
            assert answer(second) == "1"  # the other serves all along
            now = await endpoints(channel, job.id)
            if now[0].ready and now[0].restarts == 1:
                break
            assert time.monotonic() - killed_at < BACKOFF_S + 5, "replica 0 not back in time"
            await asyncio.sleep(0.1)
        assert answer(now[0]) == "0"
        await until(lambda: asyncio.sleep(0, seen[-1] == now), "the watch to follow")
        assert any(not e[0].ready for e in seen), "the watch never showed replica 0 down"

        await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=job.id))
        ended = await wait_for_job(channel, job.id)
        assert ended.state == jobs_pb2.JOB_STATE_CANCELLED
        assert not ended.tasks[0].endpoints
        await asyncio.wait_for(follower, 10)  # the watch ends with the job
        assert seen[-1] == []
        for endpoint in (first, second):
            with pytest.raises(urllib.error.URLError):
                answer(endpoint)


async def test_a_crash_loop_shows_and_the_service_stays_running(fed: LocalFederation) -> None:
    """A replica that exits at once is restarted and shown crash-looping, and the loop's
    start is one event of the task; the job runs on."""
    task = service("bad", "raise SystemExit(2)", 1, backoffS=0.1, maxBackoffS=0.5, crashLoopAfter=3)
    async with fed.operator().channel() as channel:
        submitted = await jobs(channel).SubmitJob(
            job_service_pb2.SubmitJobRequest(spec=spec("crashy", [task]))
        )
        job_id = submitted.job.id

        async def looping() -> bool:
            found = await endpoints(channel, job_id)
            return bool(found) and found[0].crash_looping

        await until(looping, "a crash loop")
        table = fedctl(fed, "jobs", "endpoints", job_id).stdout
        assert "(crash loop)" in table
        reply = await jobs(channel).GetJob(
            job_service_pb2.GetJobRequest(job_id=job_id, include_events=True)
        )
        assert reply.job.state == jobs_pb2.JOB_STATE_RUNNING
        loops = [e for e in reply.events if "crash-looping" in e.reason]
        assert [(e.task, e.state, e.site, e.reason) for e in loops] == [
            (
                "bad",
                jobs_pb2.JOB_STATE_RUNNING,
                "svc-a",
                "replica 0 is crash-looping: 3 restarts in a row after runs shorter than 10s;"
                " restarted every 0.5s",
            )
        ]
        await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id))
        assert (await wait_for_job(channel, job_id)).state == jobs_pb2.JOB_STATE_CANCELLED


async def test_tenants_see_only_their_own_endpoints(fed: LocalFederation) -> None:
    """Another tenant's job is NOT_FOUND, as GetJob answers."""
    async with fed.operator().channel() as channel:
        submitted = await jobs(channel).SubmitJob(
            job_service_pb2.SubmitJobRequest(
                spec=spec("mine", [service("idle", "import time; time.sleep(60)", 1)])
            )
        )
        job_id = submitted.job.id
        async with channel_as(fed, tenant_tls(fed, "team-z")) as tenant:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await endpoints(tenant, job_id)
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id))
        await wait_for_job(channel, job_id)


@pytest.mark.parametrize(
    ("task", "field"),
    [
        (service("w", "pass", restart=7), "spec.tasks[0].service.restart"),
        (
            service("w", "pass", readiness={"tcpPort": 70000}),
            "spec.tasks[0].service.readiness.tcp_port",
        ),
        (service("w", "pass", port=65536), "spec.tasks[0].service.port"),
        (service("w", "pass", backoffS=-1), "spec.tasks[0].service.backoff_s"),
        (
            service("w", "pass", readiness={"httpPath": "health"}),
            "spec.tasks[0].service.readiness.http_path",
        ),
        (
            python_task("w", "pass", service={"port": 80}),
            "spec.tasks[0].service",
        ),
    ],
    ids=["restart", "tcp-port", "port", "backoff", "http-path", "policy-on-batch"],
)
async def test_bad_service_specs_are_refused_and_nothing_stored(
    fed: LocalFederation, tmp_path: Path, task: dict[str, object], field: str
) -> None:
    """INVALID_ARGUMENT naming the field; the job is not stored."""
    job_spec = spec("bad", [task], id="bad-service")
    async with fed.operator().channel() as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job_spec))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (refused.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id="bad-service"))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
