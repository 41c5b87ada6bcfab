"""True speeds that differ from the speed table, and ``--learn``: the replay's scheduler learns
device speeds from finished tasks with the coordinator's ``SpeedLearner``.

Two sites: ``h`` has one H100 (2.5 in the table) that truly runs at a tenth of that (0.25, a
topology ``speed_factors`` entry); ``a`` has one A100 (1.0, true). Ten 1-GPU jobs of 100 s of
reference work arrive one at a time. By the table the H100 finishes in 40 s, so every job goes
there and runs 400 s; learning, the first three teach the scheduler the H100's true speed and
the other seven go to the A100 (100 s).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from federation.coordinator.scheduling.learning import MIN_TASKS
from federation.sim.engine import SimConfig
from federation.sim.fields import InputFileError
from federation.sim.replay import replay
from federation.sim.state import SiteState
from federation.sim.topology import Topology, load_topology
from federation.sim.trace import TraceTask, load_trace

from .conftest import write
from .test_cli import fedctl

TOPOLOGY = """
speed_factors: {H100-80GB: 0.1}
sites:
  - name: h
    nodes: [{cpu: 16, memory_mib: 65536, devices: [{model: H100-80GB, count: 1}]}]
  - name: a
    nodes: [{cpu: 16, memory_mib: 65536, devices: [{model: A100-80GB, count: 1}]}]
"""
JOBS = 10
TRACE = "submit_s,duration_s,accelerator_count\n" + "".join(
    f"{1000 * i},100,1\n" for i in range(JOBS)
)


@pytest.fixture
def case(tmp_path: Path) -> tuple[Topology, list[TraceTask]]:
    topology = load_topology(write(tmp_path, "topology.yaml", TOPOLOGY))
    return topology, load_trace(write(tmp_path, "trace.csv", TRACE))


def test_devices_run_at_their_true_speed(case: tuple[Topology, list[TraceTask]]) -> None:
    """Without learning every estimate trusts the table: all on the H100, all slower."""
    topology, tasks = case
    assert topology.speed_factors == {"H100-80GB": 0.1}
    result = replay(topology, tasks, ["completion-time"])
    m = result.summary["policies"]["completion-time"]
    assert result.summary["learn"] is False
    assert "learned_speeds" not in m
    assert {topology.sites[r.site].name for r in result.outcomes["completion-time"].tasks} == {"h"}
    assert m["jct_s"]["mean"] == pytest.approx(400.0)
    assert m["slower_than_estimate"]["share"] == 1.0
    assert m["run_time_over_estimate"]["mean"] == pytest.approx(10.0)
    # The lower bound is the true fastest device: the A100's 100 s.
    assert result.summary["lower_bound_mean_jct_s"] == pytest.approx(100.0)


def test_learning_moves_work_to_the_truly_faster_site(
    case: tuple[Topology, list[TraceTask]],
) -> None:
    topology, tasks = case
    result = replay(topology, tasks, ["completion-time"], config=SimConfig(learn=True))
    m = result.summary["policies"]["completion-time"]
    assert result.summary["learn"] is True
    sites = [topology.sites[r.site].name for r in result.outcomes["completion-time"].tasks]
    assert sites == ["h"] * MIN_TASKS + ["a"] * (JOBS - MIN_TASKS)
    expected = (MIN_TASKS * 400.0 + (JOBS - MIN_TASKS) * 100.0) / JOBS
    assert m["jct_s"]["mean"] == pytest.approx(expected)
    assert m["slower_than_estimate"]["on_slower_devices"] == MIN_TASKS
    assert m["learned_speeds"] == {
        "training": {"A100-80GB": pytest.approx(1.0), "H100-80GB": pytest.approx(0.25)}
    }


def test_a_right_table_learns_nothing_new(case: tuple[Topology, list[TraceTask]]) -> None:
    """With true speeds equal to the table, learning places every task as before."""
    topology, tasks = case
    plain = Topology(topology.sites, topology.bandwidth_mbps, topology.rtt_ms, topology.link_known)
    without = replay(plain, tasks, ["completion-time"]).summary["policies"]["completion-time"]
    learned = replay(plain, tasks, ["completion-time"], config=SimConfig(learn=True))
    figures = learned.summary["policies"]["completion-time"]
    assert figures.pop("learned_speeds") == {"training": {"H100-80GB": pytest.approx(2.5)}}
    assert figures == without


def test_a_slow_site_runs_slower_and_bounds_know(tmp_path: Path) -> None:
    """A site's ``speed_factor`` slows every device there, and the lower bound counts it."""
    topology = load_topology(
        write(
            tmp_path,
            "t.yaml",
            """
sites:
  - name: slow
    speed_factor: 0.5
    nodes: [{cpu: 16, memory_mib: 65536, devices: [{model: A100-80GB, count: 1}]}]
""",
        )
    )
    state = SiteState(topology)
    assert list(state.speed_factor) == [0.5]
    tasks = load_trace(
        write(tmp_path, "trace.csv", "submit_s,duration_s,accelerator_count\n0,100,1\n")
    )
    result = replay(topology, tasks, ["completion-time"])
    run = result.outcomes["completion-time"].tasks[0]
    assert run.run_s == pytest.approx(200.0)
    assert result.summary["lower_bound_mean_jct_s"] == pytest.approx(200.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("speed_factors: {T4: 0.5}\n", "speed_factors.T4: no site has this model"),
        ("speed_factors: {A100-80GB: 0}\n", "speed_factors.A100-80GB: must be >= 0.001"),
        ("speed_factors: {A100-80GB: fast}\n", "expected a number"),
    ],
)
def test_speed_factors_are_checked(tmp_path: Path, text: str, message: str) -> None:
    site = (
        "sites: [{name: s, speed_factor: 1, nodes: [{cpu: 1, memory_mib: 1, devices: "
        "[{model: A100-80GB}]}]}]\n"
    )
    with pytest.raises(InputFileError, match=message):
        load_topology(write(tmp_path, "t.yaml", text + site))


def test_site_speed_factor_is_checked(tmp_path: Path) -> None:
    bad = "sites: [{name: s, speed_factor: -1, nodes: [{cpu: 1, memory_mib: 1}]}]\n"
    with pytest.raises(InputFileError, match=r"sites\[0\].speed_factor: must be >= 0.001"):
        load_topology(write(tmp_path, "t.yaml", bad))


def test_cli_learn_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topology = write(tmp_path, "topology.yaml", TOPOLOGY)
    trace = write(tmp_path, "trace.csv", TRACE)
    argv = ("sim", "--topology", topology, "--trace", trace, "--policies", "completion-time")
    assert fedctl(*argv, "--json") == 0
    plain = json.loads(capsys.readouterr().out)
    assert fedctl(*argv, "--json", "--learn") == 0
    learned = json.loads(capsys.readouterr().out)
    assert (plain["learn"], learned["learn"]) == (False, True)
    before = plain["policies"]["completion-time"]
    after = learned["policies"]["completion-time"]
    assert after["jct_s"]["mean"] < before["jct_s"]["mean"]
    assert after["slower_than_estimate"]["share"] < before["slower_than_estimate"]["share"]
