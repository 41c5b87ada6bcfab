"""The offline root and the issuing CA, the trust bundle, and rotating and retiring CAs:
chains verify against the root alone, a pki from before the offline root still works, and
bad rotations and retirements are refused with one line, changing nothing."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import pytest_asyncio
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.general_name import DNSName
from cryptography.x509.oid import NameOID
from cryptography.x509.verification import PolicyBuilder
from cryptography.x509.verification import Store as TrustStore

from federation.api.v1 import certificate_service_pb2 as pb
from federation.coordinator.security.authorities import AUTHORITIES, Authorities
from federation.errors import (
    CertificateAuthorityRetiredError,
    FailedPreconditionError,
    InvalidArgumentError,
)
from federation.security.identity import Identity, Role
from federation.security.pki import (
    CaCheckError,
    CertificateAuthority,
    PkiLayout,
    init_pki,
    issue_client_files,
    key_pem,
    load_bundle,
    load_issuer,
    prepare_rotation,
    promote_prepared,
    write_prepared,
    write_private_file,
    write_public_file,
)
from federation.store import SqliteStore

TENANT = Identity(Role.TENANT, "acme")


@pytest.fixture
def pki(tmp_path: Path) -> PkiLayout:
    return init_pki(tmp_path / "pki", server_sans=["localhost", "127.0.0.1"])


@pytest_asyncio.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    opened = await SqliteStore.open(tmp_path / "store.db")
    yield opened
    await opened.close()


def authorities_of(pki: PkiLayout) -> Authorities:
    return Authorities.from_files(
        pki.ca_cert, pki.ca_key, pki.issuing_cert, pki.server_cert, pki.server_key
    )


def verify_client(chain_pem: bytes, roots: list[x509.Certificate]) -> None:
    """Path building as a TLS peer does it: the leaf and what follows it, against roots."""
    leaf, *intermediates = x509.load_pem_x509_certificates(chain_pem)
    verifier = PolicyBuilder().store(TrustStore(roots)).build_client_verifier()
    verifier.verify(leaf, intermediates)


def rotation_request(
    ca: CertificateAuthority, new_root: bytes = b""
) -> pb.RotateCertificateAuthorityRequest:
    return pb.RotateCertificateAuthorityRequest(
        issuing_ca_pem=ca.cert_pem, issuing_key_pem=key_pem(ca.key), new_roots_pem=new_root
    )


def test_every_issued_chain_verifies_against_the_root_alone(pki: PkiLayout) -> None:
    roots = load_bundle(pki.ca_cert.read_bytes())
    assert len(roots) == 1
    cert, _ = issue_client_files(pki, TENANT)
    verify_client(cert.read_bytes(), roots)
    verify_client(pki.client_cert("operator-admin").read_bytes(), roots)
    issuing = CertificateAuthority.load(pki.issuing_cert, pki.ca_key)
    leaf_only = x509.load_pem_x509_certificates(cert.read_bytes())[0]
    with pytest.raises(x509.verification.VerificationError):
        verify_client(leaf_only.public_bytes(Encoding.PEM), roots)
    assert issuing.chain_pem == issuing.cert_pem


def old_layout(folder: Path) -> PkiLayout:
    """A pki as 'fedctl pki init' wrote it before the offline root: one self-signed CA."""
    layout = PkiLayout(folder)
    folder.mkdir(mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "federation CA")])
    now = datetime.now(UTC)
    cert = (  # as the CA was made then: self-signed, pathLen 0
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), True
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )
    ca = CertificateAuthority(cert=cert, key=key)
    ca.save(layout.ca_cert, layout.ca_key)
    cert, key = ca.issue_server(["localhost"])
    write_public_file(layout.server_cert, cert)
    write_private_file(layout.server_key, key)
    return layout


def test_a_pki_from_before_the_offline_root_still_works(tmp_path: Path) -> None:
    layout = old_layout(tmp_path / "old")
    ca = load_issuer(layout.ca_cert, layout.ca_key, layout.issuing_cert)
    assert ca.chain_pem == b""  # its own root: nothing follows what it issues
    cert, _ = issue_client_files(layout, TENANT)
    verify_client(cert.read_bytes(), load_bundle(layout.ca_cert.read_bytes()))
    authorities = authorities_of(layout)
    authorities.check(cert.read_bytes())
    # Its CA may not sign an issuing CA (pathLen 0): the move to an offline root is to a new
    # root, proven by the old CA's key; the old CA stays trusted until retired.
    with pytest.raises(CaCheckError, match="To fix: rotate with --new-root"):
        prepare_rotation(layout)
    rotation = prepare_rotation(layout, new_root=True)
    assert rotation.new_root is not None
    write_prepared(layout, rotation)
    promote_prepared(layout)
    assert load_bundle(layout.ca_cert.read_bytes()) == [ca.cert, rotation.new_root.cert]
    assert CertificateAuthority.load(layout.ca_cert, layout.root_key.with_name("root-key.pem.old"))
    new_cert, _ = issue_client_files(layout, TENANT)
    verify_client(new_cert.read_bytes(), [rotation.new_root.cert])


def test_rotating_with_a_wrong_root_key_is_refused(pki: PkiLayout, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger-key.pem"
    write_private_file(stranger, key_pem(CertificateAuthority.create().key))
    before = sorted(p.name for p in pki.dir.iterdir())
    with pytest.raises(CaCheckError, match="is not the key of any root"):
        prepare_rotation(pki, root_key=stranger)
    assert sorted(p.name for p in pki.dir.iterdir()) == before


async def test_an_issuing_certificate_that_is_no_ca_is_refused(
    pki: PkiLayout, store: SqliteStore
) -> None:
    authorities = authorities_of(pki)
    issuing = CertificateAuthority.load(pki.issuing_cert, pki.ca_key)
    leaf_pem, leaf_key = issuing.issue_client(TENANT)
    request = pb.RotateCertificateAuthorityRequest(
        issuing_ca_pem=leaf_pem, issuing_key_pem=leaf_key
    )
    with pytest.raises(InvalidArgumentError) as refused:
        await authorities.rotate(store, "operator:admin", request)
    assert "is not a CA certificate" in refused.value.violations[0].description
    assert authorities.issuer.cert == issuing.cert
    assert await store.get(AUTHORITIES) is None


async def test_a_key_that_is_not_the_certificates_is_refused(
    pki: PkiLayout, store: SqliteStore
) -> None:
    authorities = authorities_of(pki)
    root = CertificateAuthority.load(pki.ca_cert, pki.root_key)
    new = CertificateAuthority.create("next", signed_by=root)
    other = CertificateAuthority.create("other", signed_by=root)
    request = pb.RotateCertificateAuthorityRequest(
        issuing_ca_pem=new.cert_pem, issuing_key_pem=key_pem(other.key)
    )
    with pytest.raises(InvalidArgumentError, match="issuing_ca_pem"):
        await authorities.rotate(store, "operator:admin", request)
    # Signed by a root the bundle does not hold, and not given as a new root.
    foreign = CertificateAuthority.create("foreign", signed_by=CertificateAuthority.create())
    with pytest.raises(InvalidArgumentError) as refused:
        await authorities.rotate(store, "operator:admin", rotation_request(foreign))
    assert "not signed by any root" in refused.value.violations[0].description
    assert await store.get(AUTHORITIES) is None


async def test_retiring_the_only_ca_is_refused(pki: PkiLayout, store: SqliteStore) -> None:
    authorities = authorities_of(pki)
    server_before = pki.server_cert.read_bytes()
    with pytest.raises(FailedPreconditionError, match="only one issuing CA"):
        await authorities.retire(store, "operator:admin")
    assert pki.server_cert.read_bytes() == server_before
    assert await store.get(AUTHORITIES) is None


async def test_rotate_then_retire(pki: PkiLayout, store: SqliteStore) -> None:
    """Old and new accepted after the rotation; after the retirement the old CA's
    certificates are refused, the server certificate is the new CA's, the bundle holds the
    new root only; listeners hear both changes; the store gives the same state back."""
    authorities = authorities_of(pki)
    told: list[bytes] = []
    authorities.on_bundle_change(lambda bundle: told.append(bundle) or 3)
    old_cert, _ = issue_client_files(pki, TENANT)
    rotation = prepare_rotation(pki, new_root=True)
    assert rotation.new_root is not None
    reply = await authorities.rotate(
        store, "operator:admin", rotation_request(rotation.issuing, rotation.new_root.cert_pem)
    )
    assert reply.sites_told == 3
    assert len(load_bundle(reply.trust_bundle_pem)) == 2
    assert authorities.issuer.cert == rotation.issuing.cert
    new_pem, _ = authorities.issuer.issue_client(TENANT)
    authorities.check(old_cert.read_bytes())
    authorities.check(new_pem)
    verify_client(new_pem, load_bundle(reply.trust_bundle_pem))

    with pytest.raises(InvalidArgumentError, match="in use already"):
        await authorities.rotate(store, "operator:admin", rotation_request(rotation.issuing))

    retired = await authorities.retire(store, "operator:admin")
    assert load_bundle(retired.trust_bundle_pem) == [rotation.new_root.cert]
    with pytest.raises(CertificateAuthorityRetiredError, match="retired in a CA rollover"):
        authorities.check(old_cert.read_bytes())
    authorities.check(new_pem)
    verify_client(pki.server_cert.read_bytes(), [rotation.new_root.cert])
    server = x509.load_pem_x509_certificate(pki.server_cert.read_bytes())
    assert server.not_valid_after_utc > datetime.now(UTC)
    assert told == [reply.trust_bundle_pem, retired.trust_bundle_pem]

    again = await Authorities.load(
        store,
        ca_cert=pki.ca_cert,
        ca_key=pki.ca_key,
        issuing_cert=pki.issuing_cert,
        server_cert=pki.server_cert,
        server_key=pki.server_key,
    )
    assert again.issuer.cert == rotation.issuing.cert
    assert again.bundle_pem == retired.trust_bundle_pem
    with pytest.raises(CertificateAuthorityRetiredError):
        again.check(old_cert.read_bytes())
    trail = [kv async for kv in _audit(store)]
    assert len(trail) == 2


async def _audit(store: SqliteStore) -> AsyncIterator[object]:
    for kv in await store.range("/audit/"):
        yield kv


async def test_another_coordinator_follows_a_rollover_from_the_store(
    pki: PkiLayout, store: SqliteStore, tmp_path: Path
) -> None:
    """A coordinator sharing the store takes each change in from the watch: the new issuing
    CA and bundle after the rotation; after the retirement the old CA's certificates are
    refused and its own server certificate (its own files) is replaced by one of the new CA
    with the same names; one started later replaces a stale one before it serves."""
    leader = authorities_of(pki)
    own = tmp_path / "other"
    own.mkdir()
    cert_file, key_file = own / "server.pem", own / "server-key.pem"
    shutil.copy(pki.server_cert, cert_file)
    shutil.copy(pki.server_key, key_file)
    stale = cert_file.read_bytes()
    other = await Authorities.load(
        store,
        ca_cert=pki.ca_cert,
        ca_key=pki.ca_key,
        issuing_cert=pki.issuing_cert,
        server_cert=cert_file,
        server_key=key_file,
    )
    following = asyncio.create_task(other.follow(store))
    old_cert, _ = issue_client_files(pki, TENANT)
    try:
        rotation = prepare_rotation(pki, new_root=True)
        assert rotation.new_root is not None
        await leader.rotate(
            store, "operator:admin", rotation_request(rotation.issuing, rotation.new_root.cert_pem)
        )
        await _until(lambda: other.issuer.cert == rotation.issuing.cert)
        assert other.bundle_pem == leader.bundle_pem
        other.check(old_cert.read_bytes())
        assert cert_file.read_bytes() == stale  # still accepted: nothing to replace yet

        await leader.retire(store, "operator:admin")
        await _until(lambda: cert_file.read_bytes() != stale)
        assert other.bundle_pem == leader.bundle_pem
        with pytest.raises(CertificateAuthorityRetiredError):
            other.check(old_cert.read_bytes())
        served = x509.load_pem_x509_certificate(cert_file.read_bytes())
        assert served != x509.load_pem_x509_certificate(pki.server_cert.read_bytes())
        verify_server(cert_file.read_bytes(), [rotation.new_root.cert])
        assert _names(served) == _names(x509.load_pem_x509_certificate(stale))
        assert key_file.stat().st_mode & 0o777 == 0o600
    finally:
        following.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await following

    cert_file.write_bytes(stale)  # a coordinator that was down through it all
    again = await Authorities.load(
        store,
        ca_cert=pki.ca_cert,
        ca_key=pki.ca_key,
        issuing_cert=pki.issuing_cert,
        server_cert=cert_file,
        server_key=key_file,
    )
    assert again.issuer.cert == rotation.issuing.cert
    verify_server(cert_file.read_bytes(), [rotation.new_root.cert])


def verify_server(chain_pem: bytes, roots: list[x509.Certificate]) -> None:
    leaf, *intermediates = x509.load_pem_x509_certificates(chain_pem)
    verifier = PolicyBuilder().store(TrustStore(roots)).build_server_verifier(DNSName("localhost"))
    verifier.verify(leaf, intermediates)


def _names(cert: x509.Certificate) -> list[str]:
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(n.value) for n in sans]


async def _until(check: Callable[[], bool], timeout_s: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "the change was not followed"
        await asyncio.sleep(0.02)
