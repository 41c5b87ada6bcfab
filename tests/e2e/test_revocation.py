"""Revocation through a real federation over mTLS: a revoked identity or serial is refused on
its next call, its open streams end within a second, a revoked site is dropped for good, and
certificates issued after the revocation work. Bad requests store nothing."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from federation.api.v1 import (
    admin_service_pb2,
    audit_service_pb2,
    audit_service_pb2_grpc,
    certificate_service_pb2,
    certificate_service_pb2_grpc,
    job_service_pb2,
    records_pb2,
)
from federation.api.v1 import site_link_service_pb2_grpc as link_grpc
from federation.local import LocalFederation
from federation.security.identity import Identity, Role
from federation.security.pki import serial_hex
from federation.security.tls import channel_credentials
from federation.testing.cluster import etcd_coordinator_args, leader_name
from federation.testing.etcd import etcd_binary

from .conftest import (
    admin,
    channel_as,
    etcd_prefix,
    jobs,
    python_task,
    site_tls,
    spec,
    tenant_tls,
    tls_for,
    until,
    until_past,
)

pytestmark = pytest.mark.xdist_group("e2e-revocation")

SLEEPER = python_task(
    "sleep", "import time; time.sleep(120)", resources={"cpu": 1, "memory_mib": 64}
)


def certificates(channel: grpc.aio.Channel) -> certificate_service_pb2_grpc.CertificateServiceStub:
    return certificate_service_pb2_grpc.CertificateServiceStub(channel)


async def revoke(
    channel: grpc.aio.Channel, **target: str
) -> certificate_service_pb2.RevokeCertificatesResponse:
    request = certificate_service_pb2.RevokeCertificatesRequest(**target)
    return await certificates(channel).RevokeCertificates(request)


async def after(revocation: records_pb2.Revocation) -> None:
    """Wait into the second after the revocation's: certificates carry their issue time in
    seconds, so one issued in the revocation's own second counts as revoked."""
    await until_past(revocation.revoked_at.seconds + 1, "the second after the revocation")


async def stored(operator: grpc.aio.Channel) -> tuple[int, int]:
    """How many revocations and revocation audit entries are stored."""
    listed = await certificates(operator).ListCertificates(
        certificate_service_pb2.ListCertificatesRequest()
    )
    trail = await audit_service_pb2_grpc.AuditServiceStub(operator).ListAuditEvents(
        audit_service_pb2.ListAuditEventsRequest(action_prefix="certificate.revoke")
    )
    return len(listed.revocations), len(trail.events)


async def test_a_revoked_tenant_is_refused_and_its_watch_ends_within_a_second(
    federation: LocalFederation, operator: grpc.aio.Channel
) -> None:
    tls = tenant_tls(federation, "rev-a")
    async with channel_as(federation, tls) as channel:
        stub = jobs(channel)
        submitted = await stub.SubmitJob(
            job_service_pb2.SubmitJobRequest(spec=spec("watched", [SLEEPER]))
        )
        # Finished, so the watch gets nothing after the current state: only the revocation
        # can end it.
        await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=submitted.job.id))
        watch = stub.WatchJobs(
            job_service_pb2.WatchJobsRequest(job_ids=[submitted.job.id], include_current=True)
        )
        await anext(aiter(watch))  # the stream is open on the coordinator

        async def drain() -> None:
            async for _ in watch:
                pass

        draining = asyncio.create_task(drain())
        reply = await revoke(operator, identity="tenant:rev-a", reason="laptop stolen")
        revoked_at = time.monotonic()
        assert reply.revocation.identity == "tenant:rev-a"
        assert reply.revocation.revoked_by == "operator:admin"
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(draining, 5)
        assert time.monotonic() - revoked_at < 1.0
        assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "revoked" in (ended.value.details() or "")

        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ListJobs(job_service_pb2.ListJobsRequest())
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    details = refused.value.details() or ""
    assert f"certificate {serial_hex(tls.cert.read_bytes())} was revoked at" in details
    assert "laptop stolen" in details
    assert "rev-b" not in details

    await after(reply.revocation)
    fresh = tenant_tls(federation, "rev-a")  # issued offline after the revocation
    async with channel_as(federation, fresh) as channel:
        listed = await jobs(channel).ListJobs(job_service_pb2.ListJobsRequest())
        assert [j.id for j in listed.jobs] == [submitted.job.id]


async def test_an_operator_revoked_is_refused_and_others_are_not(
    federation: LocalFederation, operator: grpc.aio.Channel
) -> None:
    revoked = tls_for(federation, Identity(Role.OPERATOR, "rev-d"))
    peer = tls_for(federation, Identity(Role.OPERATOR, "rev-d2"))  # issued with it, not revoked
    tenant = tenant_tls(federation, "rev-c")
    request = certificate_service_pb2.ListCertificatesRequest(limit=1)
    async with channel_as(federation, revoked) as channel:
        await certificates(channel).ListCertificates(request)  # an operator's call, allowed
        reply = await revoke(operator, identity="operator:rev-d", reason="left the team")
        assert reply.revocation.identity == "operator:rev-d"
        for call in (
            certificates(channel).ListCertificates(request),
            jobs(channel).ListJobs(job_service_pb2.ListJobsRequest()),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            details = refused.value.details() or ""
            assert f"certificate {serial_hex(revoked.cert.read_bytes())} was revoked at" in details
            assert "left the team" in details

    async with channel_as(federation, peer) as channel:
        await certificates(channel).ListCertificates(request)
    async with channel_as(federation, tenant) as channel:
        await jobs(channel).ListJobs(job_service_pb2.ListJobsRequest())
    page = await certificates(operator).ListCertificates(request)  # the admin is not refused
    revocations = {r.identity: r.reason for r in page.revocations}
    assert revocations["operator:rev-d"] == "left the team"
    assert "operator:rev-d2" not in revocations


async def test_a_revoked_site_is_dropped_and_cannot_reconnect(
    federation: LocalFederation, operator: grpc.aio.Channel
) -> None:
    serial = serial_hex(site_tls(federation, "cloud-a").cert.read_bytes())

    async def state() -> int:
        sites = await admin(operator).ListSites(admin_service_pb2.ListSitesRequest())
        return next(s.state for s in sites.sites if s.name == "cloud-a")

    assert await state() == admin_service_pb2.SITE_STATE_CONNECTED
    reply = await revoke(operator, serial_hex=serial.upper(), reason="host compromised")
    assert list(reply.serials) == [serial]
    assert reply.revocation.serial_hex == serial
    started = time.monotonic()

    async def dropped() -> bool:
        return await state() != admin_service_pb2.SITE_STATE_CONNECTED

    await until(dropped, "cloud-a dropped", timeout_s=5)
    assert time.monotonic() - started < 1.5  # a second, and the time to ask
    assert "revoked_stream_closed" in federation.log_path("coordinator").read_text()
    # The agent takes UNAUTHENTICATED as final: it says why and stops, rather than retry.
    agent = federation.processes["cloud-a"]
    await until(lambda: _exited(agent), "the cloud-a agent to stop", timeout_s=15)
    assert "was revoked at" in federation.log_path("cloud-a").read_text()

    async with channel_as(federation, site_tls(federation, "cloud-a")) as channel:
        connect = link_grpc.SiteLinkServiceStub(channel).Connect(iter([]))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await anext(aiter(connect))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert await dropped()

    with pytest.raises(grpc.aio.AioRpcError) as twice:
        await revoke(operator, serial_hex=serial, reason="again")
    assert twice.value.code() == grpc.StatusCode.ALREADY_EXISTS

    crl = x509.load_pem_x509_crl(
        (
            await certificates(operator).GetRevocationList(
                certificate_service_pb2.GetRevocationListRequest()
            )
        ).crl_pem
    )
    ca = x509.load_pem_x509_certificate(federation.pki.issuing_cert.read_bytes())  # signs it
    assert crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
    assert crl.issuer == ca.subject
    listed_serial = crl.get_revoked_certificate_by_serial_number(int(serial, 16))
    assert listed_serial is not None

    page = await certificates(operator).ListCertificates(
        certificate_service_pb2.ListCertificatesRequest(identity="site:cloud-a")
    )
    assert [(c.serial_hex, c.revoked) for c in page.certificates] == [(serial, True)]
    assert any(r.serial_hex == serial and r.reason == "host compromised" for r in page.revocations)


async def _exited(process: subprocess.Popen[bytes]) -> bool:
    return process.poll() is not None


async def test_bad_revocations_are_refused_and_store_nothing(
    federation: LocalFederation, operator: grpc.aio.Channel
) -> None:
    before = await stored(operator)
    offline = serial_hex(tenant_tls(federation, "rev-e").cert.read_bytes())
    cases = [
        ({"serial_hex": offline, "reason": "x"}, grpc.StatusCode.NOT_FOUND, offline),
        ({"serial_hex": "not-hex", "reason": "x"}, grpc.StatusCode.INVALID_ARGUMENT, "serial_hex"),
        ({"identity": "rev-e", "reason": "x"}, grpc.StatusCode.INVALID_ARGUMENT, "identity"),
        ({"identity": "robot:x", "reason": "x"}, grpc.StatusCode.INVALID_ARGUMENT, "identity"),
        ({"identity": "tenant:rev-e"}, grpc.StatusCode.INVALID_ARGUMENT, "reason"),
        ({"identity": "tenant:rev-e", "reason": "  "}, grpc.StatusCode.INVALID_ARGUMENT, "reason"),
        ({"reason": "why"}, grpc.StatusCode.INVALID_ARGUMENT, "target"),
    ]
    for target, code, named in cases:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await revoke(operator, **target)
        assert refused.value.code() == code, target
        assert named in (refused.value.details() or ""), target
    assert await stored(operator) == before


async def test_tenants_may_not_list_or_revoke(federation: LocalFederation) -> None:
    async with channel_as(federation, tenant_tls(federation, "rev-f")) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await revoke(channel, identity="tenant:rev-g", reason="mine")
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_certificates_are_listed_newest_first_a_page_at_a_time(
    operator: grpc.aio.Channel,
) -> None:
    stub = certificates(operator)
    first = await stub.ListCertificates(certificate_service_pb2.ListCertificatesRequest(limit=1))
    assert len(first.certificates) == 1
    assert first.next_page_token
    rest = await stub.ListCertificates(
        certificate_service_pb2.ListCertificatesRequest(limit=10, page_token=first.next_page_token)
    )
    every = [*first.certificates, *rest.certificates]
    assert {c.identity for c in every} >= {"site:edge-a", "site:dc-a", "site:cloud-a"}
    times = [c.issued_at.ToNanoseconds() for c in every]
    assert times == sorted(times, reverse=True)
    assert not rest.revocations  # on the first page only
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await stub.ListCertificates(
            certificate_service_pb2.ListCertificatesRequest(page_token="/certificates/x")
        )
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_fedctl_pki_revoke_list_and_crl(federation: LocalFederation, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "FEDCTL_PKI_DIR": str(federation.pki.dir),
        "FEDCTL_COORDINATOR": federation.address,
    }

    def fedctl(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "federation.cli", "pki", *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)

    revoked = fedctl("revoke", "--operator", "rev-h", "--reason", "rotated out", "-o", "json")
    assert revoked.returncode == 0, revoked.stderr
    assert json.loads(revoked.stdout)["revocation"]["identity"] == "operator:rev-h"
    again = fedctl("revoke", "--tenant", "Bad Name", "--reason", "x")
    assert again.returncode == 1
    assert "identity" in again.stderr
    table = fedctl("list")
    assert table.returncode == 0, table.stderr
    assert "site:edge-a" in table.stdout
    assert "active" in table.stdout
    assert "operator:rev-h" in table.stdout  # among the revocations
    data = json.loads(fedctl("list", "--identity", "site:edge-a", "-o", "json").stdout)
    assert [c["identity"] for c in data["certificates"]] == ["site:edge-a"]
    assert data["certificates"][0]["state"] == "active"
    crl_file = tmp_path / "federation.crl.pem"
    written = fedctl("crl", "--file", str(crl_file))
    assert written.returncode == 0, written.stderr
    x509.load_pem_x509_crl(crl_file.read_bytes())
    printed = fedctl("crl")
    assert printed.stdout.startswith("-----BEGIN X509 CRL-----")


async def test_every_coordinator_sharing_the_store_refuses_within_a_second(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (apt-get install -y etcd-server)")
    etcd = request.getfixturevalue("shared_etcd")
    fed = LocalFederation(
        tmp_path / "fed",
        [],
        coordinator_args=etcd_coordinator_args(etcd.endpoint, etcd_prefix(), 3.0),
    )
    try:
        for name in ("coord-a", "coord-b"):
            await fed.start_coordinator(name=name)
        leader = await leader_name(fed)
        follower = next(name for name in fed.coordinators if name != leader)
        tls = tenant_tls(fed, "rev-ha")

        async def refusal(name: str) -> grpc.StatusCode:
            channel = grpc.aio.secure_channel(fed.address_of(name), channel_credentials(tls))
            async with channel:
                try:
                    await jobs(channel).ListJobs(job_service_pb2.ListJobsRequest())
                except grpc.aio.AioRpcError as err:
                    return err.code()
            return grpc.StatusCode.OK

        assert await refusal(follower) == grpc.StatusCode.UNAVAILABLE  # not the leader
        async with grpc.aio.secure_channel(
            fed.address_of(leader), channel_credentials(fed.operator().tls)
        ) as operator:
            await revoke(operator, identity="tenant:rev-ha", reason="left")
        started = time.monotonic()
        for name in (leader, follower):

            async def refused(name: str = name) -> bool:
                return await refusal(name) == grpc.StatusCode.UNAUTHENTICATED

            await until(refused, f"{name} to refuse", timeout_s=1.0)
        assert time.monotonic() - started < 1.0
    finally:
        fed.stop()
