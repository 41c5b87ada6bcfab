"""Shared PKI fixtures for the security tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from federation.security.identity import Identity, Role
from federation.security.pki import PkiLayout, init_pki, issue_client_files
from federation.security.tls import TlsFiles

SERVER_SANS = ("localhost", "127.0.0.1")
OPERATOR = Identity(Role.OPERATOR, "admin")


@pytest.fixture
def pki(tmp_path: Path) -> PkiLayout:
    """A fresh federation PKI: CA, coordinator certificate and operator "admin"."""
    return init_pki(tmp_path / "pki", server_sans=SERVER_SANS)


@pytest.fixture
def other_pki(tmp_path: Path) -> PkiLayout:
    """An unrelated PKI whose CA the federation does not trust."""
    return init_pki(tmp_path / "other-pki", server_sans=SERVER_SANS)


@pytest.fixture
def server_tls(pki: PkiLayout) -> TlsFiles:
    """The coordinator's mTLS files."""
    return TlsFiles(ca=pki.ca_cert, cert=pki.server_cert, key=pki.server_key)


@pytest.fixture
def operator_tls(pki: PkiLayout) -> TlsFiles:
    """mTLS files of operator "admin", issued by the federation CA."""
    stem = f"{OPERATOR.role}-{OPERATOR.name}"
    return TlsFiles(ca=pki.ca_cert, cert=pki.client_cert(stem), key=pki.client_key(stem))


@pytest.fixture
def foreign_tls(pki: PkiLayout, other_pki: PkiLayout) -> TlsFiles:
    """A client certificate for a valid-looking identity from an untrusted CA."""
    cert, key = issue_client_files(other_pki, Identity(Role.SITE, "intruder"))
    return TlsFiles(ca=pki.ca_cert, cert=cert, key=key)
