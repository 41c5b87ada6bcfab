"""Cryptography in a child process answers as ``pki`` does in this one: the same results, the
same errors; a child that fails raises ``CryptoProcessError`` (an OSError), never a result."""

from __future__ import annotations

import sys
from collections.abc import Callable

import pytest
from cryptography import x509

from federation.security import crypto_process, pki
from federation.security.identity import Identity, Role


async def test_a_csr_made_in_the_child_is_signed_for_its_key() -> None:
    ca = pki.CertificateAuthority.create()
    key_pem, csr_pem = crypto_process.make_csr("edge-7")
    csr = x509.load_pem_x509_csr(csr_pem)
    assert csr.is_signature_valid
    cert_pem = ca.with_chain(ca.sign_csr(csr_pem, Identity(Role.SITE, "edge-7")))
    assert crypto_process.pair_matches(cert_pem, key_pem)
    other_key, _ = await crypto_process.make_csr_async("edge-7")
    assert not crypto_process.pair_matches(cert_pem, other_key)
    assert not crypto_process.pair_matches(b"torn", key_pem)


def torn_certificate() -> bytes:
    return pki.CertificateAuthority.create().cert_pem.replace(b"MI", b"MJ", 1)


@pytest.mark.parametrize(
    "make",
    [
        lambda: b"",
        lambda: b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n",
        torn_certificate,
    ],
    ids=["empty", "not-base64", "torn-der"],  # made in the test: every worker collects the same
)
async def test_a_bundle_is_refused_with_load_bundles_error(make: Callable[[], bytes]) -> None:
    bundle = make()
    with pytest.raises(pki.CaCheckError) as here:
        pki.load_bundle(bundle)
    with pytest.raises(pki.CaCheckError) as there:
        crypto_process.check_bundle(bundle)
    assert str(there.value) == str(here.value)
    with pytest.raises(pki.CaCheckError) as there_async:
        await crypto_process.check_bundle_async(bundle)
    assert str(there_async.value) == str(here.value)


async def test_a_bundle_is_counted() -> None:
    roots = [pki.CertificateAuthority.create(n).cert_pem for n in ("a", "b")]
    assert crypto_process.check_bundle(b"".join(roots)) == 2
    assert await crypto_process.check_bundle_async(roots[0]) == 1


async def test_a_child_that_fails_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.raises(crypto_process.CryptoProcessError):
        crypto_process.make_csr("x")
    with pytest.raises(crypto_process.CryptoProcessError):
        await crypto_process.check_bundle_async(b"")
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with pytest.raises(crypto_process.CryptoProcessError, match="exited 1"):
        crypto_process.pair_matches(b"", b"")
