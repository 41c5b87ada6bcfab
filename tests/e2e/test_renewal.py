"""Certificate renewal through a real federation: an agent renews its short-lived certificate
over its own session and moves onto it without losing its session or its running task; the
old certificate no longer opens a session; tenants renew with ``fedctl pki renew``; bad
renewals are refused with one clear line and store nothing.

The issue asks for a 60 s certificate; the agent renews at two thirds of its lifetime, so
three renewals of a 60 s certificate take two minutes. The test uses a 15 s one (renewals
every 10 s) to prove the same thing in about 35 s.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from federation.api.v1 import (
    admin_service_pb2,
    audit_service_pb2,
    audit_service_pb2_grpc,
    certificate_service_pb2,
    certificate_service_pb2_grpc,
    job_service_pb2,
    jobs_pb2,
    resources_pb2,
    site_link_service_pb2,
    site_link_service_pb2_grpc,
)
from federation.local import LocalFederation
from federation.security.identity import identity_from_certificate
from federation.security.pki import make_csr
from federation.security.tls import TlsFiles

from .conftest import (
    SITES,
    admin,
    channel_as,
    jobs,
    python_task,
    read_marker,
    site_tls,
    spec,
    tenant_tls,
    until,
    wait_for_job,
)
from .test_refusals import enrol_ghost, violations

pytestmark = pytest.mark.xdist_group("e2e-renewal")

LIFETIME_S = 15


def short_lived(root: Path) -> list[str]:
    """Coordinator arguments that make site certificates live ``LIFETIME_S``."""
    config = root / "coordinator.toml"
    config.write_text(f"site_certificate_lifetime_s = {LIFETIME_S}\n")
    return ["--config", str(config)]


def serial_of(path: Path) -> str:
    return format(x509.load_pem_x509_certificate(path.read_bytes()).serial_number, "x")


async def _replaced(fed: LocalFederation) -> bool:
    """Whether the coordinator has seen a site's session replaced by its next one."""
    log = await asyncio.to_thread(fed.log_path("coordinator").read_text, errors="replace")
    return "site_session_replaced" in log


async def renewals(channel: grpc.aio.Channel) -> list[audit_service_pb2.AuditEvent]:
    """Every ``certificate.renew`` entry of the trail, oldest first."""
    request = audit_service_pb2.ListAuditEventsRequest(action_prefix="certificate.renew")
    trail = audit_service_pb2_grpc.AuditServiceStub(channel)
    return list(reversed((await trail.ListAuditEvents(request)).events))


def certificates(
    channel: grpc.aio.Channel,
) -> certificate_service_pb2_grpc.CertificateServiceStub:
    return certificate_service_pb2_grpc.CertificateServiceStub(channel)


def hello(site: str) -> AsyncIterator[site_link_service_pb2.ConnectRequest]:
    async def requests() -> AsyncIterator[site_link_service_pb2.ConnectRequest]:
        message = site_link_service_pb2.AgentMessage(
            hello=site_link_service_pb2.Hello(view=resources_pb2.SiteView(site=site))
        )
        yield site_link_service_pb2.ConnectRequest(messages=[message])
        await asyncio.sleep(30)

    return requests()


async def test_agent_keeps_its_session_and_task_across_three_renewals(tmp_path: Path) -> None:
    """Three renewals of a short-lived site certificate: the task's process runs on (one pid),
    its job never leaves RUNNING, the site never shows unreachable, its final report arrives;
    three new serials are chained by renewed_from, and the old certificate is refused."""
    site = SITES[0]
    starts, go = tmp_path / "starts", tmp_path / "go"
    code = (
        "import os, time\n"
        f"open({str(starts)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
        "print('finished', os.getpid())\n"
    )
    task = python_task("t", code, resources={"accelerator": {"kind": "NPU", "count": 1}})
    fed = LocalFederation(tmp_path / "fed", [site], coordinator_args=short_lived(tmp_path))
    try:
        await fed.start()
        tls = site_tls(fed, site.name)
        first_serial = serial_of(tls.cert)
        old = TlsFiles(ca=tls.ca, cert=tmp_path / "old.pem", key=tmp_path / "old-key.pem")
        shutil.copy(tls.cert, old.cert)
        shutil.copy(tls.key, old.key)
        async with fed.operator().channel() as channel:
            job = (
                await jobs(channel).SubmitJob(
                    job_service_pb2.SubmitJobRequest(spec=spec("renewed", [task]))
                )
            ).job
            await wait_for_job(channel, job.id, frozenset({jobs_pb2.JOB_STATE_RUNNING}))
            await until(lambda: _started(starts), "the task to start", timeout_s=10)
            await until(lambda: _changed(tls.cert, first_serial), "the first renewal", 20)
            # Once the agent's session runs on the new certificate (its first use ends the old
            # one's overlap), the old one is still within its lifetime, but no longer the site's.
            await until(lambda: _replaced(fed), "the session on the new certificate", 20)
            async with channel_as(fed, old) as as_old:
                call = site_link_service_pb2_grpc.SiteLinkServiceStub(as_old).Connect(
                    hello(site.name)
                )
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call.read()
            assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "renewed" in (caught.value.details() or "")

            async def three_renewed() -> bool:
                job_now = (
                    await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job.id))
                ).job
                assert job_now.state == jobs_pb2.JOB_STATE_RUNNING, job_now.state
                sites = await admin(channel).ListSites(admin_service_pb2.ListSitesRequest())
                [state] = [s.state for s in sites.sites if s.name == site.name]
                assert state == admin_service_pb2.SITE_STATE_CONNECTED, state
                return len(await renewals(channel)) >= 3

            await until(three_renewed, "three renewals", timeout_s=3 * LIFETIME_S)
            events = await renewals(channel)
            go.touch()
            done = await wait_for_job(channel, job.id, timeout_s=20)
            status = await admin(channel).GetFederationStatus(
                admin_service_pb2.GetFederationStatusRequest()
            )
    finally:
        go.touch()
        fed.stop()
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
    [pid] = read_marker(starts)
    assert done.tasks[0].output_tail == f"finished {pid}\n"
    assert done.tasks[0].moves == 0
    serials = [first_serial] + [e.target for e in events[:3]]
    assert len(set(serials)) == 4
    for previous, event in zip(serials[:3], events[:3], strict=True):
        assert event.identity == f"site:{site.name}"
        assert event.detail.startswith(f"renewed from {previous},"), event.detail
    soonest = status.soonest_expiring_certificate
    assert soonest.identity == f"site:{site.name}"
    assert soonest.renewed_from in serials
    assert status.server_certificate_not_after.seconds > soonest.not_after.seconds
    assert status.ca_not_after.seconds > 0
    assert tls.key.stat().st_mode & 0o777 == 0o600
    assert tls.cert.stat().st_mode & 0o777 == 0o600
    assert not list(tls.cert.parent.glob("*.next"))


async def _started(starts: Path) -> bool:
    return bool(read_marker(starts))


async def _changed(cert: Path, serial: str) -> bool:
    return await asyncio.to_thread(lambda: cert.exists() and serial_of(cert) != serial)


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    """A federation of one site with the default certificate lifetimes."""
    federation = LocalFederation(tmp_path_factory.mktemp("fed"), [SITES[0]])
    try:
        asyncio.run(federation.start())
        yield federation
    finally:
        federation.stop()


def fedctl(fed: LocalFederation, tls: TlsFiles, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "federation.cli",
        "--coordinator",
        fed.address,
        "--ca",
        str(tls.ca),
        "--cert",
        str(tls.cert),
        "--key",
        str(tls.key),
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


async def test_fedctl_pki_renew_for_a_tenant(fed: LocalFederation) -> None:
    """``fedctl pki renew`` replaces a tenant's pair (0600) with one for a new key that works,
    its renewal recorded as renewed from the old serial."""
    tls = tenant_tls(fed, "renewing")
    old_serial, old_key = serial_of(tls.cert), tls.key.read_bytes()
    renewed = await asyncio.to_thread(fedctl, fed, tls, "pki", "renew", "-o", "json")
    assert renewed.returncode == 0, renewed.stderr
    reply = json.loads(renewed.stdout)
    assert reply["identity"] == "tenant:renewing"
    assert reply["serial"] == serial_of(tls.cert) != old_serial
    assert tls.key.read_bytes() != old_key
    assert tls.cert.stat().st_mode & 0o777 == tls.key.stat().st_mode & 0o777 == 0o600
    async with channel_as(fed, tls) as channel:  # the new pair works
        await jobs(channel).ListJobs(job_service_pb2.ListJobsRequest())
    async with fed.operator().channel() as channel:
        [event] = [e for e in await renewals(channel) if e.target == reply["serial"]]
    assert event.identity == "tenant:renewing"
    assert event.detail.startswith(f"renewed from {old_serial},")
    table = await asyncio.to_thread(fedctl, fed, tls, "pki", "renew")
    assert table.returncode == 0, table.stderr
    assert "renewed tenant:renewing" in table.stdout
    assert "left" in table.stdout


async def test_a_csr_for_another_identity_gets_the_callers(fed: LocalFederation) -> None:
    """The CSR's subject is ignored: a tenant asking for an operator's name is renewed as
    itself."""
    tls = tenant_tls(fed, "ambitious")
    _, csr_pem = make_csr("operator:admin")
    async with channel_as(fed, tls) as channel:
        reply = await certificates(channel).RenewCertificate(
            certificate_service_pb2.RenewCertificateRequest(csr_pem=csr_pem)
        )
    assert str(identity_from_certificate(reply.certificate_pem)) == "tenant:ambitious"
    assert reply.ca_bundle_pem == fed.pki.ca_cert.read_bytes()


@pytest.mark.parametrize("csr", ["same-key", "garbage", "empty"])
async def test_bad_renewals_are_refused_and_store_nothing(fed: LocalFederation, csr: str) -> None:
    """A CSR for the current key, a garbage one and none at all: INVALID_ARGUMENT naming
    csr_pem in one line, and no renewal recorded."""
    tls = tenant_tls(fed, f"bad-{csr}")
    key = serialization.load_pem_private_key(tls.key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    same_key = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")]))
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
    )
    csr_pem = {"same-key": same_key, "garbage": b"-----BEGIN nonsense", "empty": b""}[csr]
    async with fed.operator().channel() as operator:
        before = len(await renewals(operator))
        async with channel_as(fed, tls) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await certificates(channel).RenewCertificate(
                    certificate_service_pb2.RenewCertificateRequest(csr_pem=csr_pem)
                )
        assert len(await renewals(operator)) == before
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "\n" not in (caught.value.details() or "")
    assert list(violations(caught.value)) == ["csr_pem"]
    if csr == "same-key":
        assert "key of the certificate being renewed" in violations(caught.value)["csr_pem"]


async def test_an_old_site_certificate_cannot_renew(fed: LocalFederation, tmp_path: Path) -> None:
    """Once a site renewed, its previous certificate may not renew again."""
    old = await enrol_ghost(fed, "ghost-renewing", tmp_path)
    async with channel_as(fed, old) as channel:
        first = await certificates(channel).RenewCertificate(
            certificate_service_pb2.RenewCertificateRequest(csr_pem=make_csr("x")[1])
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await certificates(channel).RenewCertificate(
                certificate_service_pb2.RenewCertificateRequest(csr_pem=make_csr("x")[1])
            )
    assert first.serial_hex
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "newer certificate" in (caught.value.details() or "")
