"""The coordinator's negotiation rules as the simulator applies them: rounds, declines, backoff."""

from __future__ import annotations

from pathlib import Path

import pytest

from federation.sim.engine import SimConfig
from federation.sim.replay import replay
from federation.sim.topology import load_topology
from federation.sim.trace import load_trace

from .conftest import write

# "a" is the fastest but takes nothing (decline_rate 1: being drained); "b" then "c" follow.
THREE_SITES = """
sites:
  - {name: a, decline_rate: 1, nodes: [{cpu: 8, memory_mib: 8192, devices: [{model: H100-80GB}]}]}
  - {name: b, nodes: [{cpu: 8, memory_mib: 8192, devices: [{model: A100-80GB}]}]}
  - {name: c, nodes: [{cpu: 8, memory_mib: 8192, devices: [{model: V100}]}]}
"""


def _run(tmp_path: Path, topology: str, trace: str, config: SimConfig) -> dict[str, object]:
    result = replay(
        load_topology(write(tmp_path, "t.yaml", topology)),
        load_trace(write(tmp_path, "trace.csv", trace)),
        ["completion-time"],
        config=config,
    )
    run = result.outcomes["completion-time"].tasks[-1]
    sites = result.outcomes["completion-time"].site_ids
    return {
        "site": sites[run.site],
        "placed_s": run.placed_s,
        "epoch": run.epoch,
        "offers": run.offers,
        "declines": run.declines,
    }


def test_offers_at_once_gives_the_commit_to_the_best_acceptance(tmp_path: Path) -> None:
    """The first round offers a alone; once a declines, one round offers b and c under one
    epoch, and b (ranked above c) wins."""
    trace = "submit_s,duration_s,accelerator_count\n0,100,1\n"
    got = _run(tmp_path, THREE_SITES, trace, SimConfig(offers_at_once=3))
    assert got == {"site": "b", "placed_s": 0.0, "epoch": 2, "offers": 3, "declines": 1}


def test_a_decline_moves_down_the_ranked_list_in_a_new_round(tmp_path: Path) -> None:
    """With one offer at a time, a's decline costs a round (and an epoch) before b accepts."""
    trace = "submit_s,duration_s,accelerator_count\n0,100,1\n"
    got = _run(tmp_path, THREE_SITES, trace, SimConfig(offers_at_once=1))
    assert got == {"site": "b", "placed_s": 0.0, "epoch": 2, "offers": 2, "declines": 1}


def test_max_offers_per_round_bounds_how_far_down_the_list_a_task_goes(tmp_path: Path) -> None:
    """Allowed one offer, a task declined by a goes back to PENDING and retries with backoff."""
    topology = """
sites:
  - {name: a, decline_rate: 1, nodes: [{cpu: 8, memory_mib: 8192, devices: [{model: H100-80GB}]}]}
  - {name: b, nodes: [{cpu: 8, memory_mib: 8192, devices: [{model: A100-80GB}]}]}
"""
    # Task 2 arrives while b is busy until t=100: only a is feasible, and a declines. The
    # coordinator's backoff doubles from 0.25 s up to retry_interval_s (5 s): retries at 10.5,
    # 11.5, 13.5, 17.5, 22.5, 27.5 ... 97.5, 102.5; at 102.5 b is free again.
    trace = "submit_s,duration_s,accelerator_count\n0,100,1\n10,100,1\n"
    got = _run(tmp_path, topology, trace, SimConfig(offers_at_once=1, max_offers_per_round=5))
    attempts_before_b_frees = 5 + 16  # 10, 10.5, 11.5, 13.5, 17.5, then 22.5 ... 97.5
    assert got["site"] == "b"
    assert got["placed_s"] == pytest.approx(102.5)
    assert got["declines"] == attempts_before_b_frees + 1  # a declines once more at 102.5
    assert got["epoch"] == attempts_before_b_frees + 2


def test_a_task_that_fits_nowhere_stays_pending(tmp_path: Path) -> None:
    """A task no site could ever hold is never placed and never blocks the others."""
    trace = "submit_s,duration_s,accelerator_count\n0,100,4\n1,100,1\n"
    result = replay(
        load_topology(write(tmp_path, "t.yaml", THREE_SITES)),
        load_trace(write(tmp_path, "trace.csv", trace)),
        ["completion-time"],
    )
    m = result.summary["policies"]["completion-time"]
    assert (m["jobs_completed"], m["tasks_that_fit_nowhere"], m["tasks_never_placed"]) == (1, 1, 1)
