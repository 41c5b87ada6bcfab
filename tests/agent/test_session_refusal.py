"""The agent at the edges of its Connect stream: what it logs when the coordinator refuses what it
sent, and the goodbye it says when stopped before the coordinator answered its hello."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from structlog.testing import capture_logs

from federation.agent.config import AgentConfig
from federation.agent.embedded_core import EmbeddedCore
from federation.agent.enroll import credential_paths
from federation.agent.runtime import AgentRuntime, CertificateExpiredError
from federation.api.v1 import resources_pb2
from federation.api.v1 import site_link_service_pb2 as pb
from federation.errors import FieldViolation, InvalidArgumentError
from federation.security.interceptors import to_status


def unconnected_runtime(tmp_path: Path) -> tuple[AgentRuntime, EmbeddedCore]:
    """An agent runtime of site "s" for a coordinator that is not there, and its core."""
    config = AgentConfig(
        site="s",
        domain="edge",
        coordinator="127.0.0.1:1",
        ca=tmp_path / "ca.pem",
        state_dir=tmp_path,
    )
    core = EmbeddedCore(
        [resources_pb2.Node(name="n", cpu_cores=1, schedulable=True)],
        site="s",
        work_dir=tmp_path / "work",
        on_status=lambda report: None,
        on_change=lambda: None,
    )
    return AgentRuntime(config, credential_paths(tmp_path), core), core


async def test_refused_view_is_logged_with_every_bad_field(tmp_path: Path) -> None:
    """A stream ended INVALID_ARGUMENT is logged with each field the coordinator named, so the
    operator of a site sending a bad view can see which one."""
    runtime, core = unconnected_runtime(tmp_path)
    status = to_status(
        InvalidArgumentError(
            [
                FieldViolation(f"hello.view.nodes[{i}].cpu_free", "must be in [0, 1e12]")
                for i in range(7)
            ]
        )
    )

    async def refused(coordinator: str) -> None:
        runtime._leaving = True  # one session only
        raise grpc.aio.AioRpcError(
            status.code,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(*status.trailing_metadata),
            details=status.details,
        )

    runtime._session = refused  # type: ignore[method-assign]
    with capture_logs() as logs:
        await runtime.run()
    await core.close()
    (lost,) = [entry for entry in logs if entry["event"] == "session_lost"]
    assert lost["code"] == "INVALID_ARGUMENT"
    assert lost["violations"] == [
        f"hello.view.nodes[{i}].cpu_free: must be in [0, 1e12]" for i in range(7)
    ]


async def test_an_agent_stopped_before_its_welcome_still_says_goodbye(tmp_path: Path) -> None:
    """Stopped between its hello and the coordinator's answer, the agent queues its goodbye
    after the hello, so the site shows DISCONNECTED rather than UNREACHABLE."""
    runtime, core = unconnected_runtime(tmp_path)
    sent: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()
    sent.put_nowait(pb.AgentMessage(hello=pb.Hello()))
    runtime._outbox = sent  # a session under way, not yet welcomed
    assert not runtime.connected.is_set()
    with capture_logs() as logs:
        await runtime.leave("agent stopping", timeout_s=0.1)
    await core.close()
    queued = [sent.get_nowait() for _ in range(sent.qsize())]
    assert [m.WhichOneof("body") for m in queued if m is not None] == ["hello", "goodbye"]
    assert [entry["event"] for entry in logs] == ["goodbye_unanswered"]


def write_expired_certificate(path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "s")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=2))
        .not_valid_after(now - timedelta(seconds=1))
        .sign(key, hashes.SHA256())
    )
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


async def test_a_certificate_that_expires_ends_the_session_loop(tmp_path: Path) -> None:
    """A session that fails UNAVAILABLE (the handshake refused) with the site certificate
    expired ends the agent with one line saying so, rather than retrying for ever."""
    runtime, core = unconnected_runtime(tmp_path)
    write_expired_certificate(tmp_path / "site.pem")

    async def refused(coordinator: str) -> None:
        raise grpc.aio.AioRpcError(
            grpc.StatusCode.UNAVAILABLE,
            grpc.aio.Metadata(),
            grpc.aio.Metadata(),
            details="failed to connect: Ssl handshake failed",
        )

    runtime._session = refused  # type: ignore[method-assign]
    with pytest.raises(CertificateExpiredError) as ended:
        await asyncio.wait_for(runtime.run(), 10)
    await core.close()
    assert "expired at" in str(ended.value)
    assert "fedctl token create --site s" in str(ended.value)
