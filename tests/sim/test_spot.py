"""Spot capacity in the simulator: node types declared ``spot`` are charged their spot price,
and under the site's reclaim model the cloud takes their nodes back; the tasks on them stop,
lose their run since their last checkpoint, and are placed again without counting as
preempted, while the node is launchable again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from federation.common import job_state
from federation.sim.engine import MAX_RECLAIMS
from federation.sim.replay import ReplayResult, replay
from federation.sim.topology import load_topology
from federation.sim.trace import load_trace

from .conftest import refusal, replay_texts, write
from .test_input_checks import fedctl

DELAY_S, RECLAIM_S, SPOT_PRICE, IDLE_S = 10.0, 600.0, 2.0, 60.0
SPOT = f"""
sites:
  - name: cloud
    domain: cloud
    idle_release_s: {IDLE_S:g}
    spot_reclaim_after_s: {RECLAIM_S:g}
    node_types:
      - name: a100x2
        cpu: 16
        memory_mib: 131072
        devices: [{{model: A100-80GB, count: 2}}]
        max: 1
        price_per_hour: 8.0
        spot: true
        spot_price_per_hour: {SPOT_PRICE:g}
        delay_s: {DELAY_S:g}
"""
# One task of 1,000 s on A100s (speed 1.0), checkpointing every 250 s of run.
DURATION_S, CHECKPOINT_S = 1000.0, 250.0
ONE = (
    "job_id,submit_s,duration_s,accelerator_count,checkpoint_interval_s\n"
    f"spot,0,{DURATION_S:g},2,{CHECKPOINT_S:g}\n"
)


PLAIN = SPOT.replace("        spot: true\n", "").replace("    spot_reclaim_after_s: 600\n", "")
"""The same site with on-demand nodes only."""


def _replay(
    tmp_path: Path, trace: str, topology: str = SPOT, policy: str = "completion-time", seed: int = 0
) -> ReplayResult:
    return replay_texts(tmp_path, topology, trace, [policy], seed)


def test_spot_and_the_reclaim_model_are_read(tmp_path: Path) -> None:
    (site,) = load_topology(write(tmp_path, "t.yaml", SPOT)).sites
    (node_type,) = site.node_types
    assert (node_type.spot, node_type.spot_price_per_hour) == (True, SPOT_PRICE)
    assert (site.spot_reclaim_after_s, site.spot_mean_lifetime_s) == (RECLAIM_S, 0.0)
    (site,) = load_topology(write(tmp_path, "t.yaml", PLAIN)).sites
    assert (site.node_types[0].spot, site.spot_reclaim_after_s) == (False, 0.0)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("spot: true", "spot: maybe", "sites[0].node_types[0].spot: expected true or false"),
        ("spot: true", "spot: false", "sites[0].spot_reclaim_after_s: applies to spot nodes"),
        (
            "spot_reclaim_after_s: 600",
            "spot_reclaim_after_s: 0",
            "sites[0].spot_reclaim_after_s: must be > 0, got 0",
        ),
        (
            "spot_reclaim_after_s: 600",
            "spot_mean_lifetime_s: -1",
            "sites[0].spot_mean_lifetime_s: must be >= 0, got -1",
        ),
        (
            "spot_reclaim_after_s: 600",
            "spot_reclaim_after_s: 600\n    spot_mean_lifetime_s: 600",
            "sites[0].spot_mean_lifetime_s: give spot_reclaim_after_s or spot_mean_lifetime_s",
        ),
    ],
)
def test_bad_spot_settings_are_refused_naming_the_field(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    assert message in refusal(tmp_path, SPOT, old, new)


def test_a_reclaimed_task_restarts_from_its_checkpoint_on_a_relaunched_node(
    tmp_path: Path,
) -> None:
    """The node runs at 10 s and the task starts; the cloud takes the node back 600 s later
    (610 s), when the task has checkpointed 500 s and lost the 100 s since. Placed again at
    once, it relaunches the node (launchable again), starts at 620 s and runs the 500 s left:
    it ends 110 s (the lost run plus the launch delay) after it would have."""
    result = _replay(tmp_path, ONE)
    (run,) = result.outcomes["completion-time"].tasks
    reclaimed_at = DELAY_S + RECLAIM_S
    lost_s = RECLAIM_S % CHECKPOINT_S
    assert (run.state, run.reclaims, run.preemptions) == (job_state.SUCCEEDED, 1, 0)
    assert (run.placed_s, run.started_s) == (reclaimed_at, reclaimed_at + DELAY_S)
    assert run.finished_s == reclaimed_at + DELAY_S + (DURATION_S - (RECLAIM_S - lost_s))
    assert run.finished_s == (DELAY_S + DURATION_S) + lost_s + DELAY_S
    assert run.reclaim_lost_device_s == lost_s * 2
    figures = result.summary["policies"]["completion-time"]
    assert (figures["launches"], figures["spot_reclaims"], figures["spot_interruptions"]) == (
        2,
        1,
        1,
    )
    assert figures["spot_device_hours_lost"] == pytest.approx(lost_s * 2 / 3600)
    # Its second node was released idle before its own reclaim came: not taken back. Charged
    # at the spot price, from each launch to its reclaim or release.
    node_s = reclaimed_at + (run.finished_s + IDLE_S - reclaimed_at)
    assert figures["launched_node_hours"] == pytest.approx(node_s / 3600)
    assert figures["cost_usd"]["elastic"] == pytest.approx(SPOT_PRICE * node_s / 3600)


def test_a_task_longer_than_the_spot_lifetime_without_checkpoints_is_given_up(
    tmp_path: Path,
) -> None:
    """It loses all it ran at every reclaim and would restart forever: after
    ``MAX_RECLAIMS`` it stays PENDING, counted, and the replay ends."""
    trace = ONE.replace(f",{CHECKPOINT_S:g}\n", ",0\n")
    result = _replay(tmp_path, trace)
    (run,) = result.outcomes["completion-time"].tasks
    assert (run.state, run.reclaims) == (job_state.PENDING, MAX_RECLAIMS)
    assert run.reclaim_lost_device_s == MAX_RECLAIMS * RECLAIM_S * 2
    figures = result.summary["policies"]["completion-time"]
    assert (figures["jobs_completed"], figures["spot_tasks_given_up"]) == (0, 1)


def test_with_queues_a_reclaimed_task_waits_in_line_and_restarts_alike(tmp_path: Path) -> None:
    topology = SPOT + "queues:\n  - {name: q, tenant: t}\n"
    trace = ONE.replace("\n", ",tenant\n", 1).replace(
        f",{CHECKPOINT_S:g}\n", f",{CHECKPOINT_S:g},t\n"
    )
    result = _replay(tmp_path, trace, topology)
    (run,) = result.outcomes["completion-time"].tasks
    assert (run.reclaims, run.preemptions) == (1, 0)
    assert run.finished_s == (DELAY_S + DURATION_S) + RECLAIM_S % CHECKPOINT_S + DELAY_S
    assert (
        result.summary["policies"]["completion-time"]["sharing"]["tenants"]["t"]["preemptions"] == 0
    )


LIFETIMES = SPOT.replace("spot_reclaim_after_s: 600", "spot_mean_lifetime_s: 400").replace(
    "max: 1", "max: 4"
)
MANY = "job_id,submit_s,duration_s,accelerator_count,checkpoint_interval_s\n" + "".join(
    f"j{i},{40 * i},{300 + 70 * (i % 7)},{1 + i % 2},{60 * (i % 3)}\n" for i in range(30)
)


def test_drawn_lifetimes_are_the_same_under_a_seed(tmp_path: Path) -> None:
    """Exponential lifetimes are drawn from the seeded generator: one seed, one report; every
    task still completes."""
    first = _replay(tmp_path, MANY, LIFETIMES, seed=3).summary
    again = _replay(tmp_path, MANY, LIFETIMES, seed=3).summary
    other = _replay(tmp_path, MANY, LIFETIMES, seed=4).summary
    assert json.dumps(first, sort_keys=True) == json.dumps(again, sort_keys=True)
    figures = first["policies"]["completion-time"]
    assert figures["jobs_completed"] == 30
    assert figures["spot_reclaims"] > 0
    assert figures["spot_interruptions"] >= 1
    assert other["policies"]["completion-time"] != figures


@pytest.mark.parametrize("policy", ["round-robin", "least-loaded", "greedy"])
def test_every_policy_finishes_every_task_despite_reclaims(tmp_path: Path, policy: str) -> None:
    topology = LIFETIMES.replace(
        "sites:\n",
        "sites:\n  - name: dc\n    nodes: [{cpu: 64, memory_mib: 524288,"
        " devices: [{model: A100-80GB, count: 2}]}]\n",
    )
    result = _replay(tmp_path, MANY, topology, policy, seed=1)
    figures = result.summary["policies"][policy]
    assert figures["jobs_completed"] == 30
    assert 0 < figures["utilisation"]["all"] <= 1.0


def test_without_spot_the_report_has_no_spot_figures(tmp_path: Path) -> None:
    figures = _replay(tmp_path, ONE, PLAIN).summary["policies"]["completion-time"]
    assert not any(key.startswith("spot_") for key in figures)
    assert figures["cost_usd"]["elastic"] == pytest.approx(8.0 * (1010 + IDLE_S) / 3600)


def test_the_cli_shows_reclaims(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    topology = write(tmp_path, "t.yaml", SPOT)
    trace = write(tmp_path, "trace.csv", ONE)
    argv: list[str | Path] = [
        "sim",
        "--topology",
        topology,
        "--trace",
        trace,
        "--policies",
        "completion-time",
    ]
    assert fedctl(*argv) == 0
    out = capsys.readouterr().out
    assert "reclaims" in out
    assert "dev-h lost" in out


def test_the_shipped_spot_example_trades_jct_for_price() -> None:
    """``examples/sim/elastic-spot-topology.yaml``: the L40S nodes as spot capacity, taken
    back 40 minutes after they run (the figures docs/simulator.md quotes)."""
    examples = Path(__file__).resolve().parents[2] / "examples" / "sim"
    result = replay(
        load_topology(examples / "elastic-spot-topology.yaml"),
        load_trace(examples / "elastic-trace.csv"),
        ["completion-time"],
    )
    figures = result.summary["policies"]["completion-time"]
    assert figures["jobs_completed"] == 40
    assert (figures["launches"], figures["spot_reclaims"], figures["spot_interruptions"]) == (
        11,
        4,
        5,
    )
    assert figures["spot_device_hours_lost"] == pytest.approx(5.22, abs=0.01)
    assert figures["cost_usd"]["total"] == pytest.approx(163.90, abs=0.01)
