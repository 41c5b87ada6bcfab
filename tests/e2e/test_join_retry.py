"""Joining as users meet it: an agent up before its coordinator waits for it, a join whose
reply was lost is answered again, and a bad token or an expired certificate ends the agent
with one line instead of a retry loop that hides the mistake."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from federation.local import LocalFederation, SiteSpec
from federation.security.pki import load_issuer, make_csr

from .conftest import until
from .test_refusals import join

pytestmark = pytest.mark.xdist_group("e2e-join")

SITE = SiteSpec(
    "edge-j", "edge", nodes=[{"name": "box", "cpu_cores": 2, "memory_mib": 1024, "devices": []}]
)


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[LocalFederation]:
    federation = LocalFederation(tmp_path / "fed", [SITE])
    try:
        yield federation
    finally:
        federation.stop()


def use_token(fed: LocalFederation, monkeypatch: pytest.MonkeyPatch, token: str) -> None:
    """Make ``start_site`` write ``token`` instead of minting one (no coordinator needed)."""

    async def minted(site: str, domain: str) -> str:
        return token

    monkeypatch.setattr(fed, "create_token", minted)


def logged(fed: LocalFederation, event: str) -> list[dict[str, object]]:
    lines = fed.log_path(SITE.name).read_text(errors="replace").splitlines()
    entries = [json.loads(line) for line in lines if line.startswith("{")]
    return [e for e in entries if e.get("event") == event]


async def test_an_agent_started_before_its_coordinator_joins_once_it_is_up(
    fed: LocalFederation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent's one join address refuses connections for a while; it keeps trying."""
    await fed.start_coordinator()
    use_token(fed, monkeypatch, await fed.create_token(SITE.name, SITE.domain))
    assert fed.terminate("coordinator")
    await fed.start_site(SITE)
    agent = fed.processes[SITE.name]

    async def retried() -> bool:
        assert agent.poll() is None, "the agent gave up while no coordinator listened"
        return len(logged(fed, "join_failed")) >= 2

    await until(retried, "the agent to fail its join twice and go on", timeout_s=15)
    assert agent.poll() is None, "the agent gave up while no coordinator listened"
    failures = logged(fed, "join_failed")
    assert len(failures) >= 2, failures
    assert all(f["code"] == "UNAVAILABLE" and "retry_in_s" in f for f in failures)
    await fed.start_coordinator(port=fed.port, join_port=fed.join_port)
    await fed.wait_connected(timeout_s=20)
    assert logged(fed, "site_enrolled")


async def test_a_refused_token_ends_the_agent_with_one_line(
    fed: LocalFederation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token the coordinator does not know: exit 2 and one line naming the refusal."""
    await fed.start_coordinator()
    use_token(fed, monkeypatch, "fedjoin.not-a-real-token")
    await fed.start_site(SITE)
    agent = fed.processes[SITE.name]
    assert await asyncio.to_thread(agent.wait, 20) == 2
    plain = [
        line
        for line in fed.log_path(SITE.name).read_text(errors="replace").splitlines()
        if not line.startswith("{")
    ]
    assert len(plain) == 1, plain
    assert plain[0].startswith("fed-edge-agent: join refused by 127.0.0.1:")
    assert "UNAUTHENTICATED" in plain[0]
    assert "fedctl token create" in plain[0]
    assert not logged(fed, "join_failed")


async def test_a_join_whose_reply_was_lost_is_answered_again(fed: LocalFederation) -> None:
    """The same token and CSR twice: the same certificate (a retry after a lost reply); the
    token with another CSR is still refused."""
    await fed.start_coordinator()
    token = await fed.create_token(SITE.name, SITE.domain)
    csr_pem = make_csr(SITE.name)[1]
    first = await join(fed, token, csr_pem)
    again = await join(fed, token, csr_pem)
    assert again.certificate_pem == first.certificate_pem
    assert again.site == SITE.name
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await join(fed, token, make_csr(SITE.name)[1])
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def expired_copy(fed: LocalFederation, cert_path: Path) -> bytes:
    """The certificate at ``cert_path`` signed again by the federation's CA, expired."""
    current = x509.load_pem_x509_certificate(cert_path.read_bytes())
    issuer = load_issuer(fed.pki.ca_cert, fed.pki.ca_key, None)
    now = datetime.now(UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(current.subject)
        .issuer_name(issuer.cert.subject)
        .public_key(current.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(days=2))
        .not_valid_after(now - timedelta(days=1))
    )
    for extension in current.extensions:
        builder = builder.add_extension(extension.value, extension.critical)
    return builder.sign(issuer.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)


async def test_an_expired_certificate_ends_the_agent_with_one_line(fed: LocalFederation) -> None:
    """An agent started with an expired site certificate: exit 2 and one line saying so and
    that a new join token is needed, not a retry loop on UNAVAILABLE."""
    await fed.start()
    assert fed.terminate(SITE.name)
    cert = fed.root / "sites" / SITE.name / "state" / "site.pem"
    cert.write_bytes(expired_copy(fed, cert))
    await fed.start_site(SITE)
    agent = fed.processes[SITE.name]
    assert await asyncio.to_thread(agent.wait, 20) == 2
    lines = fed.log_path(SITE.name).read_text(errors="replace").splitlines()
    plain = [line for line in lines if not line.startswith("{")]
    assert len(plain) == 1, plain
    assert "expired at" in plain[0]
    assert "fedctl token create --site edge-j" in plain[0]


async def test_an_agent_restarted_after_a_lost_join_reply_joins_with_its_pending_csr(
    fed: LocalFederation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent wrote its key and CSR, its join was answered but the reply lost, and the agent
    started again: it sends the same CSR, gets the certificate, and connects."""
    await fed.start_coordinator()
    token = await fed.create_token(SITE.name, SITE.domain)
    use_token(fed, monkeypatch, token)
    state = fed.root / "sites" / SITE.name / "state"
    state.mkdir(parents=True)
    key_pem, csr_pem = make_csr(SITE.name)
    (state / "joining-key.pem").write_bytes(key_pem)
    (state / "joining-csr.pem").write_bytes(csr_pem)
    lost = await join(fed, token, csr_pem)
    await fed.start_site(SITE)
    await fed.wait_connected(timeout_s=20)
    assert (state / "site-key.pem").read_bytes() == key_pem
    assert (state / "site.pem").read_bytes() == lost.certificate_pem
    assert not (state / "joining-key.pem").exists()
    assert not (state / "joining-csr.pem").exists()


async def test_a_missing_inventory_ends_the_agent_before_its_token_is_spent(
    fed: LocalFederation, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A config naming an inventory file that is not there: exit 2 naming it, and the token is
    still good for the start that follows the fix."""
    await fed.start_coordinator()
    use_token(fed, monkeypatch, await fed.create_token(SITE.name, SITE.domain))
    missing = fed.root / "nowhere.yaml"
    await fed.start_site(SiteSpec(SITE.name, SITE.domain, settings={"inventory": missing}))
    agent = fed.processes[SITE.name]
    assert await asyncio.to_thread(agent.wait, 20) == 2
    text = fed.log_path(SITE.name).read_text(errors="replace")
    assert f"{missing}: cannot read" in text
    assert not logged(fed, "site_enrolled")
    await fed.start_site(SITE)
    await fed.wait_connected(timeout_s=20)
    assert logged(fed, "site_enrolled")
