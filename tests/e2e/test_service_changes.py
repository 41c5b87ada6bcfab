"""Changing a running service end to end: real agents scale it up and down and roll it onto a
new spec in place, never with fewer ready replicas than max_unavailable allows; bad changes
are refused with the field named and change nothing."""

from __future__ import annotations

import asyncio
import json
import urllib.error
from collections.abc import Awaitable, Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import (
    admin_service_pb2,
    job_service_pb2,
    jobs_pb2,
    queues_pb2,
    serving_service_pb2,
    serving_service_pb2_grpc,
)
from federation.local import LocalFederation, SiteSpec

from .conftest import (
    admin,
    channel_as,
    jobs,
    python_task,
    running,
    spec,
    tenant_tls,
    until,
    wait_for_job,
)
from .test_cli import fedctl
from .test_services import answer, endpoints, watching

pytestmark = pytest.mark.xdist_group("e2e-service-changes")

NODE = {"name": "web-box", "cpu_cores": 8, "memory_mib": 65536}
VERSIONED_REPLICA = """
import http.server, os
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(f"{os.environ['VERSION']}:{os.environ['FEDERATION_REPLICA']}".encode())
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(os.environ["FEDERATION_PORT"])), Handler).serve_forever()
"""
"""Serves on FEDERATION_PORT, answering GET with ``VERSION:REPLICA``."""
READINESS = {"httpPath": "/", "periodS": 0.2, "timeoutS": 5}
"""A slow answer on a loaded machine is not taken for a replica that is down."""


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    root = tmp_path_factory.mktemp("svc-change")
    with running(root, [SiteSpec("svc-b", "edge", nodes=[NODE])]) as f:
        yield f


def web(version: str, replicas: int = 2, **policy: object) -> dict[str, object]:
    return python_task(
        "web",
        VERSIONED_REPLICA,
        replicas=replicas,
        kind="TASK_KIND_SERVICE",
        env={"VERSION": version},
        service={"readiness": READINESS, "backoffS": 0.2, **policy},
        resources={"cpu": 1, "memory_mib": 64},
    )


def serving(channel: grpc.aio.Channel) -> serving_service_pb2_grpc.ServingServiceStub:
    return serving_service_pb2_grpc.ServingServiceStub(channel)


async def start(
    channel: grpc.aio.Channel, name: str, task: dict[str, object], **extra: object
) -> str:
    """Submits a one-task service job and waits until every replica is ready."""
    request = job_service_pb2.SubmitJobRequest(spec=spec(name, [task], **extra))
    job_id = (await jobs(channel).SubmitJob(request)).job.id
    replicas = int(str(task["replicas"]))
    await until(lambda: all_ready(channel, job_id, replicas), f"{name}'s replicas ready")
    return job_id


async def all_ready(channel: grpc.aio.Channel, job_id: str, replicas: int) -> bool:
    """Whether the service runs exactly ``replicas`` replicas, every one ready."""
    now = await endpoints(channel, job_id)
    return len(now) == replicas and all(e.ready for e in now)


async def stop(channel: grpc.aio.Channel, job_id: str) -> None:
    await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id))
    await wait_for_job(channel, job_id)


async def get(channel: grpc.aio.Channel, job_id: str) -> jobs_pb2.Job:
    return (await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job


async def event_reasons(channel: grpc.aio.Channel, job_id: str) -> list[str]:
    request = job_service_pb2.GetJobRequest(job_id=job_id, include_events=True)
    return [e.reason for e in (await jobs(channel).GetJob(request)).events]


async def test_a_rolling_update_keeps_one_ready_and_replaces_every_replica(
    fed: LocalFederation, tmp_path: Path
) -> None:
    """Two replicas of v1, max_unavailable 1; ``fedctl jobs update`` with a job file of v2:
    every endpoint list a watcher sees holds at least one ready replica, the replicas end at
    revision 1 answering v2, and the job's events say what changed."""
    async with fed.operator().channel() as channel:
        job_id = await start(channel, "roll", web("v1", maxUnavailable=1))
        assert sorted(answer(e) for e in await endpoints(channel, job_id)) == ["v1:0", "v1:1"]
        follower, seen = await watching(channel, job_id)
        job_file = tmp_path / "roll.yaml"
        job_file.write_text(json.dumps({"name": "roll", "tasks": [web("v2", maxUnavailable=1)]}))
        done = await asyncio.to_thread(fedctl, fed, "jobs", "update", job_id, str(job_file))
        assert done.returncode == 0, done.stderr

        async def rolled() -> bool:
            now = await endpoints(channel, job_id)
            return len(now) == 2 and all(e.ready and e.revision == 1 for e in now)

        await until(rolled, "both replicas at revision 1 and ready")
        assert sorted(answer(e) for e in await endpoints(channel, job_id)) == ["v2:0", "v2:1"]
        await until(lambda: asyncio.sleep(0, rolled_in(seen)), "the watch to follow")
        follower.cancel()
        assert all(sum(e.ready for e in listed) >= 1 for listed in seen), [
            [(e.replica, e.revision, e.ready) for e in listed] for listed in seen
        ]
        # One at a time: while one replica was on the new revision, the other was not yet.
        assert any({e.revision for e in listed} == {0, 1} for listed in seen)
        job = await get(channel, job_id)
        assert job.tasks[0].revision == 1
        assert dict(job.spec.tasks[0].env) == {"VERSION": "v2"}
        reasons = await event_reasons(channel, job_id)
        assert "revision 1: updated env" in reasons, reasons
        await stop(channel, job_id)


def rolled_in(seen: list[list[jobs_pb2.Endpoint]]) -> bool:
    """The watch has caught up with the end of the rollout."""
    return bool(seen) and all(e.ready and e.revision == 1 for e in seen[-1])


async def test_scale_up_then_down(fed: LocalFederation) -> None:
    """``fedctl jobs scale``: 2 to 3 replicas, the new one answering; 3 to 1, the two
    highest-numbered stopped and their ports closed; the stored spec follows."""
    async with fed.operator().channel() as channel:
        job_id = await start(channel, "scaled", web("v1"))
        up = await asyncio.to_thread(fedctl, fed, "jobs", "scale", job_id, "--replicas", "3")
        assert up.returncode == 0, up.stderr
        assert "scaled from 2 to 3 replicas" in up.stdout

        await until(lambda: all_ready(channel, job_id, 3), "three replicas ready")
        three = await endpoints(channel, job_id)
        assert sorted(answer(e) for e in three) == ["v1:0", "v1:1", "v1:2"]
        down = await asyncio.to_thread(
            fedctl, fed, "-o", "json", "jobs", "scale", job_id, "--replicas", "1"
        )
        assert down.returncode == 0, down.stderr
        assert json.loads(down.stdout)["spec"]["tasks"][0]["replicas"] == 1
        await until(lambda: all_ready(channel, job_id, 1), "one replica left")
        assert answer((await endpoints(channel, job_id))[0]) == "v1:0"
        for gone in three[1:]:
            with pytest.raises(urllib.error.URLError):
                answer(gone)
        job = await get(channel, job_id)
        assert job.state == jobs_pb2.JOB_STATE_RUNNING
        assert (job.spec.tasks[0].replicas, job.tasks[0].revision) == (1, 2)
        await stop(channel, job_id)


@pytest.mark.parametrize(
    ("change", "code", "field"),
    [
        ({"scale": 0}, grpc.StatusCode.INVALID_ARGUMENT, "replicas"),
        ({"scale": 5000}, grpc.StatusCode.INVALID_ARGUMENT, "replicas"),
        ({"resources": {"cpu": 2}}, grpc.StatusCode.INVALID_ARGUMENT, "spec.resources"),
        ({"service": {"restart": 9}}, grpc.StatusCode.INVALID_ARGUMENT, "spec.service.restart"),
        ({"service": {"port": 8080}}, grpc.StatusCode.INVALID_ARGUMENT, "spec.service.port"),
        ({"name": "other"}, grpc.StatusCode.NOT_FOUND, ""),
        ({"scale": 100}, grpc.StatusCode.FAILED_PRECONDITION, "no room for 99 more replicas"),
    ],
    ids=["zero", "too-many", "resources", "bad-policy", "port", "unknown-task", "no-room"],
)
async def test_bad_changes_are_refused_and_change_nothing(
    fed: LocalFederation, change: dict[str, object], code: grpc.StatusCode, field: str
) -> None:
    """A precise status naming the field (or the site's reason); the stored spec, the
    revision and the running replicas stay as they were."""
    async with fed.operator().channel() as channel:
        job_id = await start(channel, "steady", web("v1", replicas=1))
        before = await get(channel, job_id)
        stub = serving(channel)
        if "scale" in change:
            replicas = int(str(change["scale"]))
            call = stub.ScaleService(
                serving_service_pb2.ScaleServiceRequest(job_id=job_id, replicas=replicas)
            )
        else:
            task = spec("steady", [{**web("v2", replicas=1), **change}]).tasks[0]
            call = stub.UpdateService(
                serving_service_pb2.UpdateServiceRequest(job_id=job_id, spec=task)
            )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call
        assert refused.value.code() == code, refused.value.details()
        assert field in (refused.value.details() or "")
        after = await get(channel, job_id)
        assert (after.spec, after.tasks[0].revision) == (before.spec, 0)
        assert after.last_event_sequence == before.last_event_sequence
        assert [answer(e) for e in await endpoints(channel, job_id)] == ["v1:0"]
        await stop(channel, job_id)


async def test_a_revision_sent_to_a_site_is_never_sent_again(fed: LocalFederation) -> None:
    """The revision is reserved in the store before the site hears of it: after a change the
    site declined (as after one whose answer was lost, with whatever leader comes next), the
    next change goes out as the revision after it, never as the same number with another
    spec."""
    async with fed.operator().channel() as channel:
        job_id = await start(channel, "numbered", web("v1", replicas=1))
        stub = serving(channel)
        with pytest.raises(grpc.aio.AioRpcError) as declined:
            await stub.ScaleService(
                serving_service_pb2.ScaleServiceRequest(job_id=job_id, replicas=100)
            )
        assert declined.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        task = (await get(channel, job_id)).tasks[0]
        assert (task.revision, task.issued_revision) == (0, 1)
        await stub.ScaleService(serving_service_pb2.ScaleServiceRequest(job_id=job_id, replicas=2))
        task = (await get(channel, job_id)).tasks[0]
        assert (task.revision, task.issued_revision) == (2, 2)
        assert "revision 2: scaled from 1 to 2 replicas" in await event_reasons(channel, job_id)
        await stop(channel, job_id)


async def test_only_services_change_and_only_for_their_tenant(fed: LocalFederation) -> None:
    """A batch task cannot be scaled (INVALID_ARGUMENT on task); another tenant's service is
    NOT_FOUND, as GetJob answers; an ended service has nothing to change."""
    async with fed.operator().channel() as channel:
        batch = spec("batchy", [python_task("main", "import time; time.sleep(30)")])
        batch_id = (
            await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=batch))
        ).job.id
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await serving(channel).ScaleService(
                serving_service_pb2.ScaleServiceRequest(job_id=batch_id, task="main", replicas=2)
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "task" in (refused.value.details() or "")
        await stop(channel, batch_id)

        job_id = await start(channel, "theirs", web("v1", replicas=1))
        async with channel_as(fed, tenant_tls(fed, "team-y")) as tenant:
            with pytest.raises(grpc.aio.AioRpcError) as hidden:
                await serving(tenant).ScaleService(
                    serving_service_pb2.ScaleServiceRequest(job_id=job_id, replicas=2)
                )
            assert hidden.value.code() == grpc.StatusCode.NOT_FOUND
        await stop(channel, job_id)
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await serving(channel).ScaleService(
                serving_service_pb2.ScaleServiceRequest(job_id=job_id, replicas=2)
            )
        assert ended.value.code() == grpc.StatusCode.FAILED_PRECONDITION


async def test_scale_ups_at_once_do_not_overshoot_their_queue(fed: LocalFederation) -> None:
    """Two services of one queue (4 cores, no borrowing) hold a core each; both asked at once
    to go to 3 replicas, one may (4 cores held) and the other is RESOURCE_EXHAUSTED: each was
    checked against what the other had reserved, not against what was written. Once the
    first scales down, the other may."""
    async with fed.operator().channel() as operator:
        quota = queues_pb2.Quota(resource="cpu", nominal=4)
        made = queues_pb2.Queue(name="svc-q", tenant="svc-t", quotas=[quota])
        await admin(operator).CreateQueue(admin_service_pb2.CreateQueueRequest(queue=made))

        async def held() -> float:
            reply = await admin(operator).ListQueues(admin_service_pb2.ListQueuesRequest())
            [status] = [q for q in reply.queues if q.queue.name == "svc-q"]
            return status.usage["cpu"]

        async with channel_as(fed, tenant_tls(fed, "svc-t")) as tenant:
            ids = [
                await start(tenant, f"quota-{i}", web("v1", replicas=1), queue="svc-q")
                for i in range(2)
            ]
            assert await held() == 2

            def scale(job_id: str, replicas: int) -> Awaitable[object]:
                request = serving_service_pb2.ScaleServiceRequest(job_id=job_id, replicas=replicas)
                return serving(tenant).ScaleService(request)

            outcomes = await asyncio.gather(*(scale(i, 3) for i in ids), return_exceptions=True)
            refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
            assert len(refused) == 1, outcomes
            assert refused[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 more replicas of web: queue svc-q at its cpu quota" in str(
                refused[0].details()
            )
            assert await held() == 4
            scaled, other = ids if not isinstance(outcomes[0], BaseException) else ids[::-1]
            assert [(await get(tenant, i)).spec.tasks[0].replicas for i in (scaled, other)] == [
                3,
                1,
            ]
            await scale(scaled, 1)
            await scale(other, 3)
            assert await held() == 4
            await until(lambda: all_ready(tenant, scaled, 1), "the first scaled down")
            await until(lambda: all_ready(tenant, other, 3), "the other scaled up")
            for job_id in ids:
                await stop(tenant, job_id)


async def test_a_restarted_agent_keeps_a_changed_service_as_changed(tmp_path: Path) -> None:
    """Scaled to 3 and rolled onto v2 in one update, then the agent is stopped (SIGTERM, its
    tasks left running) and started again: the next agent adopts three replicas at revision 1
    on the same ports, answering v2, none restarted."""
    site = SiteSpec("svc-c", "edge", nodes=[NODE], settings={"stop_tasks_on_exit": False})
    fed = LocalFederation(tmp_path / "fed", [site])
    try:
        await fed.start()
        async with fed.operator().channel() as channel:
            job_id = await start(channel, "kept", web("v1"))
            new = spec("kept", [web("v2", replicas=3)]).tasks[0]
            await serving(channel).UpdateService(
                serving_service_pb2.UpdateServiceRequest(job_id=job_id, spec=new)
            )

            async def changed() -> bool:
                now = await endpoints(channel, job_id)
                return len(now) == 3 and all(e.ready and e.revision == 1 for e in now)

            await until(changed, "three replicas of revision 1")
            before = await endpoints(channel, job_id)
            assert fed.terminate(site.name), "the agent ignored SIGTERM"
            assert sorted(answer(e) for e in before) == ["v2:0", "v2:1", "v2:2"]
            await fed.start_site(site)
            await fed.wait_connected()
            await until(changed, "the adopted replicas reported")
            after = await endpoints(channel, job_id)
            assert [(e.port, e.revision, e.restarts) for e in after] == [
                (e.port, 1, 0) for e in before
            ]
            assert sorted(answer(e) for e in after) == ["v2:0", "v2:1", "v2:2"]
            await stop(channel, job_id)
    finally:
        fed.stop()
