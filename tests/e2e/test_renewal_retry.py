"""Renewals that cannot lock a holder out or multiply certificates, through a real federation.

A renewal repeated with the same CSR (its reply lost) gets the same certificate; the renewed
certificate works on until the new one is used (or the overlap ends), and is never renewed
again for another key; revoking it revokes its renewal; and an agent whose renewal reply was
lost and whose old certificate is then refused recovers by itself, its task running on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import (
    admin_service_pb2,
    certificate_service_pb2,
    job_service_pb2,
    jobs_pb2,
    site_link_service_pb2_grpc,
)
from federation.coordinator.security.renewal import MAX_LIVE_RENEWALS
from federation.local import LocalFederation
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
from .test_refusals import enrol_ghost
from .test_renewal import certificates, hello, renewals, serial_of

pytestmark = pytest.mark.xdist_group("e2e-renewal-retry")


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    """A federation of one site with the default overlap (ten minutes)."""
    federation = LocalFederation(tmp_path_factory.mktemp("fed"), [SITES[0]])
    try:
        asyncio.run(federation.start())
        yield federation
    finally:
        federation.stop()


async def renew(
    tls: TlsFiles, fed: LocalFederation, csr_pem: bytes
) -> certificate_service_pb2.RenewCertificateResponse:
    async with channel_as(fed, tls) as channel:
        return await certificates(channel).RenewCertificate(
            certificate_service_pb2.RenewCertificateRequest(csr_pem=csr_pem)
        )


async def list_jobs(fed: LocalFederation, tls: TlsFiles) -> None:
    async with channel_as(fed, tls) as channel:
        await jobs(channel).ListJobs(job_service_pb2.ListJobsRequest())


def written(folder: Path, name: str, cert_pem: bytes, key_pem: bytes, ca: Path) -> TlsFiles:
    (folder / f"{name}.pem").write_bytes(cert_pem)
    (folder / f"{name}-key.pem").write_bytes(key_pem)
    return TlsFiles(ca=ca, cert=folder / f"{name}.pem", key=folder / f"{name}-key.pem")


async def test_a_repeated_renewal_gets_the_same_certificate(
    fed: LocalFederation, tmp_path: Path
) -> None:
    """The same CSR twice: one certificate, one renewal recorded. Another CSR from the renewed
    certificate is refused, naming the newer serial. The renewed certificate works until the
    new one is used, and is refused from then on."""
    old = tenant_tls(fed, "retrying")
    key_pem, csr_pem = make_csr("x")
    first = await renew(old, fed, csr_pem)
    again = await renew(old, fed, csr_pem)
    assert again.serial_hex == first.serial_hex
    assert again.certificate_pem == first.certificate_pem
    with pytest.raises(grpc.aio.AioRpcError) as other:
        await renew(old, fed, make_csr("x")[1])
    assert other.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert first.serial_hex in (other.value.details() or "")
    async with fed.operator().channel() as operator:
        recorded = [e for e in await renewals(operator) if e.identity == "tenant:retrying"]
    assert [e.target for e in recorded] == [first.serial_hex]
    await list_jobs(fed, old)  # not used yet: the old one still works
    new = written(tmp_path, "new", first.certificate_pem, key_pem, old.ca)
    await list_jobs(fed, new)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await list_jobs(fed, old)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"renewed as {first.serial_hex}" in (refused.value.details() or "")
    # The lost reply can still be fetched again with the old certificate and the same CSR.
    assert (await renew(old, fed, csr_pem)).serial_hex == first.serial_hex


async def test_revoking_a_serial_revokes_its_renewals(fed: LocalFederation, tmp_path: Path) -> None:
    """A renewed certificate revoked by serial: the certificate renewed from it is refused
    too, and listed in the revocation's serials."""
    old = tenant_tls(fed, "stolen")
    key_pem, csr_pem = make_csr("x")
    reply = await renew(old, fed, csr_pem)
    new = written(tmp_path, "renewed", reply.certificate_pem, key_pem, old.ca)
    await list_jobs(fed, new)
    async with fed.operator().channel() as operator:
        revoked = await certificates(operator).RevokeCertificates(
            certificate_service_pb2.RevokeCertificatesRequest(
                serial_hex=serial_of(old.cert), reason="key stolen"
            )
        )
    assert reply.serial_hex in revoked.serials
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await list_jobs(fed, new)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "revoked" in (refused.value.details() or "")


async def test_a_site_whose_renewal_reply_was_lost_connects_with_its_old_certificate(
    fed: LocalFederation, tmp_path: Path
) -> None:
    """A site renewed, its reply lost: its old certificate still opens a session."""
    old = await enrol_ghost(fed, "ghost-lost-reply", tmp_path)
    await renew(old, fed, make_csr("x")[1])
    async with channel_as(fed, old) as channel:
        call = site_link_service_pb2_grpc.SiteLinkServiceStub(channel).Connect(
            hello("ghost-lost-reply")
        )
        first = await call.read()
        call.cancel()
    assert first.messages[0].WhichOneof("body") == "welcome"


async def test_an_agent_recovers_from_a_lost_renewal_reply(tmp_path: Path) -> None:
    """The agent's pending renewal is answered but the reply lost; with no overlap, the old
    certificate is refused at once. The coordinator restarts, the agent's session is refused,
    and the agent repeats its pending renewal, gets the same certificate, and reconnects:
    its task runs on (one pid) and its job finishes."""
    site = SITES[0]
    config = tmp_path / "coordinator.toml"
    config.write_text("renewal_overlap_s = 0\n")
    starts, go = tmp_path / "starts", tmp_path / "go"
    code = (
        "import os, time\n"
        f"open({str(starts)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
        "print('finished', os.getpid())\n"
    )
    task = python_task("t", code, resources={"accelerator": {"kind": "NPU", "count": 1}})
    federation = LocalFederation(
        tmp_path / "fed", [site], coordinator_args=["--config", str(config)]
    )
    try:
        await federation.start()
        tls = site_tls(federation, site.name)
        pending_key = tls.cert.parent / "renewal-key.pem"
        pending_csr = tls.cert.parent / "renewal-csr.pem"
        async with federation.operator().channel() as channel:
            job = (
                await jobs(channel).SubmitJob(
                    job_service_pb2.SubmitJobRequest(spec=spec("lost-reply", [task]))
                )
            ).job
            await wait_for_job(channel, job.id, frozenset({jobs_pb2.JOB_STATE_RUNNING}))
        await until(lambda: _started(starts), "the task to start", timeout_s=10)
        # What the agent writes before it asks: the pending key and CSR.
        key_pem, csr_pem = make_csr(site.name)
        pending_key.write_bytes(key_pem)
        pending_csr.write_bytes(csr_pem)
        lost = await renew(tls, federation, csr_pem)
        assert federation.terminate("coordinator")
        await federation.start_coordinator(port=federation.port, join_port=federation.join_port)
        agent = federation.processes[site.name]

        async def recovered() -> bool:
            assert agent.poll() is None, "the agent exited"
            return await asyncio.to_thread(serial_of, tls.cert) == lost.serial_hex

        await until(recovered, "the agent to repeat its renewal", timeout_s=30)
        await federation.wait_connected(timeout_s=30)
        async with federation.operator().channel() as channel:
            now = (await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job.id))).job
            assert now.state == jobs_pb2.JOB_STATE_RUNNING
            sites = await admin(channel).ListSites(admin_service_pb2.ListSitesRequest())
            go.touch()
            done = await wait_for_job(channel, job.id, timeout_s=30)
    finally:
        go.touch()
        federation.stop()
    assert not pending_csr.exists()
    assert not pending_key.exists()
    assert tls.key.read_bytes() == key_pem
    assert [s.state for s in sites.sites] == [admin_service_pb2.SITE_STATE_CONNECTED]
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
    [pid] = read_marker(starts)
    assert done.tasks[0].output_tail == f"finished {pid}\n"


async def _started(starts: Path) -> bool:
    return bool(read_marker(starts))


async def test_a_line_of_renewals_keeps_two_records_and_is_capped(
    fed: LocalFederation, tmp_path: Path
) -> None:
    """Renewing each new certificate in turn: two certificate records stay (the newest and
    the one renewed into it), and renewals past MAX_LIVE_RENEWALS are refused."""
    tls = tenant_tls(fed, "churning")
    for i in range(MAX_LIVE_RENEWALS):
        key_pem, csr_pem = make_csr("x")
        reply = await renew(tls, fed, csr_pem)
        tls = written(tmp_path, f"c{i}", reply.certificate_pem, key_pem, tls.ca)
    async with fed.operator().channel() as operator:
        listed = await certificates(operator).ListCertificates(
            certificate_service_pb2.ListCertificatesRequest(identity="tenant:churning")
        )
    assert listed.certificates[0].serial_hex == reply.serial_hex
    assert len(listed.certificates) == 2
    assert not any(c.certificate_pem for c in listed.certificates)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await renew(tls, fed, make_csr("x")[1])
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "have not expired yet" in (refused.value.details() or "")
