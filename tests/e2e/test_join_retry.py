"""Joining as users meet it: an agent up before its coordinator waits for it, and a bad
token ends the agent with one line instead of a retry loop that hides the mistake."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from federation.local import LocalFederation, SiteSpec

from .conftest import until

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
