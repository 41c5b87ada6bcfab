"""End-to-end mTLS tests against a real gRPC server on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from federation.security.identity import Identity, Role
from federation.security.pki import PkiLayout, issue_client_files
from federation.security.tls import (
    TlsFiles,
    channel_credentials,
    peer_certificate,
    peer_identity,
    server_credentials,
    server_only_channel_credentials,
)

TIMEOUT = 10.0
WHO = "/test.Echo/Who"
REFUSED = grpc.StatusCode.UNAVAILABLE
"""What a grpc.aio client sees when the server's TLS handshake refuses it."""


@dataclass
class _Server:
    """A running test server and the identities its Who handler saw."""

    server: grpc.aio.Server
    address: str
    seen: list[Identity | None] = field(default_factory=list)

    async def who(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """Records and returns the caller's identity as read from its certificate."""
        identity = peer_identity(context)
        self.seen.append(identity)
        if identity is None:
            assert peer_certificate(context) is None
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no client certificate")
        return str(identity).encode()


async def _start(tls: TlsFiles, *, require_client_auth: bool = True) -> _Server:
    """Starts a health + Who server on an ephemeral loopback port."""
    server = grpc.aio.server()
    creds = server_credentials(tls, require_client_auth=require_client_auth)
    running = _Server(server, f"127.0.0.1:{server.add_secure_port('127.0.0.1:0', creds)}")
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    handler = grpc.method_handlers_generic_handler(
        "test.Echo", {"Who": grpc.unary_unary_rpc_method_handler(running.who)}
    )
    server.add_generic_rpc_handlers((handler,))
    await server.start()
    return running


@pytest.fixture
async def mtls_server(server_tls: TlsFiles) -> AsyncIterator[_Server]:
    """A running server that requires client certificates from the test CA."""
    running = await _start(server_tls)
    yield running
    await running.server.stop(None)


async def _check(address: str, creds: grpc.ChannelCredentials) -> grpc.StatusCode:
    """Runs a health check and returns its status code (OK when SERVING)."""
    async with grpc.aio.secure_channel(address, creds) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        assert response.status == health_pb2.HealthCheckResponse.SERVING
        return grpc.StatusCode.OK


async def test_operator_is_served_and_identified(
    mtls_server: _Server, operator_tls: TlsFiles
) -> None:
    """A client with a CA-issued operator certificate is served and identified server-side."""
    creds = channel_credentials(operator_tls)
    async with grpc.aio.secure_channel(mtls_server.address, creds) as channel:
        await asyncio.wait_for(channel.channel_ready(), TIMEOUT)
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=TIMEOUT
        )
        assert response.status == health_pb2.HealthCheckResponse.SERVING
        assert await channel.unary_unary(WHO)(b"", timeout=TIMEOUT) == b"operator:admin"
    assert mtls_server.seen == [Identity(Role.OPERATOR, "admin")]


async def test_site_cert_by_ip_and_hostname(
    mtls_server: _Server, pki: PkiLayout, server_tls: TlsFiles
) -> None:
    """A newly issued site certificate works whether the server is dialled by IP or name."""
    cert, key = issue_client_files(pki, Identity(Role.SITE, "edge-7"))
    creds = channel_credentials(TlsFiles(ca=server_tls.ca, cert=cert, key=key))
    port = mtls_server.address.rsplit(":", 1)[1]
    for address in (mtls_server.address, f"localhost:{port}"):
        async with grpc.aio.secure_channel(address, creds) as channel:
            assert await channel.unary_unary(WHO)(b"", timeout=TIMEOUT) == b"site:edge-7"


async def test_client_without_certificate_is_refused(mtls_server: _Server, pki: PkiLayout) -> None:
    """The handshake refuses a client that presents no certificate."""
    creds = server_only_channel_credentials(pki.ca_cert)
    assert await _check(mtls_server.address, creds) == REFUSED
    assert mtls_server.seen == []


async def test_client_from_other_ca_is_refused(mtls_server: _Server, foreign_tls: TlsFiles) -> None:
    """The handshake refuses a client whose certificate chains to another CA."""
    assert await _check(mtls_server.address, channel_credentials(foreign_tls)) == REFUSED
    assert mtls_server.seen == []


async def test_client_refuses_server_from_other_ca(
    mtls_server: _Server, other_pki: PkiLayout, operator_tls: TlsFiles
) -> None:
    """A client that trusts another CA refuses our server's certificate."""
    creds = channel_credentials(
        TlsFiles(ca=other_pki.ca_cert, cert=operator_tls.cert, key=operator_tls.key)
    )
    assert await _check(mtls_server.address, creds) == REFUSED


async def test_without_required_client_auth_no_cert_is_requested(
    server_tls: TlsFiles, pki: PkiLayout, operator_tls: TlsFiles
) -> None:
    """With require_client_auth=False any TLS client gets in, but none has an identity."""
    running = await _start(server_tls, require_client_auth=False)
    try:
        for creds in (
            server_only_channel_credentials(pki.ca_cert),
            channel_credentials(operator_tls),
        ):
            assert await _check(running.address, creds) == grpc.StatusCode.OK
            async with grpc.aio.secure_channel(running.address, creds) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as excinfo:
                    await channel.unary_unary(WHO)(b"", timeout=TIMEOUT)
            assert excinfo.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert running.seen == [None, None]
    finally:
        await running.server.stop(None)
