"""Limits per request and per identity, at a real coordinator over mTLS."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from federation.api.v1 import job_service_pb2
from federation.local import LocalFederation, SiteSpec
from federation.security.interceptors import MAX_MESSAGE_CHARS

from .conftest import channel_as, jobs, python_task, spec, tenant_tls
from .test_refusals import violations

pytestmark = pytest.mark.xdist_group("e2e-limits")

LIMITS = """
client_requests_per_s = 5.0
client_request_burst = 5.0
client_streams = 3
max_unfinished_jobs_per_tenant = 30
"""


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    """A coordinator with low per-identity limits and one small site."""
    root = tmp_path_factory.mktemp("limits")
    config = root / "limits.toml"
    config.write_text(LIMITS)
    (root / "coordinator").mkdir(mode=0o755)  # a data folder that already exists, not private
    os.chmod(root / "coordinator", 0o755)
    site = SiteSpec("small", "datacenter", nodes=[{"name": "n", "cpu_cores": 4}])
    fed = LocalFederation(root, [site], coordinator_args=["--config", str(config)])
    try:
        asyncio.run(fed.start())
        yield fed
    finally:
        fed.stop()


@pytest_asyncio.fixture
async def tenant(
    federation: LocalFederation, request: pytest.FixtureRequest
) -> AsyncIterator[grpc.aio.Channel]:
    """A channel as a tenant of this test's own (so no other test spends its tokens)."""
    name = request.node.name.split("[")[0].removeprefix("test_").replace("_", "-")[:40]
    async with channel_as(federation, tenant_tls(federation, name)) as channel:
        yield channel


async def politely(call: Any, request: Any) -> Any:
    """``call(request)`` as a well-behaved client makes it: refused for its rate, it waits
    the delay the refusal names and tries again (this coordinator allows 5 requests/s)."""
    for _ in range(10):
        try:
            return await call(request)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            await asyncio.sleep(retry_delay_s(err) + 0.05)
    raise AssertionError("still refused after 10 polite tries")


def retry_delay_s(err: grpc.aio.AioRpcError) -> float:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    for detail in status.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info.retry_delay.ToTimedelta().total_seconds()
    raise AssertionError("no RetryInfo detail")


async def test_requests_past_the_rate_are_refused_with_a_retry_hint(
    federation: LocalFederation, tenant: grpc.aio.Channel
) -> None:
    """A tenant past its burst gets RESOURCE_EXHAUSTED with RetryInfo; another is unaffected."""
    stub = jobs(tenant)
    codes = []
    for _ in range(8):
        try:
            await stub.ListJobs(job_service_pb2.ListJobsRequest())
            codes.append(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as err:
            codes.append(err.code())
            refused = err
    assert codes[:5] == [grpc.StatusCode.OK] * 5
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes[5:]
    assert 0 < retry_delay_s(refused) <= 0.2
    async with channel_as(federation, tenant_tls(federation, "bystander")) as other:
        await jobs(other).ListJobs(job_service_pb2.ListJobsRequest())
    await asyncio.sleep(retry_delay_s(refused))
    await stub.ListJobs(job_service_pb2.ListJobsRequest())


async def test_streams_past_the_limit_are_refused_until_one_closes(
    tenant: grpc.aio.Channel,
) -> None:
    """A tenant may hold three watches; a fourth is refused until one of them ends."""
    stub = jobs(tenant)
    request = job_service_pb2.SubmitJobRequest(spec=spec("watched", [python_task("t", "pass")]))
    job_id = (await politely(stub.SubmitJob, request)).job.id
    # Each sends the job's current state first: once read, the server holds the stream open.
    current = job_service_pb2.WatchJobsRequest(job_ids=[job_id], include_current=True)
    watches = [stub.WatchJobs(current) for _ in range(3)]
    for watch in watches:
        await watch.read()
    fourth = stub.WatchJobs(current)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await fourth.read()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "3 open streams" in (caught.value.details() or "")
    watches[0].cancel()

    async def accepted(watch: Any) -> bool:
        """Whether the watch sends the job's current state, rather than being refused."""
        try:
            await watch.read()
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            return False
        return True

    deadline = asyncio.get_running_loop().time() + 10
    again = stub.WatchJobs(current)
    while not await accepted(again):  # until the cancellation reaches the server
        assert asyncio.get_running_loop().time() < deadline, "still refused a fourth watch"
        await asyncio.sleep(0.1)
        again = stub.WatchJobs(current)
    for watch in [*watches, again]:
        watch.cancel()


async def test_a_huge_spec_is_refused_for_its_size(tenant: grpc.aio.Channel) -> None:
    """A 1 MB spec is INVALID_ARGUMENT on 'spec', a 5 MB request on 'request' (before it is
    parsed), each with its size named, and nothing is stored."""
    big = spec("big", [python_task("t", "", env={f"V{i}": "x" * 30_000 for i in range(34)})])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jobs(tenant).SubmitJob(job_service_pb2.SubmitJobRequest(spec=big))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at most 262144 allowed" in violations(caught.value)["spec"]
    huge = spec("huge", [python_task("t", "", env={f"V{i}": "x" * 30_000 for i in range(170)})])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jobs(tenant).SubmitJob(job_service_pb2.SubmitJobRequest(spec=huge))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"at most {4 << 20} allowed" in violations(caught.value)["request"]
    listed = await jobs(tenant).ListJobs(job_service_pb2.ListJobsRequest())
    assert not listed.jobs


async def test_oversized_requests_spend_the_byte_rate(tenant: grpc.aio.Channel) -> None:
    """Refused for its size or not, a request's bytes were received: a client that sends 5 MB
    requests over and over is soon refused for its byte rate (16 MiB of burst), not answered
    INVALID_ARGUMENT at once for ever."""
    huge = spec("huge", [python_task("t", "", env={f"V{i}": "x" * 30_000 for i in range(170)})])
    codes = []
    for _ in range(6):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs(tenant).SubmitJob(job_service_pb2.SubmitJobRequest(spec=huge))
        codes.append(caught.value.code())
        if codes[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED:
            assert "request and reply bytes per second" in (caught.value.details() or "")
            break
    assert codes[:3] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert codes[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_a_tenant_past_its_unfinished_jobs_is_refused(tenant: grpc.aio.Channel) -> None:
    """With at most 30 unfinished jobs, a batch that would make 35 is refused whole; one that
    makes 30 is taken."""
    stub = jobs(tenant)
    waiting = python_task("t", "", resources={"cpu": 64})  # more than the site has: waits
    await stub.SubmitJobs(
        job_service_pb2.SubmitJobsRequest(specs=[spec(f"w{i}", [waiting]) for i in range(25)])
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.SubmitJobs(
            job_service_pb2.SubmitJobsRequest(specs=[spec(f"x{i}", [waiting]) for i in range(10)])
        )
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "has 25 unfinished jobs and may have at most 30" in (caught.value.details() or "")
    await stub.SubmitJobs(
        job_service_pb2.SubmitJobsRequest(specs=[spec(f"y{i}", [waiting]) for i in range(5)])
    )


async def test_error_texts_do_not_echo_huge_input(tenant: grpc.aio.Channel) -> None:
    """A 60 KB job id is answered NOT_FOUND / INVALID_ARGUMENT with short texts, not a
    header-size failure."""
    long_id = "x" * 60_000
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jobs(tenant).GetJob(job_service_pb2.GetJobRequest(job_id=long_id))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert len(caught.value.details() or "") <= MAX_MESSAGE_CHARS
    bad = spec("x", [python_task("t", "")], id=long_id)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jobs(tenant).SubmitJob(job_service_pb2.SubmitJobRequest(spec=bad))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(violations(caught.value)["spec.id"]) < 300


async def test_undecodable_requests_are_invalid_arguments(tenant: grpc.aio.Channel) -> None:
    """Bytes that are not a GetJobRequest get INVALID_ARGUMENT naming no Python class."""
    raw = tenant.unary_unary(
        "/federation.api.v1.JobService/GetJob",
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await raw(b"\xff\xff\xff\xff")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = caught.value.details() or ""
    assert "not a valid message" in details
    assert "class" not in details
    assert "Error" not in details


async def test_a_page_of_jobs_stays_under_the_client_limit(
    federation: LocalFederation,
) -> None:
    """Jobs of 200 KB each come back in pages under 4 MiB that together hold them all."""
    count, batch = 18, 6
    async with channel_as(federation, tenant_tls(federation, "pager")) as channel:
        stub = jobs(channel)
        env = {f"V{i}": "x" * 30_000 for i in range(7)}
        specs = [spec(f"big-{i}", [python_task("t", "", env=env)]) for i in range(count)]
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # a reply over 3 MiB: split it
            await stub.SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=specs))
        assert "split the batch" in violations(caught.value)["specs"]
        for first in range(0, count, batch):
            await politely(
                stub.SubmitJobs,
                job_service_pb2.SubmitJobsRequest(specs=specs[first : first + batch]),
            )
        seen: list[str] = []
        token = ""
        pages = 0
        while True:
            reply = await politely(
                stub.ListJobs, job_service_pb2.ListJobsRequest(page_size=1000, page_token=token)
            )
            assert reply.ByteSize() < 4 << 20
            seen += [job.id for job in reply.jobs]
            pages += 1
            token = reply.next_page_token
            if not token:
                break
        assert pages >= 2
        assert len(seen) == len(set(seen)) == count


def test_the_data_folder_is_made_private(federation: LocalFederation) -> None:
    """A data folder that existed with a loose mode is private once the coordinator runs."""
    mode = stat.S_IMODE((federation.root / "coordinator").stat().st_mode)
    assert mode == 0o700


def test_a_second_coordinator_on_a_used_port_fails_with_one_line(
    federation: LocalFederation, tmp_path: Path
) -> None:
    """Binding the first coordinator's port again is a one-line error and exit code 2."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "federation.coordinator",
            "--pki-dir",
            str(federation.pki.dir),
            "--data-dir",
            str(tmp_path / "second"),
            "--listen",
            f"127.0.0.1:{federation.port}",
            "--join-listen",
            "127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"cannot listen on 127.0.0.1:{federation.port}" in lines[0]
