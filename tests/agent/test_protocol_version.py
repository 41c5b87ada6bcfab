"""The site-link protocol versions a coordinator serves, and the refusal an agent takes as final."""

from __future__ import annotations

import pytest

from federation import site_protocol
from federation.errors import ProtocolVersionError
from federation.site_protocol import PROTOCOL_VERSION, agreed_version


def test_an_agent_from_before_the_field_is_spoken_to_as_version_1() -> None:
    assert agreed_version(0) == 1
    assert agreed_version(PROTOCOL_VERSION) == PROTOCOL_VERSION
    assert agreed_version(PROTOCOL_VERSION - 1) == PROTOCOL_VERSION - 1


def test_an_agent_one_newer_is_spoken_to_in_the_coordinators_version() -> None:
    assert agreed_version(PROTOCOL_VERSION + 1) == PROTOCOL_VERSION


def test_an_agent_two_newer_is_told_to_upgrade_the_coordinator() -> None:
    with pytest.raises(ProtocolVersionError, match="upgrade the coordinator") as caught:
        agreed_version(PROTOCOL_VERSION + 2)
    assert caught.value.metadata == {
        "agent": str(PROTOCOL_VERSION + 2),
        "coordinator": str(PROTOCOL_VERSION),
    }


def test_an_agent_more_than_one_version_older_is_told_to_upgrade_the_agent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Once a release drops version 1, a version-1 agent (sending 0) is refused."""
    monkeypatch.setattr(site_protocol, "MIN_PROTOCOL_VERSION", 2)
    with pytest.raises(ProtocolVersionError, match=r"older than 2.*upgrade the agent"):
        agreed_version(0)
    assert agreed_version(2) == 2
