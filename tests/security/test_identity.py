"""Tests for identities, identity URIs and reading identities from certificates."""

from __future__ import annotations

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from federation.security.identity import (
    NAME_PATTERN,
    TRUST_DOMAIN,
    Identity,
    InvalidIdentityError,
    Role,
    identity_from_certificate,
    parse_identity,
    validate_name,
)
from federation.security.pki import CertificateAuthority


def _cert_with_sans(ca: CertificateAuthority, sans: list[x509.GeneralName]) -> bytes:
    """Builds a CA-signed certificate with arbitrary SANs (or none)."""
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "odd")]))
        .issuer_name(ca.cert.subject)
        .public_key(ca.key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(ca.cert.not_valid_before_utc)
        .not_valid_after(ca.cert.not_valid_after_utc)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    """A throwaway CA for building test certificates."""
    return CertificateAuthority.create()


def test_str_and_uri() -> None:
    """An identity renders as role:name and as a SPIFFE URI in our trust domain."""
    identity = Identity(Role.SITE, "edge-7")
    assert str(identity) == "site:edge-7"
    assert identity.uri == f"spiffe://{TRUST_DOMAIN}/site/edge-7"


@pytest.mark.parametrize("role", list(Role))
def test_parse_identity_round_trips(role: Role) -> None:
    """Parsing an identity's URI gives back the same identity for every role."""
    identity = Identity(role, "a1-b2")
    assert parse_identity(identity.uri) == identity


@pytest.mark.parametrize("name", ["a", "0", "edge-7", "a" * 63, "9-"])
def test_valid_names(name: str) -> None:
    """Names of 1 to 63 lowercase letters, digits and '-' starting alphanumerically pass."""
    validate_name(name)
    assert NAME_PATTERN.match(name)


@pytest.mark.parametrize(
    "name", ["", "-a", "Edge", "a_b", "a.b", "a/b", "a b", "a" * 64, "é", "a\n"]
)
def test_invalid_names(name: str) -> None:
    """Empty, too long, uppercase, or punctuated names are rejected with the rule."""
    with pytest.raises(InvalidIdentityError, match=r"invalid site name .*lowercase"):
        validate_name(name, "site name")


def test_identity_validates_on_construction() -> None:
    """Constructing an Identity with a bad name or a plain-string role fails."""
    with pytest.raises(InvalidIdentityError, match="invalid name"):
        Identity(Role.SITE, "Bad Name")
    with pytest.raises(InvalidIdentityError, match="role must be a Role"):
        Identity("site", "ok")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("https://federation/site/a", "expected spiffe://"),
        ("site:a", "expected spiffe://"),
        ("spiffe://federation/site", "expected spiffe://"),
        ("spiffe://federation/site/a/b", "expected spiffe://"),
        ("spiffe://federation/site/a/", "expected spiffe://"),
        ("spiffe://other/site/a", "trust domain 'other'"),
        ("spiffe://FEDERATION/site/a", "trust domain"),
        ("spiffe://federation/admin/a", "unknown role 'admin'"),
        ("spiffe://federation/Site/a", "unknown role"),
        ("spiffe://federation/site/", "invalid site name"),
        ("spiffe://federation/site/Edge", "invalid site name"),
        ("spiffe://federation/site/a?x=1", "invalid site name"),
        ("spiffe://federation/site/a#f", "invalid site name"),
    ],
)
def test_parse_identity_rejects(uri: str, message: str) -> None:
    """Malformed URIs, foreign trust domains, unknown roles and bad names are rejected."""
    with pytest.raises(InvalidIdentityError, match=message):
        parse_identity(uri)


def test_identity_from_issued_certificate(ca: CertificateAuthority) -> None:
    """The identity is read back from an issued client certificate's URI SAN."""
    identity = Identity(Role.TENANT, "acme")
    cert_pem, _ = ca.issue_client(identity)
    assert identity_from_certificate(cert_pem) == identity


def test_identity_from_certificate_rejects_server_cert(ca: CertificateAuthority) -> None:
    """A certificate with only DNS/IP SANs carries no identity."""
    cert_pem, _ = ca.issue_server(["localhost"])
    with pytest.raises(InvalidIdentityError, match="found 0"):
        identity_from_certificate(cert_pem)


@pytest.mark.parametrize(
    ("sans", "message"),
    [
        ([], "no subjectAltName"),
        ([x509.UniformResourceIdentifier("https://example.com/x")], "found 0"),
        (
            [
                x509.UniformResourceIdentifier("spiffe://federation/site/a"),
                x509.UniformResourceIdentifier("spiffe://federation/site/b"),
            ],
            "found 2",
        ),
        (
            [
                x509.UniformResourceIdentifier("spiffe://federation/site/a"),
                x509.UniformResourceIdentifier("spiffe://other/site/a"),
            ],
            "found 2",
        ),
        ([x509.UniformResourceIdentifier("spiffe://other/site/a")], "trust domain"),
    ],
)
def test_identity_from_certificate_rejects_odd_sans(
    ca: CertificateAuthority, sans: list[x509.GeneralName], message: str
) -> None:
    """Certificates without exactly one SPIFFE URI of our trust domain are rejected."""
    with pytest.raises(InvalidIdentityError, match=message):
        identity_from_certificate(_cert_with_sans(ca, sans))


def test_identity_from_certificate_rejects_garbage() -> None:
    """Bytes that are not a PEM certificate raise InvalidIdentityError."""
    with pytest.raises(InvalidIdentityError, match="not a valid PEM certificate"):
        identity_from_certificate(b"-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")


def test_identity_from_certificate_is_cached(ca: CertificateAuthority) -> None:
    """Repeated lookups of the same certificate hit the bounded cache."""
    cert_pem, _ = ca.issue_client(Identity(Role.SITE, "cached"))
    identity_from_certificate(cert_pem)
    hits = identity_from_certificate.cache_info().hits
    identity_from_certificate(cert_pem)
    assert identity_from_certificate.cache_info().hits == hits + 1
    assert identity_from_certificate.cache_info().maxsize == 4096
