"""Two coordinators on one etcd, in one process: followers refuse, a leader that loses its
lease steps down at once, and the other takes over."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from store.etcd_server import LocalEtcd

from federation.api.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    job_service_pb2,
    job_service_pb2_grpc,
)
from federation.coordinator.config import CoordinatorConfig
from federation.coordinator.server import SERVICE_NAMES, Coordinator, start_coordinator
from federation.jobspec import job_spec_from_dict
from federation.security.pki import PkiLayout, init_pki
from federation.security.tls import TlsFiles, channel_credentials
from federation.store.etcd import EtcdStore

pytestmark = pytest.mark.xdist_group("etcd")

WAIT_S = 10.0
JOB_SERVICE = SERVICE_NAMES[0]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest_asyncio.fixture
async def pair(tmp_path: Path, etcd: LocalEtcd) -> AsyncIterator[tuple[Coordinator, Coordinator]]:
    """Two coordinators sharing a fresh etcd prefix, started one after the other."""
    pki = init_pki(tmp_path / "pki", server_sans=["localhost", "127.0.0.1"])
    prefix = f"/test-{uuid.uuid4().hex}"
    coordinators = []
    for name in ("one", "two"):
        config = CoordinatorConfig(
            data_dir=tmp_path / name,
            ca_cert=pki.ca_cert,
            ca_key=pki.ca_key,
            cert=pki.server_cert,
            key=pki.server_key,
            listen="127.0.0.1:0",
            join_listen="127.0.0.1:0",
            store="etcd",
            etcd_endpoints=[etcd.endpoint],
            etcd_prefix=prefix,
            leader_lease_s=1.0,
        )
        coordinators.append(await start_coordinator(config))
    yield coordinators[0], coordinators[1]
    for coordinator in coordinators:
        await coordinator.stop(grace_s=None)


def operator_channel(tmp_path: Path, coordinator: Coordinator) -> grpc.aio.Channel:
    """An operator's channel to one coordinator."""
    pki = PkiLayout(tmp_path / "pki")
    tls = TlsFiles(
        ca=pki.ca_cert, cert=pki.client_cert("operator-admin"), key=pki.client_key("operator-admin")
    )
    return grpc.aio.secure_channel(coordinator.me.address, channel_credentials(tls))


def error_info(err: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    """The ErrorInfo detail of a failed call."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return info


async def leader_of(pair: tuple[Coordinator, Coordinator]) -> tuple[Coordinator, Coordinator]:
    """(leader, follower), once both know who leads."""
    one, two = pair
    assert one.election is not None
    assert two.election is not None
    async with asyncio.timeout(WAIT_S):
        leader = await one.election.known_leader()
        assert await two.election.known_leader() == leader
    return (one, two) if leader == one.me else (two, one)


async def drain(events: AsyncIterator[object]) -> None:
    """Read ``events`` until the stream ends or fails (failing the test after ``WAIT_S``)."""
    async with asyncio.timeout(WAIT_S):
        async for _ in events:
            pass


async def serving(channel: grpc.aio.Channel) -> None:
    """Return once the coordinator behind ``channel`` serves the JobService."""
    stream = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service=JOB_SERVICE)
    )
    async with asyncio.timeout(WAIT_S):
        async for reply in stream:
            if reply.status == SERVING:
                stream.cancel()
                return


async def test_follower_refuses_with_the_leaders_address(
    tmp_path: Path, pair: tuple[Coordinator, Coordinator]
) -> None:
    """A follower is healthy but not serving, refuses RPCs naming the leader; the leader lists
    both."""
    leader, follower = await leader_of(pair)
    async with operator_channel(tmp_path, follower) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        overall = await health.Check(health_pb2.HealthCheckRequest(service=""))
        jobs = await health.Check(health_pb2.HealthCheckRequest(service=JOB_SERVICE))
        assert (overall.status, jobs.status) == (SERVING, NOT_SERVING)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await admin_service_pb2_grpc.AdminServiceStub(channel).GetFederationStatus(
                admin_service_pb2.GetFederationStatusRequest()
            )
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    info = error_info(caught.value)
    assert info.reason == "NOT_LEADER"
    assert dict(info.metadata) == {
        "leader": leader.me.address,
        "leader_join": leader.me.join_address,
    }
    async with operator_channel(tmp_path, leader) as channel:
        await serving(channel)  # known as the leader a moment before its term's services are up
        status = await admin_service_pb2_grpc.AdminServiceStub(channel).GetFederationStatus(
            admin_service_pb2.GetFederationStatusRequest()
        )
    assert status.leader == leader.me.address
    assert sorted((c.address, c.leader) for c in status.coordinators) == sorted(
        [(leader.me.address, True), (follower.me.address, False)]
    )


async def test_lost_lease_steps_down_at_once_and_the_follower_takes_over(
    tmp_path: Path, etcd: LocalEtcd, pair: tuple[Coordinator, Coordinator]
) -> None:
    """A leader whose lease is revoked stops scheduling, ends its watches with NOT_LEADER and
    stops serving; the follower leads with the jobs the first one accepted."""
    leader, follower = await leader_of(pair)
    assert leader.election is not None
    job = job_spec_from_dict({"name": "kept", "tasks": [{"name": "t", "command": ["true"]}]})
    async with operator_channel(tmp_path, leader) as channel:
        # Known as the leader a moment before its term's services are up.
        await serving(channel)
        services = leader.leadership.current()
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        watch = stub.WatchJobs(job_service_pb2.WatchJobsRequest())
        submitted = (await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))).job
        events = aiter(watch)
        async with asyncio.timeout(WAIT_S):
            assert (await anext(events)).events[0].job_id == submitted.id
        admin = await EtcdStore.open([etcd.endpoint], prefix="")
        try:
            await admin.revoke(leader.election.lease)  # as if its keepalives stopped arriving
        finally:
            await admin.close()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await drain(events)
        assert error_info(caught.value).reason == "NOT_LEADER"
        assert services.scheduler_task.done()
        health = health_pb2_grpc.HealthStub(channel)
        check = await health.Check(health_pb2.HealthCheckRequest(service=JOB_SERVICE))
        assert check.status == NOT_SERVING
    async with operator_channel(tmp_path, follower) as channel:
        await serving(channel)
        got = await job_service_pb2_grpc.JobServiceStub(channel).GetJob(
            job_service_pb2.GetJobRequest(job_id=submitted.id)
        )
    assert got.job.id == submitted.id
    assert leader.election is not None
    async with asyncio.timeout(WAIT_S):
        assert await leader.election.known_leader() == follower.me
