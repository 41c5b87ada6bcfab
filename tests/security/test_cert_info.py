"""Reading a certificate's validity and fingerprint without cryptography gives what
cryptography reads, and refuses what it refuses to load."""

from __future__ import annotations

import base64
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from federation.security import cert_info, pki
from federation.security.identity import Identity, Role


def self_signed(not_before: datetime, not_after: datetime) -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "t")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(2**150)  # a long serial: a long-form length before the validity
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM)


def test_an_issued_chain_reads_as_its_leaf() -> None:
    """A site certificate with its issuing CA after it: the leaf's dates and fingerprint."""
    root = pki.CertificateAuthority.create("root")
    issuing = pki.CertificateAuthority.create("issuing", signed_by=root)
    chain, _ = issuing.issue_client(Identity(Role.SITE, "s"))
    leaf = x509.load_pem_x509_certificate(chain)
    info = cert_info.read_certificate(chain)
    assert info.not_valid_before_utc == leaf.not_valid_before_utc
    assert info.not_valid_after_utc == leaf.not_valid_after_utc
    assert info.fingerprint == cert_info.fingerprint(chain) == pki.fingerprint(chain)


@pytest.mark.parametrize(
    ("not_before", "not_after"),
    [
        (datetime(1950, 1, 1, tzinfo=UTC), datetime(2049, 12, 31, 23, 59, 59, tzinfo=UTC)),
        (datetime(2024, 2, 29, 12, 0, 1, tzinfo=UTC), datetime(2050, 1, 1, tzinfo=UTC)),
        (datetime(2026, 1, 1, tzinfo=UTC), datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)),
    ],
)
def test_utc_and_generalized_times(not_before: datetime, not_after: datetime) -> None:
    """UTCTime up to 2049 (years 50-99 are 19xx), GeneralizedTime from 2050 on."""
    info = cert_info.read_certificate(self_signed(not_before, not_after))
    assert (info.not_valid_before_utc, info.not_valid_after_utc) == (not_before, not_after)


def test_what_cryptography_refuses_is_refused() -> None:
    good, _ = pki.CertificateAuthority.create().issue_client(Identity(Role.SITE, "s"))
    body = b"".join(good.split(b"\n")[1:-2])
    der = cert_info.first_der(good)
    broken = [
        b"",
        b"not a certificate",
        b"-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
        good.replace(b"MI", b"MJ", 1),  # the outer SEQUENCE's tag
        b"-----BEGIN CERTIFICATE-----\n" + body[:100] + b"\n-----END CERTIFICATE-----\n",
        pem_of(der + b"\x00"),  # trailing bytes
        pem_of(der[:-1]),  # cut short
    ]
    for pem in broken:
        assert refused(x509.load_pem_x509_certificate, pem), pem
        assert refused(cert_info.read_certificate, pem), pem


def refused(load: Callable[[bytes], object], pem: bytes) -> bool:
    try:
        load(pem)
    except ValueError:
        return True
    return False


def pem_of(der: bytes) -> bytes:
    encoded = base64.b64encode(der)
    return b"-----BEGIN CERTIFICATE-----\n" + encoded + b"\n-----END CERTIFICATE-----\n"
