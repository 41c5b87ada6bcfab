"""Predicted waits: a task waits for a busy fast site when, by the predicted ends of what runs
there and of the tasks already waiting for it, it would finish there sooner."""

from __future__ import annotations

from pathlib import Path

from federation.sim.replay import replay
from federation.sim.topology import load_topology
from federation.sim.trace import load_trace

from .conftest import write

# One H100 (speed 2.5 for training) and one V100 (0.38).
TWO_SITES = """
sites:
  - {name: fast, nodes: [{cpu: 8, memory_mib: 8192, devices: [{model: H100-80GB}]}]}
  - {name: slow, nodes: [{cpu: 8, memory_mib: 8192, devices: [{model: V100}]}]}
"""


def _placements(tmp_path: Path, trace: str, policy: str) -> list[tuple[str, float]]:
    result = replay(
        load_topology(write(tmp_path, "t.yaml", TWO_SITES)),
        load_trace(write(tmp_path, "trace.csv", trace)),
        [policy],
    )
    outcome = result.outcomes[policy]
    return [(outcome.site_ids[run.site], run.placed_s) for run in outcome.tasks]


def test_a_task_waits_for_the_busy_fast_site_when_it_finishes_sooner_there(
    tmp_path: Path,
) -> None:
    """The H100 is busy until 40 s. The second task would run 2,632 s on the V100 now, or
    400 s on the H100 after a 39 s wait: it waits. The third, behind it in line, would wait
    until 440 s and finish at 840 s, still before 2,632 s: it waits too, and is not placed
    on the H100 before the task ahead of it."""
    trace = "submit_s,duration_s,accelerator_count\n0,100,1\n1,1000,1\n2,1000,1\n"
    placed = _placements(tmp_path, trace, "completion-time")
    assert placed[0] == ("fast", 0.0)
    assert placed[1] == ("fast", 40.0)
    assert placed[2] == ("fast", 440.0)


def test_a_task_starts_now_when_waiting_would_not_pay(tmp_path: Path) -> None:
    """A short task (10 s of work: 26 s on the V100) does not wait 39 s for the H100; a policy
    that never predicts waits places the long one on the free V100 at once."""
    trace = "submit_s,duration_s,accelerator_count\n0,100,1\n1,10,1\n"
    assert _placements(tmp_path, trace, "completion-time")[1] == ("slow", 1.0)
    trace = "submit_s,duration_s,accelerator_count\n0,100,1\n1,1000,1\n"
    assert _placements(tmp_path, trace, "round-robin")[1] == ("slow", 1.0)
