"""``scheduler = "ray"`` and its ``[ray]`` table, read as an agent reads its config."""

from __future__ import annotations

from pathlib import Path

import pytest

from datacenter_agent.__main__ import start_ray_core
from federation.agent.config import AgentConfig, RayDevice
from federation.agent.elastic import ElasticSettings
from federation.agent.main import load_config, parse_args
from federation.config import ConfigError

BASE = 'site = "s"\ncoordinator = "c:1"\nca = "ca.pem"\nstate_dir = "st"\nscheduler = "ray"\n'


def load(tmp_path: Path, text: str) -> AgentConfig:
    path = tmp_path / "agent.toml"
    path.write_text(BASE + text)
    return load_config(parse_args(["--config", str(path)], "p", "datacenter"), "datacenter")


def test_ray_table_is_read(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        '[ray]\naddress = "10.0.0.5:6379"\ndashboard = "http://10.0.0.5:8265"\n'
        '[ray.devices.GPU_A100]\nmodel = "A100-80GB"\nmemory_mib = 81920\ndeclared = true\n',
    )
    assert config.scheduler == "ray"
    assert config.ray.address == "10.0.0.5:6379"
    assert config.ray.devices == {
        "GPU_A100": RayDevice(model="A100-80GB", memory_mib=81920, declared=True)
    }


def test_default_devices_are_rays_gpus(tmp_path: Path) -> None:
    assert load(tmp_path, "").ray.devices == {"GPU": RayDevice()}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[ray]\nadress = "h:1"\n', "unknown setting ray.adress"),
        ("[ray]\npoll_interval_s = 0\n", "poll_interval_s must be positive"),
        ('[ray.devices.GPU_X]\nkind = "tpu"\n', "kind must be one of gpu"),
        ("[ray.devices.GPU_X]\nmemory_mib = -1\n", "memory_mib"),
    ],
)
def test_bad_ray_settings_are_named(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        load(tmp_path, text)


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ({"task_user": "fedtask"}, "do not apply to Ray sites"),
        ({"inventory": Path("inventory.yaml")}, "inventory does not apply to Ray sites"),
    ],
)
async def test_settings_that_cannot_apply_to_ray_are_refused(
    tmp_path: Path, setting: dict[str, object], words: str
) -> None:
    config = AgentConfig(
        site="s",
        domain="datacenter",
        coordinator="c:1",
        ca=tmp_path / "ca.pem",
        state_dir=tmp_path,
        scheduler="ray",
        **setting,  # type: ignore[arg-type]
    )
    with pytest.raises(ConfigError, match=words):
        await start_ray_core(config, lambda report: None, lambda: None)


NODE_TYPES = (
    "node_types:\n  - {name: a100x2, cpu_cores: 2, memory_mib: 4096, max: 2, delay_s: 10,\n"
    "     devices: [{kind: GPU, vendor: nvidia, model: A100-80GB, count: 2}]}\n"
)


def test_an_elastic_ray_site_reads_its_node_types(tmp_path: Path) -> None:
    (tmp_path / "inventory.yaml").write_text(NODE_TYPES)
    config = load(
        tmp_path,
        'inventory = "inventory.yaml"\n[elastic]\nprovider = "ray"\nlaunch_timeout_s = 120\n',
    )
    assert (config.elastic.provider, config.elastic.launch_timeout_s) == ("ray", 120)


@pytest.mark.parametrize(("scheduler", "provider"), [("embedded", "ray"), ("ray", "simulated")])
def test_a_provider_its_core_cannot_use_is_refused(
    tmp_path: Path, scheduler: str, provider: str
) -> None:
    (tmp_path / "inventory.yaml").write_text(NODE_TYPES)
    path = tmp_path / "agent.toml"
    path.write_text(
        BASE.replace('"ray"', f'"{scheduler}"')
        + f'inventory = "inventory.yaml"\n[elastic]\nprovider = "{provider}"\n'
    )
    args = parse_args(["--config", str(path)], "p", "datacenter")
    with pytest.raises(ConfigError, match=f'provider = "{provider}" does not apply'):
        load_config(args, "datacenter")


def test_simulated_spot_reclaims_are_refused_on_a_ray_site(tmp_path: Path) -> None:
    (tmp_path / "inventory.yaml").write_text(NODE_TYPES)
    path = tmp_path / "agent.toml"
    path.write_text(
        BASE + 'inventory = "inventory.yaml"\n[elastic]\nprovider = "ray"\n'
        "spot_reclaim_after_s = 30\n"
    )
    args = parse_args(["--config", str(path)], "p", "datacenter")
    with pytest.raises(ConfigError, match='spot_reclaim_after_s applies to provider = "simulated"'):
        load_config(args, "datacenter")


async def test_an_elastic_ray_sites_inventory_declares_node_types_only(tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(NODE_TYPES + "nodes:\n  - {name: box, cpu_cores: 2, memory_mib: 1024}\n")
    config = AgentConfig(
        site="s",
        domain="datacenter",
        coordinator="c:1",
        ca=tmp_path / "ca.pem",
        state_dir=tmp_path,
        scheduler="ray",
        inventory=inventory,
        elastic=ElasticSettings(provider="ray"),
    )
    with pytest.raises(ConfigError, match="declares node_types only"):
        await start_ray_core(config, lambda report: None, lambda: None)
