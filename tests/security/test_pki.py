"""Tests for the certificate authority, CSR signing and the PKI file layout."""

from __future__ import annotations

import ipaddress
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from federation.security.identity import Identity, Role, identity_from_certificate
from federation.security.pki import (
    CLOCK_SKEW,
    CertificateAuthority,
    InvalidCsrError,
    PkiLayout,
    fingerprint,
    init_pki,
    issue_client_files,
    make_csr,
    serial_hex,
    write_private_file,
    write_public_file,
)

SITE = Identity(Role.SITE, "edge-7")
_PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    """A throwaway CA shared by the tests in this module."""
    return CertificateAuthority.create()


def _load(pem: bytes) -> x509.Certificate:
    """Parses a PEM certificate."""
    return x509.load_pem_x509_certificate(pem)


def _mode(path: Path) -> int:
    """The permission bits of a file."""
    return stat.S_IMODE(path.stat().st_mode)


def _csr(key: _PrivateKey, cn: str) -> x509.CertificateSigningRequestBuilder:
    """A CSR builder asking for ``cn`` and a SPIFFE URI SAN of its choosing."""
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier("spiffe://federation/operator/root")]
            ),
            critical=False,
        )
    )


def _spki(key: ec.EllipticCurvePublicKey) -> bytes:
    """The DER SubjectPublicKeyInfo of a public key."""
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _sign(builder: x509.CertificateSigningRequestBuilder, key: _PrivateKey) -> bytes:
    """Signs a CSR builder and returns the PEM."""
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


def test_ca_is_self_signed_ca(ca: CertificateAuthority) -> None:
    """A new root is a self-signed P-256 CA certificate that may sign one level of CA."""
    ca.cert.verify_directly_issued_by(ca.cert)
    constraints = ca.cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca
    assert constraints.path_length == 1
    assert isinstance(ca.key.curve, ec.SECP256R1)
    assert ca.cert.signature_hash_algorithm is not None
    assert ca.cert.signature_hash_algorithm.name == "sha256"


def test_client_cert_chains_to_ca(ca: CertificateAuthority) -> None:
    """An issued client certificate chains to the CA and names the identity."""
    cert_pem, key_pem = ca.issue_client(SITE)
    cert = _load(cert_pem)
    cert.verify_directly_issued_by(ca.cert)
    assert identity_from_certificate(cert_pem) == SITE
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "site:edge-7"
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    key = serialization.load_pem_private_key(key_pem, password=None)
    assert key.public_key() == cert.public_key()


def test_issued_cert_metadata(ca: CertificateAuthority) -> None:
    """Issued certificates have key identifiers, a skew allowance and random serials."""
    first, second = (_load(ca.issue_client(SITE)[0]) for _ in range(2))
    assert first.serial_number != second.serial_number
    aki = first.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ski = ca.cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ski.digest
    first.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    now = datetime.now(UTC)
    assert now - CLOCK_SKEW - timedelta(seconds=5) <= first.not_valid_before_utc
    assert first.not_valid_before_utc <= now - CLOCK_SKEW
    lifetime = first.not_valid_after_utc - first.not_valid_before_utc
    assert abs(lifetime - (timedelta(days=365) + CLOCK_SKEW)) < timedelta(seconds=2)


def test_leaf_never_outlives_ca() -> None:
    """A requested lifetime beyond the CA's is clamped to the CA's expiry."""
    short_ca = CertificateAuthority.create(valid_days=10)
    cert = _load(short_ca.issue_client(SITE, valid_days=365)[0])
    assert cert.not_valid_after_utc == short_ca.cert.not_valid_after_utc


def test_server_cert_sans_and_usage(ca: CertificateAuthority) -> None:
    """Server certificates carry DNS and IP SANs and both server and client auth."""
    cert = _load(ca.issue_server(["localhost", "127.0.0.1", "::1"])[0])
    cert.verify_directly_issued_by(ca.cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == []
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}


def test_server_cert_needs_a_san(ca: CertificateAuthority) -> None:
    """Issuing a server certificate without any SAN is refused."""
    with pytest.raises(ValueError, match="at least one"):
        ca.issue_server([])


def test_make_csr_round_trip(ca: CertificateAuthority) -> None:
    """A CSR from make_csr is signed into a certificate for the CA-chosen identity."""
    key_pem, csr_pem = make_csr("site:edge-7")
    cert = ca.sign_csr(csr_pem, SITE)
    cert.verify_directly_issued_by(ca.cert)
    key = serialization.load_pem_private_key(key_pem, password=None)
    assert key.public_key() == cert.public_key()
    assert identity_from_certificate(cert.public_bytes(serialization.Encoding.PEM)) == SITE


def test_sign_csr_ignores_requested_subject_and_sans(ca: CertificateAuthority) -> None:
    """A CSR asking to be operator:root gets the identity the CA chose instead."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = ca.sign_csr(_sign(_csr(key, "operator:root"), key), SITE)
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "site:edge-7"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [SITE.uri]
    pem = cert.public_bytes(serialization.Encoding.PEM)
    assert identity_from_certificate(pem) == SITE
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature
    assert not usage.key_cert_sign
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_sign_csr_accepts_rsa_2048(ca: CertificateAuthority) -> None:
    """An RSA-2048 CSR is acceptable."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cert = ca.sign_csr(_sign(_csr(key, "x"), key), SITE)
    assert cert.public_key() == key.public_key()


def test_sign_csr_rejects_bad_signature(ca: CertificateAuthority) -> None:
    """A CSR whose signature was made by another key (no proof of possession) is refused."""
    victim = ec.generate_private_key(ec.SECP256R1()).public_key()
    attacker = ec.generate_private_key(ec.SECP256R1())
    csr_der = x509.load_pem_x509_csr(_sign(_csr(attacker, "x"), attacker)).public_bytes(
        serialization.Encoding.DER
    )
    # Claim the victim's public key while keeping the attacker's signature.
    forged = x509.load_der_x509_csr(csr_der.replace(_spki(attacker.public_key()), _spki(victim)))
    assert forged.public_key() == victim
    with pytest.raises(InvalidCsrError, match="signature does not verify"):
        ca.sign_csr(forged.public_bytes(serialization.Encoding.PEM), SITE)


@pytest.mark.parametrize(
    "pem",
    [
        b"",
        b"not a csr",
        b"-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n",
    ],
)
def test_sign_csr_rejects_malformed_pem(ca: CertificateAuthority, pem: bytes) -> None:
    """Bytes that are not a PEM CSR raise InvalidCsrError."""
    with pytest.raises(InvalidCsrError, match="not a valid PEM"):
        ca.sign_csr(pem, SITE)


def test_sign_csr_rejects_certificate_pem(ca: CertificateAuthority) -> None:
    """A PEM certificate passed where a CSR is expected raises InvalidCsrError."""
    with pytest.raises(InvalidCsrError, match="not a valid PEM"):
        ca.sign_csr(ca.cert_pem, SITE)


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (ec.generate_private_key(ec.SECP384R1()), "only P-256"),
        (rsa.generate_private_key(public_exponent=65537, key_size=1024), "at least 2048"),
    ],
    ids=["p384", "rsa1024"],
)
def test_sign_csr_rejects_weak_or_unsupported_keys(
    ca: CertificateAuthority, key: _PrivateKey, message: str
) -> None:
    """CSRs for keys other than P-256 or RSA of at least 2048 bits are refused."""
    with pytest.raises(InvalidCsrError, match=message):
        ca.sign_csr(_sign(_csr(key, "x"), key), SITE)


def test_fingerprint_and_serial(ca: CertificateAuthority) -> None:
    """Fingerprints are sha256 of the DER, serials are hex of the serial number."""
    cert_pem, _ = ca.issue_client(SITE)
    cert = _load(cert_pem)
    assert fingerprint(cert_pem) == "sha256:" + cert.fingerprint(hashes.SHA256()).hex()
    assert len(fingerprint(cert_pem)) == len("sha256:") + 64
    assert int(serial_hex(cert_pem), 16) == cert.serial_number


def test_write_files_are_atomic_with_permissions(tmp_path: Path) -> None:
    """Private files are 0600, public ones 0644, and no temp files are left behind."""
    private, public = tmp_path / "key.pem", tmp_path / "cert.pem"
    write_private_file(private, b"old")
    write_private_file(private, b"secret")
    write_public_file(public, b"cert")
    assert private.read_bytes() == b"secret"
    assert public.read_bytes() == b"cert"
    assert _mode(private) == 0o600
    assert _mode(public) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cert.pem", "key.pem"]


def test_write_private_file_tightens_existing_file(tmp_path: Path) -> None:
    """Replacing a world-readable file yields a 0600 file."""
    path = tmp_path / "key.pem"
    path.write_bytes(b"old")
    path.chmod(0o644)
    write_private_file(path, b"new")
    assert _mode(path) == 0o600


def test_ca_save_load_round_trip(ca: CertificateAuthority, tmp_path: Path) -> None:
    """A saved CA loads back identically, with its key file at 0600."""
    cert_path, key_path = tmp_path / "ca.pem", tmp_path / "ca-key.pem"
    ca.save(cert_path, key_path)
    assert _mode(key_path) == 0o600
    loaded = CertificateAuthority.load(cert_path, key_path)
    assert loaded.cert == ca.cert
    assert loaded.key.private_numbers() == ca.key.private_numbers()


def test_ca_load_rejects_mismatched_key(ca: CertificateAuthority, tmp_path: Path) -> None:
    """Loading a CA certificate with somebody else's key fails clearly."""
    other = CertificateAuthority.create()
    ca.save(tmp_path / "ca.pem", tmp_path / "ca-key.pem")
    other.save(tmp_path / "other.pem", tmp_path / "other-key.pem")
    with pytest.raises(ValueError, match="is not the private key"):
        CertificateAuthority.load(tmp_path / "ca.pem", tmp_path / "other-key.pem")


def test_init_pki_layout(pki: PkiLayout) -> None:
    """init_pki writes a root, an issuing CA under it, a coordinator cert and an operator
    cert (each followed by the issuing CA's), with safe permissions."""
    assert _mode(pki.dir) == 0o700
    for key in (pki.ca_key, pki.root_key, pki.server_key, pki.client_key("operator-admin")):
        assert _mode(key) == 0o600
    root = CertificateAuthority.load(pki.ca_cert, pki.root_key)
    ca = CertificateAuthority.load(pki.issuing_cert, pki.ca_key)
    ca.cert.verify_directly_issued_by(root.cert)
    for cert_path in (pki.server_cert, pki.client_cert("operator-admin")):
        leaf, chain = x509.load_pem_x509_certificates(cert_path.read_bytes())
        leaf.verify_directly_issued_by(ca.cert)
        assert chain == ca.cert
    operator_pem = pki.client_cert("operator-admin").read_bytes()
    assert identity_from_certificate(operator_pem) == Identity(Role.OPERATOR, "admin")


def test_init_pki_makes_an_existing_folder_private(tmp_path: Path) -> None:
    """A folder that existed world-readable is 0700 once it holds the CA key."""
    folder = tmp_path / "pki"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    init_pki(folder, server_sans=["localhost"])
    assert _mode(folder) == 0o700


def test_init_pki_refuses_to_overwrite(pki: PkiLayout) -> None:
    """A second init_pki in the same directory fails unless forced."""
    before = pki.ca_cert.read_bytes()
    with pytest.raises(FileExistsError, match="a CA already exists"):
        init_pki(pki.dir, server_sans=["localhost"])
    assert pki.ca_cert.read_bytes() == before
    init_pki(pki.dir, server_sans=["localhost"], force=True)
    assert pki.ca_cert.read_bytes() != before


def test_init_pki_validates_before_writing(tmp_path: Path) -> None:
    """A bad operator name or missing SANs leave nothing on disk."""
    with pytest.raises(ValueError, match="invalid name"):
        init_pki(tmp_path / "a", server_sans=["localhost"], operator="Not Valid")
    with pytest.raises(ValueError, match="at least one"):
        init_pki(tmp_path / "b", server_sans=[])
    assert list(tmp_path.iterdir()) == []


def test_issue_client_files(pki: PkiLayout) -> None:
    """issue_client_files writes <role>-<name>.pem and a 0600 key signed by the CA."""
    tenant = Identity(Role.TENANT, "acme")
    cert_path, key_path = issue_client_files(pki, tenant)
    assert cert_path == pki.dir / "tenant-acme.pem"
    assert key_path == pki.dir / "tenant-acme-key.pem"
    assert _mode(key_path) == 0o600
    cert_pem = cert_path.read_bytes()
    _load(cert_pem).verify_directly_issued_by(_load(pki.issuing_cert.read_bytes()))
    assert identity_from_certificate(cert_pem) == tenant
