"""Elastic cloud capacity in the simulator: a topology's node types, checked as an agent's
inventory is, published launchable as an agent publishes them, launched when a task is placed
on them, released after ``idle_release_s`` idle, and reported (launches, waits, node-hours,
cost)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from federation.agent.elastic import LAUNCHABLE, Elastic, ElasticSettings, SimulatedProvider
from federation.placement.estimates import estimate
from federation.sim.elastic import Launches
from federation.sim.fields import InputFileError
from federation.sim.replay import ReplayResult as Result
from federation.sim.replay import replay
from federation.sim.runs import TaskRun
from federation.sim.state import SiteState
from federation.sim.topology import launchable_nodes, load_topology
from federation.sim.trace import load_trace

from .conftest import refusal, replay_texts, write
from .test_input_checks import fedctl

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
    assert message in refusal(tmp_path, TOPOLOGY, old, new)


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


# The datacenter's only node is busy for 1,000 s; a gang of two replicas of two GPUs each
# arrives at 1 s. Each cloud node holds one replica: two launch.
BUSY_THEN_GANG = "job_id,submit_s,duration_s,replicas,accelerator_count\nbusy,0,1000,1,4\n"
GANG = "gang,1,100,2,2\n"
PRICE, DELAY_S, RUN_S, IDLE_S = 8.0, 10.0, 100.0, 60.0


def _replay(tmp_path: Path, trace: str, policies: list[str], topology: str = TOPOLOGY) -> Result:
    return replay_texts(tmp_path, topology, trace, policies)


def test_sites_publish_launchable_nodes_as_an_agent_does(tmp_path: Path) -> None:
    """The nodes of a node type are the agent's (``Elastic.nodes``), named within the site
    as the simulator names nodes; placement sees their delay and price."""
    topology = load_topology(write(tmp_path, "t.yaml", TOPOLOGY))
    cloud = topology.sites[0]
    agent = Elastic(cloud.node_types, SimulatedProvider(), ElasticSettings()).nodes()
    published = launchable_nodes(cloud)
    for node in agent:
        node.name = f"cloud/{node.name}"
        for device in node.devices:
            device.id = f"cloud/{device.id}"
    assert published == agent
    assert [n.launch.state for n in published] == [LAUNCHABLE, LAUNCHABLE]
    snap = SiteState(topology).snap
    elastic = [snap.node_names.index(n.name) for n in published]
    assert snap.node_provision_s[elastic].tolist() == [DELAY_S, DELAY_S]
    assert snap.node_price_per_hour[elastic].tolist() == [PRICE, PRICE]
    gang = load_trace(
        write(tmp_path, "g.csv", "replicas,accelerator_count,submit_s,duration_s\n2,2,0,100\n")
    )[0].request(0)
    est = estimate(gang, snap)
    cloud_at = snap.site_ids.index("cloud")
    assert est.provision_s[cloud_at] == DELAY_S
    assert est.cost_usd[cloud_at] == pytest.approx(2 * PRICE * (DELAY_S + RUN_S) / 3600)


def test_a_gang_launches_cloud_nodes_waits_for_them_and_pays_until_their_release(
    tmp_path: Path,
) -> None:
    result = _replay(tmp_path, BUSY_THEN_GANG + GANG, ["completion-time"])
    outcome = result.outcomes["completion-time"]
    busy, gang = outcome.tasks
    assert outcome.site_ids[busy.site] == "dc"
    assert outcome.site_ids[gang.site] == "cloud"
    assert (gang.placed_s, gang.launch_s, gang.started_s) == (1.0, DELAY_S, 1.0 + DELAY_S)
    assert gang.finished_s == 1.0 + DELAY_S + RUN_S
    figures = result.summary["policies"]["completion-time"]
    assert figures["launches"] == 2
    assert figures["launch_wait_s"] == {"mean": DELAY_S, "p50": DELAY_S, "p95": DELAY_S}
    node_s = 2 * (DELAY_S + RUN_S + IDLE_S)  # released 60 s after the gang ends
    assert figures["launched_node_hours"] == pytest.approx(node_s / 3600)
    cost = figures["cost_usd"]
    assert cost["elastic"] == pytest.approx(PRICE * node_s / 3600)
    assert cost["total"] == pytest.approx(cost["compute"] + cost["egress"] + cost["elastic"])
    assert figures["jobs_completed"] == 2


def test_capacity_returns_to_none_running_after_the_idle_time(tmp_path: Path) -> None:
    """Driven by hand: LAUNCHING for the delay, RUNNING (no delay left in the snapshot), then
    released exactly ``idle_release_s`` after the last task left, and launchable again."""
    topology = load_topology(write(tmp_path, "t.yaml", TOPOLOGY))
    state = SiteState(topology)
    launches = Launches(topology, state.snap)
    site = state.snap.site_ids.index("cloud")
    gang = load_trace(
        write(tmp_path, "g.csv", "replicas,accelerator_count,submit_s,duration_s\n2,2,0,100\n")
    )[0].request(0)
    grant = launches.allocate(state, gang, site, 0.0)
    assert len(set(grant.nodes)) == 2
    assert launches.hold(grant.nodes, 0.0) == DELAY_S
    nodes = list(grant.nodes)
    launches.advance(DELAY_S - 0.01)
    assert launches.running(site) == 0
    assert state.snap.node_provision_s[nodes].tolist() == [DELAY_S, DELAY_S]
    launches.advance(DELAY_S)
    assert launches.running(site) == 2
    assert state.snap.node_provision_s[nodes].tolist() == [0.0, 0.0]
    launches.leave(grant.nodes, DELAY_S + RUN_S)
    launches.advance(DELAY_S + RUN_S + IDLE_S - 0.01)
    assert launches.running(site) == 2
    launches.advance(DELAY_S + RUN_S + IDLE_S)
    assert launches.running(site) == 0
    assert state.snap.node_provision_s[nodes].tolist() == [DELAY_S, DELAY_S]
    assert launches.tally.node_s == 2 * (DELAY_S + RUN_S + IDLE_S)


def test_a_running_node_is_reused_and_a_released_one_launched_again(tmp_path: Path) -> None:
    """The gang ends at 111 s. A second gang at 150 s finds both nodes running: no launch, no
    wait. They are released 60 s after it ends (310 s); a third gang at 400 s launches them
    again and waits."""
    trace = BUSY_THEN_GANG + GANG + "again,150,100,2,2\nlater,400,100,2,2\n"
    result = _replay(tmp_path, trace, ["completion-time"])
    _, first, again, later = result.outcomes["completion-time"].tasks
    assert {r.site for r in (first, again, later)} == {first.site}
    assert (again.launch_s, again.started_s) == (0.0, 150.0)
    assert (later.launch_s, later.started_s) == (DELAY_S, 400.0 + DELAY_S)
    figures = result.summary["policies"]["completion-time"]
    assert figures["launches"] == 4
    node_s = 2 * ((250.0 + IDLE_S) - 1.0) + 2 * (DELAY_S + RUN_S + IDLE_S)
    assert figures["launched_node_hours"] == pytest.approx(node_s / 3600)
    assert figures["cost_usd"]["elastic"] == pytest.approx(PRICE * node_s / 3600)


def test_warm_min_keeps_a_node_running_to_the_end(tmp_path: Path) -> None:
    """One node is released after its idle time, the other kept: charged until the replay
    ends (the busy task's end at 1,000 s)."""
    topology = TOPOLOGY.replace("idle_release_s: 60", "idle_release_s: 60\n    warm_min: 1")
    result = _replay(tmp_path, BUSY_THEN_GANG + GANG, ["completion-time"], topology)
    node_s = (DELAY_S + RUN_S + IDLE_S) + (1000.0 - 1.0)
    figures = result.summary["policies"]["completion-time"]
    assert figures["launched_node_hours"] == pytest.approx(node_s / 3600)


@pytest.mark.parametrize("policy", ["completion-time", "round-robin", "least-loaded"])
def test_a_gang_needing_more_than_max_nodes_never_goes_to_the_cloud(
    tmp_path: Path, policy: str
) -> None:
    """Three replicas of two GPUs: the cloud may launch two such nodes. With the datacenter's
    four GPUs the gang fits nowhere; with eight it waits for the busy node there."""
    trace = BUSY_THEN_GANG + "big,1,100,3,2\n"
    figures = _replay(tmp_path, trace, [policy]).summary["policies"][policy]
    assert (figures["tasks_that_fit_nowhere"], figures["launches"]) == (1, 0)
    bigger = TOPOLOGY.replace("model: A100-80GB, count: 4", "model: A100-80GB, count: 8")
    trace = (
        "job_id,submit_s,duration_s,replicas,accelerator_count\nbusy,0,1000,1,8\nbig,1,100,3,2\n"
    )
    result = _replay(tmp_path, trace, [policy], bigger)
    _, big = result.outcomes[policy].tasks
    assert (result.outcomes[policy].site_ids[big.site], big.placed_s) == ("dc", 1000.0)
    assert result.summary["policies"][policy]["launches"] == 0


def test_policies_that_ignore_the_delay_replay_on_launchable_capacity(tmp_path: Path) -> None:
    """Round robin and free-capacity policies place on launchable nodes like any other: every
    task runs, no more nodes of a type run at once than its max, and the cost adds up."""
    rows = [f"j{i},{7 * i},{50 + 13 * (i % 5)},{1 + i % 2},{1 + i % 2}" for i in range(40)]
    trace = "job_id,submit_s,duration_s,replicas,accelerator_count\n" + "\n".join(rows) + "\n"
    policies = ["round-robin", "static-weights", "dynamic-weights", "least-loaded"]
    result = _replay(tmp_path, trace, policies)
    for policy in policies:
        figures = result.summary["policies"][policy]
        assert figures["jobs_completed"] == 40, policy
        assert figures["launches"] > 0, policy
        assert figures["cost_usd"]["elastic"] == pytest.approx(
            PRICE * figures["launched_node_hours"]
        )
        outcome = result.outcomes[policy]
        on_cloud = [r for r in outcome.tasks if outcome.site_ids[r.site] == "cloud"]
        assert all(r.started_s == r.placed_s + r.launch_s for r in on_cloud)
        assert all(r.launch_s in (0.0, DELAY_S) or 0 < r.launch_s < DELAY_S for r in on_cloud)
        assert _most_at_once(on_cloud) <= 2 * 2  # two nodes of two GPUs


def _most_at_once(runs: list[TaskRun]) -> int:
    """The most GPUs the runs held at once, from placement to end."""
    edges = sorted(
        [(r.placed_s, r.request.replicas * r.request.accelerator_count) for r in runs]
        + [(r.finished_s, -r.request.replicas * r.request.accelerator_count) for r in runs],
        key=lambda e: (e[0], e[1]),
    )
    held = most = 0
    for _, change in edges:
        held += change
        most = max(most, held)
    return most


def test_the_cli_reports_launches_in_json_and_a_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    topology = write(tmp_path, "t.yaml", TOPOLOGY)
    trace = write(tmp_path, "trace.csv", BUSY_THEN_GANG + GANG)
    argv = ["sim", "--topology", topology, "--trace", trace, "--policies", "completion-time"]
    assert fedctl(*argv, "-o", "json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["topology"]["launchable_nodes"] == 2
    assert report["policies"]["completion-time"]["launches"] == 2
    assert fedctl(*argv) == 0
    out = capsys.readouterr().out
    assert "1 nodes (+2 launchable)" in out
    assert "Elastic capacity" in out


def test_each_node_is_released_its_idle_time_after_its_own_last_task(tmp_path: Path) -> None:
    """Two single-node jobs end at 111 s and 131 s: their nodes go at 171 s and 191 s."""
    trace = BUSY_THEN_GANG + "short,1,100,1,2\nlonger,1,120,1,2\n"
    figures = _replay(tmp_path, trace, ["completion-time"]).summary["policies"]["completion-time"]
    assert figures["launches"] == 2
    node_s = (DELAY_S + 100.0 + IDLE_S) + (DELAY_S + 120.0 + IDLE_S)
    assert figures["launched_node_hours"] == pytest.approx(node_s / 3600)


def test_a_site_places_on_running_nodes_before_launching(tmp_path: Path) -> None:
    """A four-GPU node runs a two-GPU task (from 10 s); a one-GPU task at 50 s goes beside
    it, although the packer alone would pick the tighter one-GPU node, which would have to
    launch."""
    topology = """
sites:
  - name: cloud
    node_types:
      - {name: big, cpu: 16, memory_mib: 65536, devices: [{model: A100-80GB, count: 4}],
         delay_s: 10}
      - {name: small, cpu: 16, memory_mib: 65536, devices: [{model: A100-80GB, count: 1}],
         delay_s: 10}
"""
    trace = "submit_s,duration_s,accelerator_count\n0,1000,2\n50,100,1\n"
    result = _replay(tmp_path, trace, ["completion-time"], topology)
    first, second = result.outcomes["completion-time"].tasks
    assert first.grant is not None
    assert second.grant is not None
    assert second.grant.nodes == first.grant.nodes
    assert (second.launch_s, result.summary["policies"]["completion-time"]["launches"]) == (0, 1)


def test_the_shipped_example_launches_cloud_nodes_for_the_burst() -> None:
    """``examples/sim/elastic-*``: the burst outgrows the datacenter; the cloud's nodes
    launch, every job completes, and launched nodes are the whole cost (the figures
    docs/simulator.md quotes)."""
    examples = Path(__file__).resolve().parents[2] / "examples" / "sim"
    result = replay(
        load_topology(examples / "elastic-topology.yaml"),
        load_trace(examples / "elastic-trace.csv"),
        ["completion-time"],
    )
    figures = result.summary["policies"]["completion-time"]
    assert figures["jobs_completed"] == 40
    assert figures["launches"] == 8
    assert figures["launched_node_hours"] == pytest.approx(13.09, abs=0.01)
    cost = figures["cost_usd"]
    assert cost["total"] == cost["elastic"] == pytest.approx(172.77, abs=0.01)
    assert figures["jct_s"]["mean"] == pytest.approx(1971.0)
