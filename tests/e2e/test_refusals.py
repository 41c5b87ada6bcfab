"""What the coordinator refuses, how it says so, and that a refusal stores nothing."""

from __future__ import annotations

import asyncio
import json
import math
import stat
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from placement.test_selector_sandbox import OUTSIDE_SELECTORS

from federation.api.v1 import (
    admin_service_pb2,
    job_service_pb2,
    jobs_pb2,
    resources_pb2,
    site_link_service_pb2,
    site_link_service_pb2_grpc,
)
from federation.coordinator.jobs.redaction import REDACTED
from federation.local import LocalFederation
from federation.security.identity import Identity, Role
from federation.security.pki import init_pki, issue_client_files, make_csr
from federation.security.tls import TlsFiles, server_only_channel_credentials

from .conftest import (
    admin,
    channel_as,
    jobs,
    python_task,
    site_tls,
    spec,
    tenant_tls,
    until,
    until_past,
    wait_for_job,
)

pytestmark = pytest.mark.xdist_group("e2e-refusals")


def violations(err: grpc.aio.AioRpcError) -> dict[str, str]:
    """Field -> description from the status's BadRequest detail."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, "the error carries no rich status"
    out = {}
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out |= {v.field: v.description for v in bad.field_violations}
    return out


async def job_count(channel: grpc.aio.Channel) -> int:
    reply = await jobs(channel).ListJobs(job_service_pb2.ListJobsRequest(page_size=1000))
    return len(reply.jobs)


GOOD = {"cpu": 1, "memory_mib": 128}
FORTY = "[" + ",".join(str(i) for i in range(40)) + "]"
FREEZES = FORTY + ".all(a, " + FORTY + ".all(b, " + FORTY + ".all(c, a + b + c >= 0)))"
"""Three nested all() over 40 elements: evaluated unbounded, 64,000 bodies per device."""
PANICS = "device.memory_gib >= 1 && " * 2700 + "true &&& x"
"""Over 64 KiB with a syntax error past column 65,535: the CEL library panics on it."""
BAD_SPECS = [
    (
        "negative-ish cpu",
        spec("x", [python_task("t", "", resources={"cpu": -1})]),
        "spec.tasks[0].resources.cpu",
    ),
    (
        "absurd replicas",
        spec("x", [python_task("t", "", replicas=100000)]),
        "spec.tasks[0].replicas",
    ),
    (
        "absurd device count",
        spec(
            "x", [python_task("t", "", resources={"accelerator": {"kind": "GPU", "count": 1000}})]
        ),
        "spec.tasks[0].resources.accelerator.count",
    ),
    ("empty command", spec("x", [{"name": "t", "command": []}]), "spec.tasks[0].command"),
    ("name too long", spec("x" * 200, [python_task("t", "")]), "spec.name"),
    ("no tasks", spec("x", []), "spec.tasks"),
    ("bad id", spec("x", [python_task("t", "")], id="Not Valid!"), "spec.id"),
    ("the coordinator's id form", spec("x", [python_task("t", "")], id="j-mine"), "spec.id"),
    (
        "a stop after a disconnect later than the replacement",
        spec("x", [python_task("t", "")], disconnect={"lost_after_s": 10, "stop_after_s": 20}),
        "spec.disconnect.stop_after_s",
    ),
    (
        "retries beyond the limit",
        spec("x", [python_task("t", "", retry={"max_attempts": 1000})]),
        "spec.tasks[0].retry.max_attempts",
    ),
    (
        "selector too costly",
        spec("x", [python_task("t", "", resources={"accelerator": {"selector": FREEZES}})]),
        "spec.tasks[0].resources.accelerator.selector",
    ),
    (
        "selector that panics the CEL library",
        spec("x", [python_task("t", "", resources={"accelerator": {"selector": PANICS}})]),
        "spec.tasks[0].resources.accelerator.selector",
    ),
]


@pytest.mark.parametrize("selector", OUTSIDE_SELECTORS, ids=range(len(OUTSIDE_SELECTORS)))
async def test_selectors_that_ran_for_seconds_are_refused_at_once(
    operator: grpc.aio.Channel, selector: str
) -> None:
    """Each of these once passed the static estimate and held the event loop for seconds."""
    job = spec("x", [python_task("t", "", resources={"accelerator": {"selector": selector}})])
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jobs(operator).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))
    assert time.monotonic() - started < 1.0
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.tasks[0].resources.accelerator.selector" in violations(caught.value)


@pytest.mark.parametrize(("case", "job", "field"), BAD_SPECS, ids=[c[0] for c in BAD_SPECS])
async def test_bad_spec_is_refused_field_by_field(
    operator: grpc.aio.Channel, case: str, job: jobs_pb2.JobSpec, field: str
) -> None:
    """A malformed spec gets INVALID_ARGUMENT naming the field, and nothing is stored."""
    before = await job_count(operator)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jobs(operator).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in violations(caught.value)
    assert "Traceback" not in (caught.value.details() or "")
    assert await job_count(operator) == before


async def test_unknown_accelerator_kind_is_refused(operator: grpc.aio.Channel) -> None:
    """An accelerator kind outside the enum (as a raw number on the wire) is refused."""
    job = spec("x", [python_task("t", "", resources={"accelerator": {"count": 1}})])
    job.tasks[0].resources.accelerator.kind = 42  # type: ignore[assignment]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jobs(operator).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec.tasks[0].resources.accelerator.kind" in violations(caught.value)


async def test_duplicate_id_is_refused_and_the_original_kept(operator: grpc.aio.Channel) -> None:
    """Reusing a job id is INVALID_ARGUMENT on spec.id; the first job is untouched."""
    first = spec("dup", [python_task("t", "print('first')")], id="dup-id-1")
    stub = jobs(operator)
    await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=first))
    again = spec("other", [python_task("t", "print('second')")], id="dup-id-1")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=again))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already exists" in violations(caught.value)["spec.id"]
    kept = (await stub.GetJob(job_service_pb2.GetJobRequest(job_id="dup-id-1"))).job
    assert kept.spec.name == "dup"


async def test_a_batch_reusing_an_id_names_the_spec_in_it(operator: grpc.aio.Channel) -> None:
    """A SubmitJobs batch, even of one spec, that reuses a stored id is refused on
    ``specs[i].id``, not on SubmitJob's ``spec.id``."""
    stub = jobs(operator)
    await stub.SubmitJob(
        job_service_pb2.SubmitJobRequest(spec=spec("a", [python_task("t", "")], id="dup-id-2"))
    )
    for batch, index in (([], 0), ([spec("ok", [python_task("t", "")])], 1)):
        again = spec("b", [python_task("t", "")], id="dup-id-2")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=[*batch, again]))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "already exists" in violations(caught.value)[f"specs[{index}].id"]


async def test_batch_with_one_bad_spec_stores_nothing(operator: grpc.aio.Channel) -> None:
    """SubmitJobs is all or nothing: one bad spec rejects the batch, naming its index."""
    before = await job_count(operator)
    good = spec("ok", [python_task("t", "")])
    bad = spec("bad", [{"name": "t", "command": [""]}])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jobs(operator).SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=[good, bad]))
    assert "specs[1].tasks[0].command" in violations(caught.value)
    assert await job_count(operator) == before


async def test_tenants_see_and_cancel_only_their_own_jobs(federation: LocalFederation) -> None:
    """Tenant B cannot get, list or cancel tenant A's job, nor submit as A."""
    async with (
        channel_as(federation, tenant_tls(federation, "team-a")) as a,
        channel_as(federation, tenant_tls(federation, "team-b")) as b,
    ):
        job = (
            await jobs(a).SubmitJob(
                job_service_pb2.SubmitJobRequest(
                    spec=spec("mine", [python_task("t", "import time; time.sleep(30)")])
                )
            )
        ).job
        assert job.spec.tenant == "team-a"
        for call in (
            jobs(b).GetJob(job_service_pb2.GetJobRequest(job_id=job.id)),
            jobs(b).CancelJob(job_service_pb2.CancelJobRequest(job_id=job.id)),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        listed = await jobs(b).ListJobs(job_service_pb2.ListJobsRequest(page_size=1000))
        assert job.id not in {j.id for j in listed.jobs}
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs(b).SubmitJob(
                job_service_pb2.SubmitJobRequest(
                    spec=spec("spoof", [python_task("t", "")], tenant="team-a")
                )
            )
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        cancelled = await jobs(a).CancelJob(job_service_pb2.CancelJobRequest(job_id=job.id))
        assert cancelled.job.cancel_requested


async def test_job_ids_are_each_tenants_own(federation: LocalFederation) -> None:
    """An id one tenant chose tells another nothing: B may choose it too, gets its own job, and
    each tenant reaches its own by the id it chose; a second use in one namespace is refused."""
    async with (
        channel_as(federation, tenant_tls(federation, "team-a")) as a,
        channel_as(federation, tenant_tls(federation, "team-b")) as b,
    ):
        made = {}
        for name, channel in (("a", a), ("b", b)):
            job = spec(f"from-{name}", [python_task("t", "")], id="shared-id")
            reply = await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))
            made[name] = reply.job
        assert made["a"].id == "team-a:shared-id"
        assert made["b"].id == "team-b:shared-id"
        for name, channel in (("a", a), ("b", b)):
            for asked in ("shared-id", made[name].id):
                got = await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=asked))
                assert got.job.spec.name == f"from-{name}"
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs(b).GetJob(job_service_pb2.GetJobRequest(job_id=made["a"].id))
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        again = spec("again", [python_task("t", "")], id="shared-id")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs(a).SubmitJob(job_service_pb2.SubmitJobRequest(spec=again))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "team-b" not in caught.value.details()
        done = await wait_for_job(b, "shared-id")
        assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED


async def test_roles_are_enforced_per_service(federation: LocalFederation) -> None:
    """A tenant may not use AdminService and a site may not use JobService."""
    async with channel_as(federation, tenant_tls(federation, "team-c")) as tenant:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await admin(tenant).ListSites(admin_service_pb2.ListSitesRequest())
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    async with channel_as(federation, site_tls(federation, "dc-a")) as site:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs(site).ListJobs(job_service_pb2.ListJobsRequest())
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_clients_without_a_federation_certificate_are_refused(
    federation: LocalFederation,
    operator: grpc.aio.Channel,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """No client certificate, or one from another CA, is refused in the TLS handshake."""
    other = init_pki(tmp_path_factory.mktemp("other") / "pki", server_sans=["localhost"])
    cert, key = issue_client_files(other, Identity(Role.OPERATOR, "admin"))
    foreign = TlsFiles(ca=federation.pki.ca_cert, cert=cert, key=key)
    before = await job_count(operator)
    bare = grpc.aio.secure_channel(
        federation.address, server_only_channel_credentials(federation.pki.ca_cert)
    )
    for channel in (bare, channel_as(federation, foreign)):
        async with channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await jobs(channel).SubmitJob(
                    job_service_pb2.SubmitJobRequest(spec=spec("x", [python_task("t", "")])),
                    timeout=10,
                )
            # gRPC Python can only require client certificates at the handshake, so the
            # refusal surfaces as UNAVAILABLE before any RPC reaches the coordinator.
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert await job_count(operator) == before


async def join(
    fed: LocalFederation, token: str, csr: bytes | None = None
) -> site_link_service_pb2.JoinResponse:
    creds = server_only_channel_credentials(fed.pki.ca_cert)
    async with grpc.aio.secure_channel(f"127.0.0.1:{fed.join_port}", creds) as channel:
        stub = site_link_service_pb2_grpc.SiteLinkServiceStub(channel)
        csr_pem = csr if csr is not None else make_csr("x")[1]
        return await stub.Join(site_link_service_pb2.JoinRequest(token=token, csr_pem=csr_pem))


async def test_join_tokens_work_once(federation: LocalFederation) -> None:
    """A token signs one CSR; a second use, an expired or a made-up token is UNAUTHENTICATED."""
    token = await federation.create_token("late-site", "edge")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await join(federation, token, csr=b"not a csr")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # token not burned by this
    reply = await join(federation, token)
    assert reply.site == "late-site"
    assert b"BEGIN CERTIFICATE" in reply.certificate_pem
    async with federation.operator().channel() as channel:
        short = await admin(channel).CreateJoinToken(
            admin_service_pb2.CreateJoinTokenRequest(site="short-lived", domain=1, ttl_s=0.001)
        )
    await until_past(short.expires_at.seconds, "the short token's expiry")
    for bad in (token, short.token, "fedjoin.made-up"):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await join(federation, bad)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_join_port_serves_nothing_else(federation: LocalFederation) -> None:
    """The join port (no client certificates) refuses every RPC but Join."""
    creds = server_only_channel_credentials(federation.pki.ca_cert)
    async with grpc.aio.secure_channel(f"127.0.0.1:{federation.join_port}", creds) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs(channel).ListJobs(job_service_pb2.ListJobsRequest())
    assert caught.value.code() in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED)


def test_agent_keys_are_private(federation: LocalFederation) -> None:
    """The site key and certificate an agent stores after Join are readable by it alone."""
    tls = site_tls(federation, "edge-a")
    for path in (tls.key, tls.cert):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def envelope(**body: Any) -> site_link_service_pb2.ConnectRequest:
    """One agent message alone in a stream write."""
    return site_link_service_pb2.ConnectRequest(
        messages=[site_link_service_pb2.AgentMessage(**body)]
    )


async def hello_from(site: str) -> AsyncIterator[site_link_service_pb2.ConnectRequest]:
    yield envelope(hello=site_link_service_pb2.Hello(view={"site": site}, generation=1))
    await asyncio.sleep(30)


async def test_site_may_not_speak_for_another(
    federation: LocalFederation, operator: grpc.aio.Channel
) -> None:
    """A stream whose hello claims another site ends PERMISSION_DENIED; others keep working."""
    async with channel_as(federation, site_tls(federation, "dc-a")) as channel:
        stub = site_link_service_pb2_grpc.SiteLinkServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Connect(hello_from("cloud-a")):
                pass
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    sites = await admin(operator).ListSites(admin_service_pb2.ListSitesRequest())
    states = {s.name: s.state for s in sites.sites}
    assert states["cloud-a"] == admin_service_pb2.SITE_STATE_CONNECTED
    assert states["dc-a"] == admin_service_pb2.SITE_STATE_CONNECTED


async def test_stream_must_start_with_hello(federation: LocalFederation) -> None:
    """A Connect stream that opens with anything but hello ends INVALID_ARGUMENT."""

    async def heartbeat_first() -> AsyncIterator[site_link_service_pb2.ConnectRequest]:
        yield envelope(heartbeat=site_link_service_pb2.Heartbeat())
        await asyncio.sleep(30)

    async with channel_as(federation, site_tls(federation, "cloud-a")) as channel:
        stub = site_link_service_pb2_grpc.SiteLinkServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Connect(heartbeat_first()):
                pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hello" in (caught.value.details() or "")


async def enrol_ghost(fed: LocalFederation, name: str, folder: Path) -> TlsFiles:
    """Join a site that runs no agent, so a test can speak the agent protocol by hand."""
    key_pem, csr_pem = make_csr(name)
    reply = await join(fed, await fed.create_token(name, "edge"), csr_pem)
    (folder / "key.pem").write_bytes(key_pem)
    (folder / "cert.pem").write_bytes(reply.certificate_pem)
    return TlsFiles(ca=fed.pki.ca_cert, cert=folder / "cert.pem", key=folder / "key.pem")


async def test_view_with_nan_is_refused(federation: LocalFederation, tmp_path: Path) -> None:
    """A hello whose view has a NaN CPU figure ends the stream INVALID_ARGUMENT, naming it."""
    tls = await enrol_ghost(federation, "ghost-nan", tmp_path)

    async def bad_hello() -> AsyncIterator[site_link_service_pb2.ConnectRequest]:
        view = resources_pb2.SiteView(site="ghost-nan")
        view.nodes.add(name="n", cpu_cores=4, cpu_free=math.nan)
        yield envelope(hello=site_link_service_pb2.Hello(view=view))
        await asyncio.sleep(30)

    async with channel_as(federation, tls) as channel:
        stub = site_link_service_pb2_grpc.SiteLinkServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.Connect(bad_hello()):
                pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "hello.view.nodes[0].cpu_free" in violations(caught.value)


async def test_silent_site_is_dropped(
    federation: LocalFederation, operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """A site that stops sending heartbeats loses its session with UNAVAILABLE: UNREACHABLE."""
    tls = await enrol_ghost(federation, "ghost-quiet", tmp_path)

    async def hello_then_silence() -> AsyncIterator[site_link_service_pb2.ConnectRequest]:
        view = resources_pb2.SiteView(site="ghost-quiet")
        yield envelope(hello=site_link_service_pb2.Hello(view=view))
        await asyncio.sleep(60)

    async with channel_as(federation, tls) as channel:
        stub = site_link_service_pb2_grpc.SiteLinkServiceStub(channel)
        call = stub.Connect(hello_then_silence())
        first = await call.read()
        assert first.messages[0].HasField("welcome")
        connected = await admin(operator).ListSites(admin_service_pb2.ListSitesRequest())
        assert {s.name: s.state for s in connected.sites}["ghost-quiet"] == (
            admin_service_pb2.SITE_STATE_CONNECTED
        )
        limit_s = 4 * first.messages[0].welcome.heartbeat_interval_s + 5
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # noqa: PT012
            async with asyncio.timeout(limit_s):
                while await call.read() is not grpc.aio.EOF:
                    pass  # probe peers and the like, until the coordinator drops us
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no heartbeat" in (caught.value.details() or "")
    after = await admin(operator).ListSites(admin_service_pb2.ListSitesRequest())
    quiet = next(s for s in after.sites if s.name == "ghost-quiet")
    assert quiet.state == admin_service_pb2.SITE_STATE_UNREACHABLE
    assert 0 < quiet.unreachable_s < 60


async def test_rejoining_retires_the_old_certificate(
    federation: LocalFederation, tmp_path: Path
) -> None:
    """After a site joins again, its previous certificate can no longer open a session."""
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old = await enrol_ghost(federation, "ghost-twice", tmp_path / "old")
    new = await enrol_ghost(federation, "ghost-twice", tmp_path / "new")

    async def hello() -> AsyncIterator[site_link_service_pb2.ConnectRequest]:
        view = resources_pb2.SiteView(site="ghost-twice")
        yield envelope(hello=site_link_service_pb2.Hello(view=view))
        await asyncio.sleep(30)

    async with channel_as(federation, old) as channel:
        call = site_link_service_pb2_grpc.SiteLinkServiceStub(channel).Connect(hello())
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call.read()
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "joined again" in (caught.value.details() or "")
    async with channel_as(federation, new) as channel:
        call = site_link_service_pb2_grpc.SiteLinkServiceStub(channel).Connect(hello())
        assert (await call.read()).messages[0].HasField("welcome")
        call.cancel()


async def test_a_goodbye_ends_the_session_cleanly(
    federation: LocalFederation, operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """A site that says goodbye gets a clean end of stream and shows DISCONNECTED."""
    tls = await enrol_ghost(federation, "ghost-polite", tmp_path)
    welcomed = asyncio.Event()

    async def hello_then_goodbye() -> AsyncIterator[site_link_service_pb2.ConnectRequest]:
        view = resources_pb2.SiteView(site="ghost-polite")
        yield envelope(hello=site_link_service_pb2.Hello(view=view))
        await welcomed.wait()
        goodbye = site_link_service_pb2.Goodbye(reason="maintenance")
        yield envelope(goodbye=goodbye)
        await asyncio.sleep(30)

    async with channel_as(federation, tls) as channel:
        call = site_link_service_pb2_grpc.SiteLinkServiceStub(channel).Connect(hello_then_goodbye())
        assert (await call.read()).messages[0].HasField("welcome")
        welcomed.set()
        async with asyncio.timeout(10):
            while await call.read() is not grpc.aio.EOF:
                pass  # probe peers and the like, until the coordinator ends the stream
        assert await call.code() == grpc.StatusCode.OK
    after = await admin(operator).ListSites(admin_service_pb2.ListSitesRequest())
    polite = next(s for s in after.sites if s.name == "ghost-polite")
    assert polite.state == admin_service_pb2.SITE_STATE_DISCONNECTED
    assert polite.unreachable_s == 0


async def test_env_values_are_read_only_by_their_tenant(
    federation: LocalFederation, operator: grpc.aio.Channel
) -> None:
    """A tenant reads its job's env values; an operator sees the names with the values
    redacted, in GetJob, ListJobs and CancelJob alike; the site still runs with the value."""
    code = "import os; assert os.environ['DB_PASSWORD'] == 'hunter2'"
    secret = python_task("t", code, env={"DB_PASSWORD": "hunter2", "MODE": "fast"})
    async with channel_as(federation, tenant_tls(federation, "team-env")) as tenant:
        job = (
            await jobs(tenant).SubmitJob(
                job_service_pb2.SubmitJobRequest(spec=spec("secretive", [secret]))
            )
        ).job
        done = await wait_for_job(tenant, job.id)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.tasks[0].reason
    assert dict(done.spec.tasks[0].env) == {"DB_PASSWORD": "hunter2", "MODE": "fast"}
    seen = (await jobs(operator).GetJob(job_service_pb2.GetJobRequest(job_id=job.id))).job
    listed = await jobs(operator).ListJobs(
        job_service_pb2.ListJobsRequest(tenant="team-env", page_size=10)
    )
    cancelled = (
        await jobs(operator).CancelJob(job_service_pb2.CancelJobRequest(job_id=job.id))
    ).job
    for copy in (seen, *listed.jobs, cancelled):
        assert dict(copy.spec.tasks[0].env) == {"DB_PASSWORD": REDACTED, "MODE": REDACTED}


def test_what_the_coordinator_writes_is_its_own(federation: LocalFederation) -> None:
    """Every file in the coordinator's data folder is 0600 and every folder 0700."""
    data = federation.root / "coordinator"
    paths = [data, *data.rglob("*")]
    assert len(paths) > 1
    for path in paths:
        want = 0o700 if path.is_dir() else 0o600
        assert stat.S_IMODE(path.stat().st_mode) == want, path


async def test_an_unknown_job_state_in_a_listing_is_named(operator: grpc.aio.Channel) -> None:
    """A state number no release has is a bad request naming the field, not an internal error."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await jobs(operator).ListJobs(job_service_pb2.ListJobsRequest(states=[1, 32]))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown job state 32" in violations(caught.value)["states[1]"]


async def test_the_coordinator_logs_each_jobs_lifecycle(
    federation: LocalFederation, operator: grpc.aio.Channel
) -> None:
    """Submitted, delegated, started and ended, each a JSON line with the job's id."""
    job = (
        await jobs(operator).SubmitJob(
            job_service_pb2.SubmitJobRequest(spec=spec("logged", [python_task("t", "")]))
        )
    ).job
    done = await wait_for_job(operator, job.id)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED
    log = federation.log_path("coordinator")

    def states() -> list[str]:
        lines = [json.loads(line) for line in log.read_text().splitlines() if job.id in line]
        events = [e for e in lines if e["event"] == "job_event"]
        return [f"{e['task']}:{e['state']}:{e['job_state']}" for e in events]

    async def logged() -> bool:  # the line follows the write the watch saw
        return "t:SUCCEEDED:SUCCEEDED" in states()

    await until(logged, "the job's end in the coordinator's log", timeout_s=10)
    assert states() == [
        ":PENDING:PENDING",
        "t:DELEGATED:DELEGATED",
        "t:RUNNING:RUNNING",
        "t:SUCCEEDED:SUCCEEDED",
    ]
