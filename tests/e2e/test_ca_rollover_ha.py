"""A CA rollover in an HA group: two coordinators on one real etcd, each with its own server
certificate files, no restart.

``rotate-ca --new-root``, ``renew`` and ``retire-ca`` go through the leader. The follower takes
each change from the store's watch: after the retirement it serves a server certificate of the
new CA (a client that trusts only the new root completes a handshake with it) and refuses a
certificate of the retired CA; once the leader is SIGKILLed it leads, and a client holding
only the new root reaches it and gets certificates of the new CA from it.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from federation.api.v1 import certificate_service_pb2, job_service_pb2
from federation.local import LocalFederation
from federation.security.identity import Identity, Role
from federation.security.pki import PkiLayout, bundle_pem, issued_by, load_bundle
from federation.security.tls import TlsFiles, channel_credentials
from federation.testing.cluster import etcd_coordinator_args, leader_name
from federation.testing.etcd import etcd_binary

from .conftest import etcd_prefix, jobs, tls_for, until
from .test_ca_rollover import leaf, roots
from .test_cli import fedctl
from .test_renewal import certificates

pytestmark = [
    pytest.mark.xdist_group("e2e-ca-rollover"),
    pytest.mark.skipif(
        etcd_binary() is None, reason="etcd is not installed (apt-get install -y etcd-server)"
    ),
]

LEASE_S = 2.0


def fedctl_at(fed: LocalFederation, address: str, *args: str) -> None:
    """fedctl as the operator of the pki folder, at ``address``; it must succeed."""
    done = fedctl(fed, *args, env={"FEDCTL_COORDINATOR": address})
    assert done.returncode == 0, done.stderr


async def handshake(address: str, tls: TlsFiles) -> bool:
    """Whether a health check over mTLS gets an answer (any: a follower answers too)."""
    async with grpc.aio.secure_channel(address, channel_credentials(tls)) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=2
            )
        except grpc.aio.AioRpcError:
            return False
    return True


async def call(address: str, tls: TlsFiles) -> grpc.StatusCode:
    async with grpc.aio.secure_channel(address, channel_credentials(tls)) as channel:
        try:
            await jobs(channel).ListJobs(job_service_pb2.ListJobsRequest(), timeout=5)
        except grpc.aio.AioRpcError as err:
            return err.code()
    return grpc.StatusCode.OK


async def test_the_follower_follows_a_rollover_and_leads_after_it(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    etcd = request.getfixturevalue("shared_etcd")
    fed = LocalFederation(
        tmp_path / "fed",
        [],
        coordinator_args=etcd_coordinator_args(etcd.endpoint, etcd_prefix(), LEASE_S),
    )
    # Each coordinator has its own server certificate files, as on hosts of their own.
    own = PkiLayout(tmp_path / "pki-b")
    try:
        await fed.start_coordinator(name="coord-a")
        shutil.copytree(fed.pki.dir, own.dir)
        await fed.start_coordinator(name="coord-b", args=["--pki-dir", str(own.dir)])
        leader = await leader_name(fed)
        follower = next(name for name in fed.coordinators if name != leader)
        follower_files = own if follower == "coord-b" else fed.pki
        at_leader, at_follower = fed.address_of(leader), fed.address_of(follower)
        old_server = leaf(follower_files.server_cert)
        stale = tls_for(fed, Identity(Role.TENANT, "stale"))  # issued by the old CA
        old_root = roots(fed.pki.ca_cert)

        fedctl_at(fed, at_leader, "pki", "rotate-ca", "--new-root")
        new_issuer = leaf(fed.pki.issuing_cert)
        [new_root] = [r for r in roots(fed.pki.ca_cert) if r not in old_root]
        fedctl_at(fed, at_leader, "pki", "renew")
        only_new = tmp_path / "new-root.pem"
        only_new.write_bytes(bundle_pem([new_root]))
        operator = TlsFiles(
            ca=only_new,
            cert=fed.pki.client_cert("operator-admin"),
            key=fed.pki.client_key("operator-admin"),
        )
        assert issued_by(leaf(operator.cert), new_issuer)
        # Before the retirement the follower still serves its certificate of the old CA.
        assert not await handshake(at_follower, operator)

        fedctl_at(fed, at_leader, "pki", "retire-ca")
        retired_at = time.monotonic()
        await until(lambda: handshake(at_follower, operator), "the follower's new certificate", 5)
        followed_s = time.monotonic() - retired_at
        print(f"follower serves a certificate of the new CA {followed_s:.2f} s after retire-ca")
        served = leaf(follower_files.server_cert)
        assert served != old_server
        assert issued_by(served, new_issuer)
        assert served.subject == old_server.subject
        assert follower_files.server_key.stat().st_mode & 0o777 == 0o600
        assert await call(at_follower, operator) == grpc.StatusCode.UNAVAILABLE  # NOT_LEADER

        # A certificate of the retired CA is refused by the follower too, with the reason.
        stale_new_root = TlsFiles(ca=only_new, cert=stale.cert, key=stale.key)
        async with grpc.aio.secure_channel(
            at_follower, channel_credentials(stale_new_root)
        ) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await jobs(channel).ListJobs(job_service_pb2.ListJobsRequest())
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "retired" in (refused.value.details() or "")

        # The leader dies: the follower leads, reached by a client holding only the new root.
        fed.kill(leader)

        async def leads() -> bool:
            return await call(at_follower, operator) == grpc.StatusCode.OK

        await until(leads, "the follower to lead", LEASE_S + 10)
        async with grpc.aio.secure_channel(at_follower, channel_credentials(operator)) as channel:
            bundle = await certificates(channel).GetTrustBundle(
                certificate_service_pb2.GetTrustBundleRequest()
            )
        assert load_bundle(bundle.trust_bundle_pem) == [new_root]
        assert x509.load_pem_x509_certificate(bundle.issuing_ca_pem) == new_issuer
        before = leaf(operator.cert).serial_number
        fedctl_at(fed, at_follower, "pki", "renew")  # signed by the issuing CA it followed
        assert leaf(operator.cert).serial_number != before
        assert issued_by(leaf(operator.cert), new_issuer)
    finally:
        fed.stop()
