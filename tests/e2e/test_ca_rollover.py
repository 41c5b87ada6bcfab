"""A CA rollover through a real federation, agents and a client connected throughout.

A new root and a new issuing CA are introduced with ``fedctl pki rotate-ca --new-root``; the
agents are told the bundle of both roots over their session and renew under the new CA (site
certificates live 15 s here, so that takes seconds); the operator renews with ``fedctl pki
renew``; ``fedctl pki retire-ca`` switches the coordinator's server certificate and drops the
old root. The task's process runs on with one pid, no site ever shows unreachable, a
WatchJobs stream opened before it all is still open after it, and a certificate of the old
CA is refused with a clear error.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from federation.api.v1 import (
    admin_service_pb2,
    audit_service_pb2,
    audit_service_pb2_grpc,
    certificate_service_pb2,
    job_service_pb2,
    jobs_pb2,
)
from federation.local import LocalFederation
from federation.security.identity import Identity, Role
from federation.security.pki import issued_by, load_bundle
from federation.security.tls import TlsFiles
from federation.watch import events_of

from .conftest import (
    SITES,
    admin,
    channel_as,
    jobs,
    python_task,
    read_marker,
    site_tls,
    spec,
    tls_for,
    until,
    wait_for_job,
)
from .test_cli import fedctl
from .test_renewal import certificates, short_lived

pytestmark = pytest.mark.xdist_group("e2e-ca-rollover")


def roots(path: Path) -> list[x509.Certificate]:
    return load_bundle(path.read_bytes())


def leaf(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


async def test_ca_rollover_with_agents_and_a_client_connected(tmp_path: Path) -> None:
    """Rotate to a new root and issuing CA, renew, retire the old: one pid, never
    unreachable, the watch unbroken; the old CA's certificates are refused afterwards."""
    sites = SITES[:2]
    starts, go = tmp_path / "starts", tmp_path / "go"
    code = (
        "import os, time\n"
        f"open({str(starts)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
        "print('finished', os.getpid())\n"
    )
    task = python_task("t", code, resources={"cpu": 1})
    fed = LocalFederation(tmp_path / "fed", sites, coordinator_args=short_lived(tmp_path))
    seen_states: set[int] = set()
    polls = 0
    files_moving = asyncio.Lock()  # a poll must not read a key pair half replaced

    async def watch_sites() -> None:
        nonlocal polls
        while True:
            async with files_moving, fed.operator().channel() as channel:
                listed = await admin(channel).ListSites(admin_service_pb2.ListSitesRequest())
            seen_states.update(s.state for s in listed.sites)
            polls += 1
            await asyncio.sleep(0.3)

    try:
        await fed.start()
        old_root = roots(fed.pki.ca_cert)
        old_issuer = leaf(fed.pki.issuing_cert)
        stale = tls_for(fed, Identity(Role.TENANT, "stale"))  # issued by the old CA
        stale_copy = TlsFiles(ca=tmp_path / "ca.pem", cert=stale.cert, key=stale.key)
        async with fed.operator().channel() as client:
            job = (
                await jobs(client).SubmitJob(
                    job_service_pb2.SubmitJobRequest(spec=spec("rolled", [task]))
                )
            ).job
            watch = jobs(client).WatchJobs(
                job_service_pb2.WatchJobsRequest(job_ids=[job.id], include_current=True)
            )
            await wait_for_job(client, job.id, frozenset({jobs_pb2.JOB_STATE_RUNNING}))
            await until(lambda: _true(bool(read_marker(starts))), "the task to start", 10)
            poller = asyncio.create_task(watch_sites())

            # 1. A new root and issuing CA; every agent is told the bundle of both roots.
            async with files_moving:
                rotated = await asyncio.to_thread(fedctl, fed, "pki", "rotate-ca", "--new-root")
            assert rotated.returncode == 0, rotated.stderr
            new_issuer = leaf(fed.pki.issuing_cert)
            assert new_issuer != old_issuer
            [new_root] = [r for r in roots(fed.pki.ca_cert) if r not in old_root]
            assert issued_by(new_issuer, new_root)
            for site in sites:
                bundle = site_tls(fed, site.name).ca
                await until(lambda b=bundle: _true(len(roots(b)) == 2), "the bundle", 10)

            # 2. Renewals move every agent onto the new CA, over its session.
            for site in sites:
                cert = site_tls(fed, site.name).cert
                await until(lambda c=cert: _true(issued_by(leaf(c), new_issuer)), "a renewal", 20)
            async with files_moving:
                renewed = await asyncio.to_thread(fedctl, fed, "pki", "renew")
            assert renewed.returncode == 0, renewed.stderr
            assert issued_by(leaf(fed.pki.client_cert("operator-admin")), new_issuer)

            # 3. Retire: the server certificate switches, the old root leaves the bundle.
            async with files_moving:
                retired = await asyncio.to_thread(fedctl, fed, "pki", "retire-ca")
            assert retired.returncode == 0, retired.stderr
            assert roots(fed.pki.ca_cert) == [new_root]
            assert issued_by(leaf(fed.pki.server_cert), new_issuer)
            for site in sites:
                tls = site_tls(fed, site.name)
                await until(lambda b=tls.ca: _true(len(roots(b)) == 1), "the new bundle", 10)
                # A renewal after the switch: the agent's next session trusts only the new
                # root and meets the new server certificate.
                serial = leaf(tls.cert).serial_number
                await until(
                    lambda c=tls.cert, s=serial: _true(leaf(c).serial_number != s),
                    "a renewal after the switch",
                    20,
                )

            # 4. A certificate of the old CA is refused, with the reason.
            stale_copy.ca.write_bytes(fed.pki.ca_cert.read_bytes())
            async with channel_as(fed, stale_copy) as as_stale:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await jobs(as_stale).ListJobs(job_service_pb2.ListJobsRequest())
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "retired" in (refused.value.details() or "")

            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
            go.touch()
            # The watch opened before the rollover sees the job end.
            async for event in events_of(watch):
                if event.job_state in (jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED):
                    break
        async with fed.operator().channel() as channel:
            done = (await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job.id))).job
            bundle = await certificates(channel).GetTrustBundle(
                certificate_service_pb2.GetTrustBundleRequest()
            )
            trail = audit_service_pb2_grpc.AuditServiceStub(channel)
            events = (
                await trail.ListAuditEvents(
                    audit_service_pb2.ListAuditEventsRequest(action_prefix="pki.")
                )
            ).events
    finally:
        go.touch()
        fed.stop()
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
    [pid] = read_marker(starts)
    assert done.tasks[0].output_tail == f"finished {pid}\n"
    assert done.tasks[0].moves == 0
    assert polls > 10
    assert seen_states == {admin_service_pb2.SITE_STATE_CONNECTED}
    assert load_bundle(bundle.trust_bundle_pem) == [new_root]
    assert [e.action for e in events] == ["pki.retire-ca", "pki.rotate-ca"]
    assert all(e.identity == "operator:admin" for e in events)


async def _true(value: bool) -> bool:
    return value
