"""A service that follows its load, end to end: real agents, a real coordinator and replicas
that report their in-flight requests; a bounded load generator on loopback sends requests to
the ready endpoints it follows. The service grows from 1 to 3 replicas under load and back to
1 when the load falls, and no request fails while replicas are drained and stopped."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2, serving_service_pb2
from federation.local import LocalFederation, SiteSpec

from .conftest import jobs, python_task, running, spec, until
from .test_service_changes import event_reasons, serving, stop
from .test_services import endpoints, watching

pytestmark = pytest.mark.xdist_group("e2e-autoscale")

NODE = {"name": "infer-box", "cpu_cores": 8, "memory_mib": 65536}
REPLICA = """
import http.server, os, threading, time
in_flight, lock = 0, threading.Lock()
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        global in_flight
        if self.path == "/load":
            with lock:
                body = str(in_flight).encode()
        else:
            with lock:
                in_flight += 1
            time.sleep(0.3)
            with lock:
                in_flight -= 1
            body = os.environ["FEDERATION_REPLICA"].encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["FEDERATION_PORT"])), Handler)
server.daemon_threads = True
server.serve_forever()
"""
"""Answers GET /work after 0.3 s with its replica number, and GET /load with the requests it
has in flight."""
AUTOSCALE = {
    "minReplicas": 1,
    "maxReplicas": 3,
    "targetLoad": 1,
    "loadPath": "/load",
    "scaleDownAfterS": 3,
    "drainTimeoutS": 20,
}


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    with running(
        tmp_path_factory.mktemp("autoscale"), [SiteSpec("infer", "edge", nodes=[NODE])]
    ) as f:
        yield f


def inference(**autoscale: object) -> dict[str, object]:
    return python_task(
        "infer",
        REPLICA,
        replicas=1,
        kind="TASK_KIND_SERVICE",
        service={
            "readiness": {"httpPath": "/load", "periodS": 0.2, "timeoutS": 5},
            "autoscale": {**AUTOSCALE, **autoscale},
        },
        resources={"cpu": 1, "memory_mib": 64},
    )


async def get_work(port: int) -> str:
    """GET /work from a replica on loopback; its body, or raises on any failure."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /work HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
    head, _, body = answer.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.0 200"):
        raise ConnectionError(f"answer {head[:40]!r}")
    return body.decode()


class Load:
    """Workers that each send one request after another to a ready replica, taken in turn
    from the newest endpoint list the watch has sent."""

    def __init__(self, seen: list[list[jobs_pb2.Endpoint]]) -> None:
        self._seen = seen
        self._workers: list[asyncio.Task[None]] = []
        self.served: Counter[str] = Counter()
        self.failed: list[str] = []
        self._turn = 0

    def _pick(self) -> int | None:
        ready = [e.port for e in self._seen[-1] if e.ready and not e.draining]
        if not ready:
            return None
        self._turn += 1
        return ready[self._turn % len(ready)]

    async def _work(self) -> None:
        while True:
            port = self._pick()
            if port is None:
                await asyncio.sleep(0.05)
                continue
            try:
                self.served[await get_work(port)] += 1
            except (OSError, ConnectionError, TimeoutError) as exc:
                self.failed.append(f"port {port}: {exc!r}")

    def to(self, workers: int) -> None:
        while len(self._workers) < workers:
            self._workers.append(asyncio.create_task(self._work()))
        while len(self._workers) > workers:
            self._workers.pop().cancel()

    async def stop(self) -> None:
        self.to(0)
        await asyncio.sleep(0)


def serving_now(seen: list[list[jobs_pb2.Endpoint]]) -> list[jobs_pb2.Endpoint]:
    return [e for e in seen[-1] if not e.draining]


async def test_a_service_grows_under_load_and_shrinks_after_without_dropping_a_request(
    fed: LocalFederation,
) -> None:
    """1 replica; 4 workers (in flight about 4, target 1 a replica, max 3): 3 replicas, every
    one serving. Then 1 worker: after the 3 s window, back to 1 replica, the others shown
    draining before they stopped. The worker that kept going saw no request fail."""
    async with fed.operator().channel() as channel:
        request = job_service_pb2.SubmitJobRequest(spec=spec("autoscaled", [inference()]))
        job_id = (await jobs(channel).SubmitJob(request)).job.id
        follower, seen = await watching(channel, job_id)
        load = Load(seen)
        try:

            async def ready(count: int) -> bool:
                now = serving_now(seen)
                return len(now) == count and all(e.ready for e in now)

            await until(lambda: ready(1), "the first replica ready")
            load.to(4)
            await until(lambda: ready(3), "3 replicas under load", timeout_s=60)
            await until(lambda: asyncio.sleep(0, len(load.served) == 3), "every replica serving")
            load.to(1)
            started_down = time.monotonic()
            await until(lambda: ready(1), "back to 1 replica", timeout_s=60)
            await until(lambda: asyncio.sleep(0, len(seen[-1]) == 1), "the drained ones gone")
            assert time.monotonic() - started_down >= 3, "scaled down within the window"
            served_before = sum(load.served.values())
            await until(
                lambda: asyncio.sleep(0, sum(load.served.values()) > served_before + 3),
                "requests served by the one replica left",
            )
        finally:
            await load.stop()
            follower.cancel()
        assert load.failed == [], load.failed
        assert any(e.draining for listed in seen for e in listed), "no replica was drained"
        reasons = await event_reasons(channel, job_id)
        assert any("autoscaled from 1 to 3" in r or "autoscaled from 1 to 2" in r for r in reasons)
        assert any("autoscaled from 3 to 1" in r or "autoscaled from 2 to 1" in r for r in reasons)
        await stop(channel, job_id)


async def test_scaling_an_autoscaled_service_by_hand_stays_within_its_bounds(
    fed: LocalFederation,
) -> None:
    """``ScaleService`` past max_replicas is refused naming the field; within, it is made."""
    async with fed.operator().channel() as channel:
        request = job_service_pb2.SubmitJobRequest(spec=spec("by-hand", [inference()]))
        job_id = (await jobs(channel).SubmitJob(request)).job.id
        await until(lambda: _any_ready(channel, job_id), "the replica ready")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await serving(channel).ScaleService(
                serving_service_pb2.ScaleServiceRequest(job_id=job_id, replicas=5)
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "autoscaled within 1 to 3" in str(refused.value.details())
        await stop(channel, job_id)


async def _any_ready(channel: grpc.aio.Channel, job_id: str) -> bool:
    return any(e.ready for e in await endpoints(channel, job_id))


async def test_an_autoscale_out_of_bounds_is_refused_with_the_field_named(
    fed: LocalFederation,
) -> None:
    async with fed.operator().channel() as channel:
        bad = spec("bad-scale", [inference(minReplicas=3, maxReplicas=2, targetLoad=0)])
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=bad))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = str(refused.value.details())
        assert "service.autoscale.max_replicas" in details
        assert "service.autoscale.target_load" in details
