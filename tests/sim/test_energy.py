"""Energy in the simulator: idle draw of powered nodes, powered-down nodes, and the ``energy``
policy against the default, worked out by hand.

Every node here has 2 A100-80GB (400 W, speed 1.0); an idle device of a node that holds some
task draws 25 % of that (100 W), and a node that holds none is off.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from federation.sim.engine import SimConfig
from federation.sim.policies import PROFILES
from federation.sim.replay import replay
from federation.sim.report import print_tables
from federation.sim.topology import load_topology
from federation.sim.trace import load_trace

from .conftest import write

NODE = "{cpu: 16, memory_mib: 65536, devices: [{model: A100-80GB, count: 2}]}"
ONE_SITE_TWO_NODES = f"sites: [{{name: a, nodes: [{NODE}, {NODE}]}}]\n"
TWO_SITES = f"sites: [{{name: a, nodes: [{NODE}]}}, {{name: b, nodes: [{NODE}]}}]\n"
KWH = 3.6e6
COMPARISON = ("energy_saved_kwh_vs_default", "energy_saved_share_vs_default")


def test_idle_device_of_a_used_node_draws_and_the_unused_node_is_off(tmp_path: Path) -> None:
    """One 1-GPU job of 100 s on a site of two nodes: its device draws 400 W, its node's other
    device 100 W, and the second node nothing."""
    topology = load_topology(write(tmp_path, "t.yaml", ONE_SITE_TWO_NODES))
    tasks = load_trace(
        write(tmp_path, "trace.csv", "submit_s,duration_s,accelerator_count\n0,100,1\n")
    )
    m = replay(topology, tasks, ["completion-time"]).summary["policies"]["completion-time"]
    assert m["energy_kwh"] == pytest.approx(400 * 100 / KWH)
    assert m["energy_idle_kwh"] == pytest.approx(100 * 100 / KWH)
    assert m["energy_total_kwh"] == pytest.approx(500 * 100 / KWH)
    assert m["powered_node_hours"] == pytest.approx(100 / 3600)

    none_idle = replay(topology, tasks, ["completion-time"], config=SimConfig(idle_power_share=0))
    assert none_idle.summary["policies"]["completion-time"]["energy_idle_kwh"] == 0.0
    assert none_idle.summary["idle_power_share"] == 0.0


def test_idle_share_is_checked() -> None:
    with pytest.raises(ValueError, match="idle_power_share"):
        SimConfig(idle_power_share=1.5)


def test_energy_policy_consolidates_and_reports_against_the_default(tmp_path: Path) -> None:
    """j1 (t=0, 1,000 s) takes a's first GPU. For j2 (t=10, 100 s) both sites finish as soon:
    the default spreads it to b, waking b's node (b's other GPU idles 100 s, a's 1,000 s); the
    energy policy puts it beside j1 (a's other GPU idles only the 900 s j2 does not run).
    Same JCTs; 20 kJ saved."""
    topology = load_topology(write(tmp_path, "t.yaml", TWO_SITES))
    trace = "job_id,submit_s,duration_s,accelerator_count\nj1,0,1000,1\nj2,10,100,1\n"
    tasks = load_trace(write(tmp_path, "trace.csv", trace))
    result = replay(topology, tasks, ["completion-time", "energy"])
    default, energy = (result.summary["policies"][p] for p in ("completion-time", "energy"))
    sites = {p: [o.site_ids[r.site] for r in o.tasks] for p, o in result.outcomes.items()}
    assert sites == {"completion-time": ["a", "b"], "energy": ["a", "a"]}
    assert default["energy_idle_kwh"] == pytest.approx(100 * (1000 + 100) / KWH)
    assert energy["energy_idle_kwh"] == pytest.approx(100 * 900 / KWH)
    assert default["energy_kwh"] == energy["energy_kwh"] == pytest.approx(400 * 1100 / KWH)
    assert energy["energy_saved_kwh_vs_default"] == pytest.approx(100 * 200 / KWH)
    saved_share = 200 / (4 * 1100 + 1100)
    assert energy["energy_saved_share_vs_default"] == pytest.approx(saved_share)
    assert energy["jct_change_vs_default"] == pytest.approx(0.0)
    assert energy["powered_node_hours"] == pytest.approx(1000 / 3600)
    assert default["powered_node_hours"] == pytest.approx(1100 / 3600)
    assert [default[k] for k in (*COMPARISON, "jct_change_vs_default")] == [0.0, 0.0, 0.0]

    console = Console(file=io.StringIO(), width=200)
    print_tables(result, console)
    table = console.file.getvalue()  # type: ignore[attr-defined]
    assert "kWh saved" in table
    assert "JCT change" in table
    assert "+3.6%" in table  # saved_share, 200 / 5,500


def test_comparison_is_empty_without_the_default(tmp_path: Path) -> None:
    """Replayed without completion-time, the comparison keys are there but null."""
    topology = load_topology(write(tmp_path, "t.yaml", TWO_SITES))
    tasks = load_trace(write(tmp_path, "trace.csv", "submit_s,duration_s\n0,10\n"))
    m = replay(topology, tasks, ["energy"]).summary["policies"]["energy"]
    assert [m[k] for k in (*COMPARISON, "jct_change_vs_default")] == [None, None, None]


def test_energy_profile_is_the_default_plus_consolidation() -> None:
    """The default's filters and scorers, with Consolidation and the energy term weighted up."""
    default, energy = PROFILES["completion-time"], PROFILES["energy"]
    assert energy.filters == default.filters
    assert set(energy.scorers) == {*default.scorers, "Consolidation"}
    assert energy.scorers["Energy"] > default.scorers["Energy"]
    same = {k for k in default.scorers if k != "Energy"}
    assert {k: energy.scorers[k] for k in same} == {k: default.scorers[k] for k in same}
