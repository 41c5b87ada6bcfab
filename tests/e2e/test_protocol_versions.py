"""Agents one site-link protocol version apart keep working; farther apart they are refused.

An agent of version 1 (from before the version fields: it sends 0 and no release) is spoken to
by hand over its Connect stream, with only the messages version 1 had: it is welcomed, takes
an offer and a commit, reports its task, and the job succeeds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from federation import __version__
from federation.api.v1 import (
    admin_service_pb2,
    job_service_pb2,
    jobs_pb2,
    resources_pb2,
    serving_service_pb2,
    serving_service_pb2_grpc,
)
from federation.api.v1 import site_link_service_pb2 as pb
from federation.api.v1 import site_link_service_pb2_grpc as link_grpc
from federation.endpoints import error_info
from federation.errors import ProtocolVersionError
from federation.local import LocalFederation
from federation.site_protocol import PROTOCOL_VERSION
from federation.testing.cluster import submit

from .conftest import admin, channel_as, jobs, python_task, spec, wait_for_job
from .test_refusals import enrol_ghost
from .test_site_checks import gpu_view

pytestmark = pytest.mark.xdist_group("e2e-protocol-versions")


async def view_like(fed: LocalFederation, site: str) -> resources_pb2.SiteView:
    """The view edge-a's agent reports, as ``site``'s."""
    async with fed.operator().channel() as channel:
        reply = await admin(channel).ListSites(admin_service_pb2.ListSitesRequest())
    view = next(s.view for s in reply.sites if s.name == "edge-a")
    view.site = site
    view.probe_endpoint = ""
    del view.links[:]
    view.ClearField("coordinator_link")
    return view


def one(**body: object) -> pb.ConnectRequest:
    return pb.ConnectRequest(messages=[pb.AgentMessage(**body)])  # type: ignore[arg-type]


async def sent_from(outbox: asyncio.Queue[pb.ConnectRequest]) -> AsyncIterator[pb.ConnectRequest]:
    """A hand-driven agent's side of Connect: what it puts in ``outbox``, and a heartbeat each
    second it has nothing to say."""
    while True:
        try:
            yield await asyncio.wait_for(outbox.get(), 1.0)
        except TimeoutError:
            yield one(heartbeat=pb.Heartbeat(generation=1))


async def test_an_agent_of_the_previous_version_runs_a_job(
    federation: LocalFederation, tmp_path: Path
) -> None:
    site = "old-agent"
    tls = await enrol_ghost(federation, site, tmp_path)
    outbox: asyncio.Queue[pb.ConnectRequest] = asyncio.Queue()
    # As version 1 sent it: no agent_version, no protocol_version; the view a real edge
    # agent sends, under this site's name.
    outbox.put_nowait(one(hello=pb.Hello(view=await view_like(federation, site), generation=1)))

    welcomes: list[pb.Welcome] = []
    acked = asyncio.Event()

    async def agent(call: grpc.aio.StreamStreamCall[pb.ConnectRequest, pb.ConnectResponse]) -> None:
        async for response in call:
            for message in response.messages:
                body = message.WhichOneof("body")
                cid = message.correlation_id
                if body == "welcome":
                    welcomes.append(message.welcome)
                elif body == "offer":
                    answer = pb.OfferAnswer(accepted=True, reservation_id="r-1", lease_s=30)
                    outbox.put_nowait(one(correlation_id=cid, offer_answer=answer))
                elif body == "commit":
                    commit = message.commit
                    outbox.put_nowait(one(correlation_id=cid, commit_answer={"started": True}))
                    for state in (jobs_pb2.JOB_STATE_RUNNING, jobs_pb2.JOB_STATE_SUCCEEDED):
                        report = pb.TaskReport(
                            job_id=commit.job_id, task=commit.task, epoch=commit.epoch, state=state
                        )
                        outbox.put_nowait(one(task_status=report))
                elif body == "ack":
                    acked.set()

    async with channel_as(federation, tls) as channel:
        call = link_grpc.SiteLinkServiceStub(channel).Connect(sent_from(outbox))
        serving = asyncio.create_task(agent(call))
        try:
            async with federation.operator().channel() as operator:
                pinned = spec("old-agent-job", [python_task("main", "pass")])
                pinned.constraints.sites.append(site)
                job_id = await submit(federation, pinned)
                job = await wait_for_job(operator, job_id, timeout_s=30)
            assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, job
            assert job.tasks[0].site == site
            await asyncio.wait_for(acked.wait(), 10)
        finally:
            call.cancel()
            serving.cancel()
    assert welcomes[0].protocol_version == 1  # what the coordinator speaks to it
    assert welcomes[0].coordinator_version == __version__


async def test_an_agent_two_versions_newer_is_refused(
    federation: LocalFederation, tmp_path: Path
) -> None:
    """FAILED_PRECONDITION, with the reason the agent takes as final and the fix."""
    announced = PROTOCOL_VERSION + 2  # one newer is spoken to in the coordinator's version
    site = f"far-agent-{announced}"
    tls = await enrol_ghost(federation, site, tmp_path)

    async def requests() -> AsyncIterator[pb.ConnectRequest]:
        hello = pb.Hello(view=gpu_view(site), generation=1, protocol_version=announced)
        yield one(hello=hello)
        await asyncio.sleep(30)

    async with channel_as(federation, tls) as channel:
        call = link_grpc.SiteLinkServiceStub(channel).Connect(requests())
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in call:
                pass
    err = caught.value
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "upgrade the coordinator" in (err.details() or "")
    info = error_info(err)
    assert info is not None
    assert info.reason == ProtocolVersionError.reason


async def test_a_service_at_an_agent_of_protocol_2_is_not_changed_in_place(
    federation: LocalFederation, tmp_path: Path
) -> None:
    """Version 2 has no ChangeTask: scaling a service that runs there is FAILED_PRECONDITION
    naming the site and the upgrade, and no change message reaches the agent."""
    site = "v2-agent"
    tls = await enrol_ghost(federation, site, tmp_path)
    outbox: asyncio.Queue[pb.ConnectRequest] = asyncio.Queue()
    hello = pb.Hello(
        view=await view_like(federation, site),
        generation=1,
        agent_version="0.0.9",
        protocol_version=2,
    )
    outbox.put_nowait(one(hello=hello))

    bodies: list[str] = []

    async def agent(call: grpc.aio.StreamStreamCall[pb.ConnectRequest, pb.ConnectResponse]) -> None:
        async for response in call:
            for message in response.messages:
                bodies.append(message.WhichOneof("body") or "")
                cid = message.correlation_id
                if message.HasField("offer"):
                    answer = pb.OfferAnswer(accepted=True, reservation_id="r-1", lease_s=30)
                    outbox.put_nowait(one(correlation_id=cid, offer_answer=answer))
                elif message.HasField("commit"):
                    commit = message.commit
                    outbox.put_nowait(one(correlation_id=cid, commit_answer={"started": True}))
                    report = pb.TaskReport(
                        job_id=commit.job_id,
                        task=commit.task,
                        epoch=commit.epoch,
                        state=jobs_pb2.JOB_STATE_RUNNING,
                    )
                    outbox.put_nowait(one(task_status=report))

    task = python_task("web", "pass", kind="TASK_KIND_SERVICE", replicas=1)
    pinned = spec("old-service", [task])
    pinned.constraints.sites.append(site)
    async with channel_as(federation, tls) as channel:
        call = link_grpc.SiteLinkServiceStub(channel).Connect(sent_from(outbox))
        serving = asyncio.create_task(agent(call))
        try:
            async with federation.operator().channel() as operator:
                job_id = await submit(federation, pinned)
                await wait_for_job(operator, job_id, frozenset({jobs_pb2.JOB_STATE_RUNNING}))
                stub = serving_service_pb2_grpc.ServingServiceStub(operator)
                scale = serving_service_pb2.ScaleServiceRequest(job_id=job_id, replicas=2)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.ScaleService(scale)
                await jobs(operator).CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id))
        finally:
            call.cancel()
            serving.cancel()
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = refused.value.details() or ""
    assert f"agent at site {site} speaks site-link protocol 2" in details
    assert f"upgrade the agent at {site}" in details
    assert "change" not in bodies


async def test_a_task_with_outputs_is_not_offered_to_an_agent_of_protocol_3(
    federation: LocalFederation, tmp_path: Path
) -> None:
    """Version 3 cannot store outputs nor stage inputs: such a task is never offered there,
    and waits with a verdict naming the protocol."""
    site = "v3-agent"
    tls = await enrol_ghost(federation, site, tmp_path)
    outbox: asyncio.Queue[pb.ConnectRequest] = asyncio.Queue()
    hello = pb.Hello(view=await view_like(federation, site), generation=1, protocol_version=3)
    outbox.put_nowait(one(hello=hello))
    bodies: list[str] = []

    async def agent(call: grpc.aio.StreamStreamCall[pb.ConnectRequest, pb.ConnectResponse]) -> None:
        async for response in call:
            bodies.extend(message.WhichOneof("body") or "" for message in response.messages)

    task = python_task("make", "pass", outputs=[{"name": "data", "path": "out.bin"}])
    pinned = spec("old-data", [task])
    pinned.constraints.sites.append(site)
    async with channel_as(federation, tls) as channel:
        call = link_grpc.SiteLinkServiceStub(channel).Connect(sent_from(outbox))
        serving = asyncio.create_task(agent(call))
        try:
            async with federation.operator().channel() as operator:
                job_id = await submit(federation, pinned)

                async def refused() -> list[str]:
                    request = job_service_pb2.GetJobRequest(job_id=job_id)
                    job = (await jobs(operator).GetJob(request)).job
                    return [v.reason for v in job.tasks[0].verdicts if v.site == site]

                deadline = asyncio.get_running_loop().time() + 30
                while not (reasons := await refused()):
                    assert asyncio.get_running_loop().time() < deadline, "no verdict for v3"
                    await asyncio.sleep(0.1)
                await jobs(operator).CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id))
        finally:
            call.cancel()
            serving.cancel()
    assert reasons == ["its agent speaks site-link protocol 3; outputs and staged inputs need 4"], (
        reasons
    )
    assert "offer" not in bodies
