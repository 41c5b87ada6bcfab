"""Settings for several coordinators: the coordinator's store and the agents' addresses."""

from __future__ import annotations

from pathlib import Path

import pytest

from federation.agent.config import coordinator_endpoints
from federation.agent.main import load_config as load_agent_config
from federation.agent.main import parse_args as parse_agent_args
from federation.config import ConfigError
from federation.coordinator.__main__ import load_config, parse_args
from federation.coordinator.server import advertised

BASE = ["--pki-dir", "/etc/federation/pki", "--data-dir", "/var/lib/federation"]


def coordinator(*flags: str) -> list[str]:
    """Coordinator flags: the PKI and data folders, then ``flags``."""
    return [*BASE, *flags]


def test_default_is_the_embedded_store() -> None:
    """Without store settings the coordinator keeps today's single SQLite store."""
    config = load_config(parse_args(coordinator()))
    assert (config.store, config.etcd_endpoints, config.leader_lease_s) == ("sqlite", [], 3.0)


def test_etcd_flags_give_endpoints_and_lease() -> None:
    """--store etcd with comma-separated endpoints and a lease builds an HA config."""
    config = load_config(
        parse_args(
            coordinator(
                "--store",
                "etcd",
                "--etcd-endpoints",
                "10.0.0.1:2379, 10.0.0.2:2379",
                "--advertise",
                "coord-1.example.org:7070",
                "--leader-lease-s",
                "5",
            )
        )
    )
    assert config.store == "etcd"
    assert config.etcd_endpoints == ["10.0.0.1:2379", "10.0.0.2:2379"]
    assert (config.advertise, config.leader_lease_s) == ("coord-1.example.org:7070", 5.0)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('store = "etcd"\n', "needs etcd_endpoints"),
        ('store = "zookeeper"\n', "store must be one of"),
        ('store = "etcd"\netcd_endpoints = ["e:2379"]\netcd_ca = "ca.pem"\n', "etcd_cert"),
        ('store = "etcd"\netcd_endpoints = ["e:2379"]\nleader_lease_s = 0\n', "positive"),
        ("offer_timeout_s = 10\n", r"reservation_lease_s \(10\) must be longer"),
        ("offers_at_once = 0\n", "offers_at_once must be at least 1"),
        ("retry_interval_s = -1\n", "retry_interval_s must be positive"),
    ],
)
def test_inconsistent_store_settings_are_refused(tmp_path: Path, toml: str, message: str) -> None:
    """Store and negotiation settings that cannot work together are refused with the file and
    the key."""
    path = tmp_path / "coordinator.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=message) as caught:
        load_config(parse_args(coordinator("--config", str(path))))
    assert str(path) in str(caught.value)


def test_advertised_address_defaults_to_the_bound_one() -> None:
    """Without advertise, others dial the listen host and the bound port."""
    assert advertised("127.0.0.1:0", 41000) == "127.0.0.1:41000"
    assert advertised("0.0.0.0:7070", 7070, "coord.example.org:7070") == "coord.example.org:7070"
    assert not advertised("0.0.0.0:0", 7070).startswith("0.0.0.0")


def test_agent_takes_a_list_of_coordinators(tmp_path: Path) -> None:
    """An agent's coordinator may be a comma-separated list, or come as a coordinators array."""
    path = tmp_path / "agent.toml"
    path.write_text(
        'site = "s"\nca = "ca.pem"\nstate_dir = "state"\n'
        'coordinator = "a:7070, b:7070"\ncoordinators = ["c:7070", "a:7070"]\n'
    )
    config = load_agent_config(parse_agent_args(["--config", str(path)], "p", "edge"), "edge")
    assert coordinator_endpoints(config) == ("a:7070", "b:7070", "c:7070")
    path.write_text('site = "s"\nca = "ca.pem"\nstate_dir = "state"\ncoordinators = ["c:7070"]\n')
    config = load_agent_config(parse_agent_args(["--config", str(path)], "p", "edge"), "edge")
    assert coordinator_endpoints(config) == ("c:7070",)
