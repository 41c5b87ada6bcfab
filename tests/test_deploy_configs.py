"""The example configs in deploy/ load into the daemons' settings as documented."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from federation.agent.main import load_config as load_agent_config
from federation.agent.main import parse_args
from federation.config import ConfigError, build, read_toml
from federation.coordinator.config import CoordinatorConfig
from federation.placement.registry import build_framework

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def agent_args(config: Path) -> argparse.Namespace:
    # The inventory the examples name is read at start: the example inventory stands in for
    # /etc/federation/inventory.yaml, as the README's set-up copies it there.
    inventory = DEPLOY / "inventory.example.yaml"
    argv = ["--config", str(config), "--inventory", str(inventory)]
    return parse_args(argv, "fed-datacenter-agent", "datacenter")


def test_coordinator_example_loads() -> None:
    """deploy/coordinator.toml gives a complete coordinator config."""
    path = DEPLOY / "coordinator.toml"
    config = build(CoordinatorConfig, read_toml(path), source=str(path))
    assert config.listen == "0.0.0.0:7070"
    assert config.ca_key == Path("/etc/federation/pki/ca-key.pem")
    assert config.placement_scores["CompletionTime"] == 1.0
    assert build_framework(config.placement_filters, config.placement_scores).filters


@pytest.mark.parametrize(
    ("name", "domain"), [("datacenter-agent.toml", "datacenter"), ("edge-agent.toml", "edge")]
)
def test_agent_examples_load(name: str, domain: str) -> None:
    """The agent examples load, keep their domain and their label table, and export metrics
    where the Prometheus example scrapes them."""
    config = load_agent_config(agent_args(DEPLOY / name), domain="datacenter")
    assert config.domain == domain
    assert 'inventory = "/etc/federation/inventory.yaml"' in (DEPLOY / name).read_text()
    assert config.metrics_listen == ":9465"
    if domain == "datacenter":
        assert config.labels == {"rack": "r12"}
        assert config.task_uid_range == "200000-299999"


def test_unknown_setting_is_named(tmp_path: Path) -> None:
    """A misspelt key is refused with the file and the key in the message."""
    path = tmp_path / "c.toml"
    path.write_text('data_dir = "x"\nlisten_adress = "a"\n')
    with pytest.raises(ConfigError, match="listen_adress"):
        build(CoordinatorConfig, read_toml(path), source=str(path))
