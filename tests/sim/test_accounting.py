"""The simulator's accounting on a case small enough to work out by hand.

Two sites: ``dc`` holds dataset ``d`` (10 GB) and has one node with 2 A100s (speed 1.0, 400 W),
free of charge but 0.05 $/GB to send data out; ``cloud`` has one node with 1 H100 (speed 2.5,
700 W) at 4 $/device-hour. Between them 1,000 Mbit/s and 100 ms, so moving ``d`` takes
10e9 * 8 / 1e9 + 0.1 = 80.1 s.

- j1 (t=0, 1 GPU, 1,000 s, reads d): cloud finishes in 80.1 + 400 = 480.1 s, dc in 1,000 s:
  cloud. JCT 480.1.
- j2 (t=10, 1 GPU, 360 s, priority 5): cloud is taken, dc runs it: 10 -> 370. JCT 360.
- j3 (t=20, 2 GPUs, 100 s, deadline 400 s): cloud can never hold 2 GPUs, dc has 1 free until
  j2 ends; it waits 350 s and runs 370 -> 470. JCT 450, deadline missed.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from federation.common import job_state
from federation.common.job_state import IllegalTransitionError
from federation.sim.engine import Simulation
from federation.sim.replay import replay
from federation.sim.state import SiteState
from federation.sim.topology import Topology, load_topology
from federation.sim.trace import TraceTask, load_trace

from .conftest import write

TOPOLOGY = """
links:
  declared:
    - {from: dc, to: cloud, bandwidth_mbps: 1000, rtt_ms: 100}
sites:
  - name: dc
    domain: datacenter
    egress_usd_per_gb: 0.05
    datasets: {d: 10000000000}
    nodes:
      - {cpu: 16, memory_mib: 65536, devices: [{model: A100-80GB, count: 2}]}
  - name: cloud
    domain: cloud
    price_per_device_hour: 4.0
    nodes:
      - {cpu: 16, memory_mib: 65536, devices: [{model: H100-80GB, count: 1}]}
"""
TRACE = """job_id,submit_s,duration_s,accelerator_count,dataset,priority,deadline_s
j1,0,1000,1,d,0,
j2,10,360,1,,5,
j3,20,100,2,,0,400
"""


@pytest.fixture
def case(tmp_path: Path) -> tuple[Topology, list[TraceTask]]:
    """The two-site, three-job case."""
    topology = load_topology(write(tmp_path, "topology.yaml", TOPOLOGY))
    return topology, load_trace(write(tmp_path, "trace.csv", TRACE))


def test_completion_time_policy_has_the_hand_computed_figures(
    case: tuple[Topology, list[TraceTask]],
) -> None:
    """Placements, times, bytes, money, energy, waiting and the bound are exactly as worked out."""
    topology, tasks = case
    result = replay(topology, tasks, ["completion-time"])
    runs = {r.trace.job_id: r for r in result.outcomes["completion-time"].tasks}
    sites = result.outcomes["completion-time"].site_ids
    assert {j: sites[r.site] for j, r in runs.items()} == {"j1": "cloud", "j2": "dc", "j3": "dc"}
    assert runs["j1"].transfer_s == pytest.approx(80.1)
    assert runs["j1"].started_s == pytest.approx(80.1)
    assert runs["j1"].run_s == pytest.approx(400.0)
    assert [runs[j].finished_s for j in ("j1", "j2", "j3")] == pytest.approx([480.1, 370, 470])
    assert runs["j3"].placed_s == pytest.approx(370.0)
    assert all(r.state == job_state.SUCCEEDED for r in runs.values())

    m = result.summary["policies"]["completion-time"]
    assert m["jobs_completed"] == 3
    assert m["jct_s"]["mean"] == pytest.approx((480.1 + 360 + 450) / 3)
    assert m["jct_s"]["p50"] == pytest.approx(450.0)
    assert m["queueing_delay_s"]["mean"] == pytest.approx(350 / 3)
    assert m["makespan_s"] == pytest.approx(480.1)
    assert m["wan_bytes"] == 10_000_000_000
    assert m["transfer_share_of_jct"] == pytest.approx(80.1 / (480.1 + 360 + 450))
    # Compute is billed while devices are held (transfer included); egress where data leaves.
    assert m["cost_usd"]["compute"] == pytest.approx(4.0 * 480.1 / 3600, abs=1e-6)
    assert m["cost_usd"]["egress"] == pytest.approx(10 * 0.05)
    assert m["energy_kwh"] == pytest.approx((700 * 400 + 400 * 360 + 800 * 100) / 3.6e6, abs=1e-6)
    assert m["deadlines"] == {"tasks_with_deadline": 1, "missed": 1}
    assert m["by_priority"]["0"]["mean_jct_s"] == pytest.approx((480.1 + 450) / 2)
    assert m["by_priority"]["5"]["mean_jct_s"] == pytest.approx(360.0)
    # j3 waited 350 s with one A100 idle, of three devices.
    assert m["fragmentation"]["idle_device_hours_while_waiting"] == pytest.approx(350 / 3600)
    assert m["fragmentation"]["idle_share_while_waiting"] == pytest.approx(1 / 3)
    # Running: H100 400 s, A100s 360 + 2 x 100 s; held: H100 480.1 s; window 480.1 s.
    assert m["utilisation"]["GPU/H100-80GB"] == pytest.approx(400 / 480.1, abs=1e-6)
    assert m["utilisation"]["GPU/A100-80GB"] == pytest.approx(560 / (2 * 480.1), abs=1e-6)
    assert m["utilisation"]["GPU"] == pytest.approx(960 / (3 * 480.1), abs=1e-6)
    assert m["allocation"]["GPU/H100-80GB"] == pytest.approx(1.0)
    assert m["utilisation_while_arriving"] == pytest.approx(10 / (3 * 20))  # j2 from t=10
    # Bound: j1 1,000 / 2.5, j2 360 / 2.5, j3 100 on the A100s (only dc holds 2 GPUs).
    assert result.summary["lower_bound_mean_jct_s"] == pytest.approx((400 + 144 + 100) / 3)
    assert m["jct_over_bound"] == pytest.approx(((480.1 + 360 + 450) / 3) / ((400 + 144 + 100) / 3))
    # Each job's first round offers its best site alone, and each accepts.
    assert (m["offers"], m["declines"]) == (3, 0)


def test_data_local_keeps_the_job_with_its_data(case: tuple[Topology, list[TraceTask]]) -> None:
    """Under data-local j1 runs at dc (1,000 s), so j2 takes the H100 and j3 waits for j1."""
    topology, tasks = case
    result = replay(topology, tasks, ["data-local"])
    runs = {r.trace.job_id: r for r in result.outcomes["data-local"].tasks}
    assert [runs[j].finished_s for j in ("j1", "j2", "j3")] == pytest.approx([1000, 154, 1100])
    m = result.summary["policies"]["data-local"]
    assert m["wan_bytes"] == 0
    assert m["jct_s"]["mean"] == pytest.approx((1000 + 144 + 1080) / 3)
    assert m["cost_usd"]["compute"] == pytest.approx(4.0 * 144 / 3600, abs=1e-6)


def test_every_task_goes_through_the_state_machine(
    case: tuple[Topology, list[TraceTask]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each task's changes pass through check_transition, in the coordinator's order."""
    topology, tasks = case
    seen: list[tuple[int, int]] = []
    real = job_state.check_transition

    def record(current: int, new: int) -> None:
        seen.append((current, new))
        real(current, new)

    monkeypatch.setattr(job_state, "check_transition", record)
    replay(topology, tasks, ["completion-time"])
    path = [
        (job_state.PENDING, job_state.DELEGATED),
        (job_state.DELEGATED, job_state.RUNNING),
        (job_state.RUNNING, job_state.SUCCEEDED),
    ]
    assert Counter(seen) == dict.fromkeys(path, 3)


def test_an_illegal_transition_is_refused(case: tuple[Topology, list[TraceTask]]) -> None:
    """Starting a task that was never delegated is a bug the state machine catches."""
    topology, tasks = case
    sim = Simulation("completion-time", SiteState(topology), tasks)
    with pytest.raises(IllegalTransitionError):
        sim._start(0)
