"""gRPC credentials for mutual TLS, and reading the peer's certificate back.

With ``require_client_auth=True`` the TLS handshake itself refuses clients that
present no certificate, or one that does not chain to the CA bundle; such a
client's RPCs fail with ``grpc.StatusCode.UNAVAILABLE`` ("failed to connect to all
addresses; ... Socket closed") and never reach a servicer. gRPC Python has no
"optional client certificate" mode: it either requires and verifies one, or never
asks for one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from federation.security.identity import Identity, identity_from_certificate

_PEER_CERT_KEY = "x509_pem_cert"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files for one mTLS endpoint."""

    ca: Path
    """Bundle that every peer certificate must chain to."""
    cert: Path
    """This endpoint's certificate."""
    key: Path
    """This endpoint's private key."""


def server_credentials(
    tls: TlsFiles, *, require_client_auth: bool = True
) -> grpc.ServerCredentials:
    """Server credentials that verify client certificates against ``tls.ca``.

    Args:
        tls: The server's certificate, key and client CA bundle.
        require_client_auth: Refuse clients without a valid certificate during the
            handshake. When false, gRPC Python does not even *request* a client
            certificate, so ``peer_certificate`` is always None on that port; a
            server-only-TLS endpoint (Join) therefore needs its own port.

    Returns:
        Credentials for ``server.add_secure_port``.
    """
    return grpc.ssl_server_credentials(
        [(tls.key.read_bytes(), tls.cert.read_bytes())],
        root_certificates=tls.ca.read_bytes(),
        require_client_auth=require_client_auth,
    )


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """Client credentials that present ``tls.cert`` and verify the server against ``tls.ca``."""
    return grpc.ssl_channel_credentials(
        root_certificates=tls.ca.read_bytes(),
        private_key=tls.key.read_bytes(),
        certificate_chain=tls.cert.read_bytes(),
    )


def server_only_channel_credentials(ca: Path) -> grpc.ChannelCredentials:
    """Client credentials that verify the server but present no certificate (for Join)."""
    return grpc.ssl_channel_credentials(root_certificates=ca.read_bytes())


def peer_certificate(context: grpc.aio.ServicerContext[Any, Any]) -> bytes | None:
    """The PEM certificate the peer presented, or None (plaintext or no client cert)."""
    values = context.auth_context().get(_PEER_CERT_KEY)
    first = next(iter(values), None) if values else None
    return None if first is None else bytes(first)


def peer_identity(context: grpc.aio.ServicerContext[Any, Any]) -> Identity | None:
    """The identity in the peer's certificate, or None if it presented none.

    Raises:
        InvalidIdentityError: If the certificate does not carry a valid identity.
    """
    pem = peer_certificate(context)
    return None if pem is None else identity_from_certificate(pem)
