"""Elastic cloud capacity in the simulator: a topology's node types, checked as an agent's
inventory is, published launchable as an agent publishes them, launched when a task is placed
on them, released after ``idle_release_s`` idle, and reported (launches, waits, node-hours,
cost)."""

from __future__ import annotations

from pathlib import Path

import pytest

from federation.sim.fields import InputFileError
from federation.sim.topology import load_topology

from .conftest import write

CLOUD = """
  - name: cloud
    domain: cloud
    idle_release_s: 60
    node_types:
      - name: a100x2
        cpu: 16
        memory_mib: 131072
        devices: [{model: A100-80GB, count: 2}]
        max: 2
        price_per_hour: 8.0
        delay_s: 10
"""
TOPOLOGY = (
    """
sites:
  - name: dc
    nodes: [{cpu: 64, memory_mib: 524288, devices: [{model: A100-80GB, count: 4}]}]
"""
    + CLOUD
)


def test_node_types_are_read_with_the_inventory_fields_and_defaults(tmp_path: Path) -> None:
    topology = load_topology(write(tmp_path, "t.yaml", TOPOLOGY))
    cloud, dc = topology.sites  # sorted by name
    assert (dc.node_types, dc.n_launchable) == ((), 0)
    (node_type,) = cloud.node_types
    assert (node_type.name, node_type.max, node_type.price_per_hour) == ("a100x2", 2, 8.0)
    assert (node_type.spot_price_per_hour, node_type.delay_s) == (0.0, 10.0)
    assert [d.model for d in node_type.template.devices] == ["A100-80GB", "A100-80GB"]
    assert (node_type.template.cpu_cores, node_type.template.memory_mib) == (16, 131072)
    assert (cloud.nodes, cloud.idle_release_s, cloud.warm_min) == ((), 60.0, 0)
    assert (topology.n_nodes, topology.n_launchable) == (1, 2)
    bare = TOPOLOGY.replace("    idle_release_s: 60\n", "").replace("        delay_s: 10\n", "")
    (node_type,) = load_topology(write(tmp_path, "bare.yaml", bare)).sites[0].node_types
    assert node_type.delay_s == 60.0  # the inventory's default
    assert load_topology(write(tmp_path, "bare.yaml", bare)).sites[0].idle_release_s == 300.0


TYPE = "sites[1].node_types[0]"


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("max: 2", "max: 0", f"{TYPE}.max: must be >= 1, got 0"),
        ("max: 2", "max: 1001", f"{TYPE}.max: must be 1 to 1000, got 1001"),
        ("max: 2", "max: 1.5", f"{TYPE}.max: expected a whole number, got 1.5"),
        ("price_per_hour: 8.0", "price_per_hour: -1", f"{TYPE}.price_per_hour: must be >= 0"),
        ("delay_s: 10", "delay_s: soon", f"{TYPE}.delay_s: expected a number, got 'soon'"),
        ("delay_s: 10", "delay_s: .inf", f"{TYPE}.delay_s: must be >= 0, got inf"),
        ("delay_s: 10", "delay: 10", f"{TYPE}: unknown field(s) delay"),
        ("max: 2", "count: 2", f"{TYPE}: unknown field(s) count"),
        ("name: a100x2", "name: a/b", f"{TYPE}.name: 'a/b': a node type's name has no '/'"),
        ("        cpu: 16\n", "", f"{TYPE}.cpu: is required"),
        ("idle_release_s: 60", "idle_release_s: 0", "sites[1].idle_release_s: must be > 0, got 0"),
        ("idle_release_s: 60", "warm_min: -1", "sites[1].warm_min: must be >= 0, got -1"),
        (
            "idle_release_s: 60",
            "warm_min: 3",
            "sites[1].warm_min: must be at most the node types' max in all (2), got 3",
        ),
        (
            "node_types:\n      - name: a100x2",
            "node_types:\n      - {name: a100x2, cpu: 1, memory_mib: 1}\n      - name: a100x2",
            "sites[1].node_types[1].name: duplicate node type 'a100x2'",
        ),
    ],
)
def test_bad_node_types_are_refused_naming_the_field(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    assert old in TOPOLOGY
    with pytest.raises(InputFileError) as refused:
        load_topology(write(tmp_path, "t.yaml", TOPOLOGY.replace(old, new, 1)))
    assert message in str(refused.value)


@pytest.mark.parametrize("key", ["idle_release_s: 60", "warm_min: 0"])
def test_release_settings_without_node_types_are_refused(tmp_path: Path, key: str) -> None:
    text = TOPOLOGY.replace("  - name: dc\n", f"  - name: dc\n    {key}\n")
    with pytest.raises(InputFileError) as refused:
        load_topology(write(tmp_path, "t.yaml", text))
    name = key.split(":")[0]
    assert f"sites[0].{name}: applies to launched nodes: declare node_types" in str(refused.value)


def test_a_site_needs_nodes_or_node_types(tmp_path: Path) -> None:
    text = TOPOLOGY.replace("    node_types:", "    no_types:")
    with pytest.raises(InputFileError, match=r"sites\[1\]\.nodes: is required"):
        load_topology(write(tmp_path, "t.yaml", text))


def test_trace_models_and_speed_factors_may_name_a_node_type_model(tmp_path: Path) -> None:
    """A model only a node type has is a model of the topology."""
    text = TOPOLOGY.replace("model: A100-80GB, count: 4", "model: V100, count: 4")
    topology = load_topology(write(tmp_path, "t.yaml", "speed_factors: {A100-80GB: 0.5}\n" + text))
    assert topology.models == {"V100", "A100-80GB"}
    assert topology.speed_factors == {"A100-80GB": 0.5}
