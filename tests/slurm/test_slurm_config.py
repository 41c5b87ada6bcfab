"""Slurm settings in an agent config: the example loads, mistakes are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from datacenter_agent.__main__ import start_slurm_core
from federation.agent.config import AgentConfig, GresModel, SlurmSettings, slurm_settings
from federation.agent.main import load_config, parse_args
from federation.config import ConfigError

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_slurm_example_loads() -> None:
    """deploy/datacenter-agent-slurm.toml gives a Slurm agent with its partition and GRES."""
    config = load_config(
        parse_args(
            ["--config", str(DEPLOY / "datacenter-agent-slurm.toml")],
            "fed-datacenter-agent",
            "datacenter",
        ),
        "datacenter",
    )
    assert config.scheduler == "slurm"
    assert config.slurm.partition == "gpu"
    assert config.slurm.account == "federation"
    assert config.slurm.qos == "normal"
    assert config.slurm.extra_sbatch_args == ["--constraint=ib"]
    assert config.slurm.conf == Path("/etc/slurm/slurm.conf")
    assert config.slurm.gres["a100"] == GresModel(
        model="A100-80GB", vendor="nvidia", memory_mib=81920, attributes={"cuda": "12.4"}
    )
    assert config.inventory is None
    assert config.task_user == ""


def test_default_is_the_embedded_core(tmp_path: Path) -> None:
    """Without a scheduler setting an agent keeps the embedded core and default Slurm settings."""
    path = tmp_path / "agent.toml"
    path.write_text('site = "s"\ncoordinator = "c:1"\nca = "ca.pem"\nstate_dir = "st"\n')
    config = load_config(parse_args(["--config", str(path)], "p", "edge"), "edge")
    assert config.scheduler == "embedded"
    assert config.slurm == SlurmSettings()


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ({"partiton": "gpu"}, "unknown setting slurm.partiton"),
        ({"extra_sbatch_args": "--exclusive"}, "extra_sbatch_args must be an array"),
        ({"extra_sbatch_args": ["--hold"]}, "may not set --hold"),
        ({"extra_sbatch_args": ["--comment=x"]}, "may not set --comment=x"),
        ({"poll_interval_s": 0}, "poll_interval_s must be positive"),
        ({"gres": {"a100": {"memory": 1}}}, "unknown setting slurm.gres.a100.memory"),
        ({"gres": {"a100": "A100"}}, "slurm.gres.a100 must be a table"),
    ],
)
def test_bad_slurm_settings_are_named(table: dict[str, object], words: str) -> None:
    """Each mistake in ``[slurm]`` is refused with the key that is wrong."""
    with pytest.raises(ConfigError, match=words):
        slurm_settings(table, source="agent.toml")


def test_relative_conf_is_beside_the_config() -> None:
    """A relative slurm.conf path is read relative to the agent's config file."""
    settings = slurm_settings({"conf": "slurm/slurm.conf"}, source="/etc/federation/agent.toml")
    assert settings.conf == Path("/etc/federation/slurm/slurm.conf")


def test_unknown_scheduler_is_refused(tmp_path: Path) -> None:
    """A scheduler other than embedded or slurm is refused when the config loads."""
    path = tmp_path / "agent.toml"
    path.write_text(
        'site = "s"\ncoordinator = "c:1"\nca = "ca.pem"\nstate_dir = "st"\nscheduler = "pbs"\n'
    )
    with pytest.raises(ConfigError, match="scheduler must be one of embedded, slurm"):
        load_config(parse_args(["--config", str(path)], "p", "datacenter"), "datacenter")


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ({"inventory": Path("inventory.yaml")}, "inventory does not apply to Slurm sites"),
        # The tenants' accounts (their containers') are checked as on embedded sites.
        ({"task_user": "no-such-fedtask"}, "task_user: no such account 'no-such-fedtask'"),
        (
            {"task_uid_range": "200000-200100"},
            "work_dir .* lies in state_dir|need an agent running as root",
        ),
    ],
)
async def test_settings_that_cannot_apply_to_slurm_are_refused(
    tmp_path: Path, setting: dict[str, object], words: str
) -> None:
    """A Slurm agent refuses inventory, and tenant accounts it cannot use, before it talks
    to Slurm."""
    config = AgentConfig(
        site="s",
        domain="datacenter",
        coordinator="c:1",
        ca=tmp_path / "ca.pem",
        state_dir=tmp_path,
        scheduler="slurm",
        **setting,  # type: ignore[arg-type]
    )
    with pytest.raises(ConfigError, match=words):
        await start_slurm_core(config, lambda report: None, lambda: None)
