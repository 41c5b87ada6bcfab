"""The agent keeps the trust bundle the coordinator sends, once checked (in a child process,
``crypto_process``): a broken bundle is never written, and bundles sent in a row are kept in
the order received."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from federation.agent.config import AgentConfig
from federation.agent.embedded_core import EmbeddedCore
from federation.agent.enroll import credential_paths
from federation.agent.runtime import AgentRuntime
from federation.api.v1 import resources_pb2
from federation.api.v1 import site_link_service_pb2 as pb
from federation.security.pki import CertificateAuthority


@pytest.fixture
async def runtime(tmp_path: Path) -> AsyncIterator[AgentRuntime]:
    config = AgentConfig(
        site="edge-1",
        domain="edge",
        coordinator="127.0.0.1:1",
        ca=tmp_path / "ca.pem",
        state_dir=tmp_path,
    )
    core = EmbeddedCore(
        [resources_pb2.Node(name="n1", cpu_cores=4, memory_mib=1024, schedulable=True)],
        site=config.site,
        work_dir=tmp_path / "work",
        on_status=lambda report: None,
        on_change=lambda: None,
    )
    creds = credential_paths(tmp_path)
    creds.ca.write_bytes(CertificateAuthority.create("old root").cert_pem)
    agent = AgentRuntime(config, creds, core)
    yield agent
    await agent.close()
    await core.close()


async def send(agent: AgentRuntime, *bundles: bytes) -> None:
    """Deliver ``bundles`` as trust_bundle messages, one after another, and wait until the
    agent has checked and kept (or refused) them all."""
    for bundle in bundles:
        message = pb.CoordinatorMessage(trust_bundle=pb.TrustBundle(trust_bundle_pem=bundle))
        agent._dispatch(message, asyncio.Queue())
    if agent._bundle_keeper is not None:
        await agent._bundle_keeper


async def test_a_broken_bundle_is_not_written(runtime: AgentRuntime, tmp_path: Path) -> None:
    before = (tmp_path / "ca.pem").read_bytes()
    good = CertificateAuthority.create("new root").cert_pem
    await send(runtime, good.replace(b"MI", b"MJ", 1))
    await send(runtime, b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    assert (tmp_path / "ca.pem").read_bytes() == before


async def test_bundles_are_kept_in_order(runtime: AgentRuntime, tmp_path: Path) -> None:
    first, second = (CertificateAuthority.create(n).cert_pem for n in ("first", "second"))
    await send(runtime, first, second)
    assert (tmp_path / "ca.pem").read_bytes() == second
    await send(runtime, first, b"broken")
    assert (tmp_path / "ca.pem").read_bytes() == first
