"""Policy comparison on a case where bandwidth awareness must win, and the policy catalogue."""

from __future__ import annotations

from pathlib import Path

import pytest

from federation.placement.registry import DEFAULT_FILTERS, DEFAULT_SCORERS
from federation.sim.policies import (
    DEFAULT_POLICIES,
    PROFILES,
    UnknownPolicyError,
    build_policy,
    feasibility_key,
)
from federation.sim.replay import replay
from federation.sim.topology import load_topology
from federation.sim.trace import load_trace

from .conftest import write

# "lake" holds 50 GB and has A100s (speed 1.0); "fast" has H100s (speed 2.5) behind a
# 100 Mbit/s link, so bringing the data there takes 50e9 * 8 / 1e8 + 0.05 = 4,000.05 s.
# A 1,000 s job finishes at lake in 1,000 s and at fast in 4,000.05 + 400 s: staying is right,
# and lake's 8 GPUs hold all the work (a job every 200 s, 5 at a time), so nothing waits.
DATA_GRAVITY = """
links:
  declared:
    - {from: lake, to: fast, bandwidth_mbps: 100, rtt_ms: 50}
sites:
  - name: lake
    datasets: {scans: 50000000000}
    nodes: [{count: 4, cpu: 32, memory_mib: 262144, devices: [{model: A100-80GB, count: 2}]}]
  - name: fast
    nodes: [{count: 4, cpu: 32, memory_mib: 262144, devices: [{model: H100-80GB, count: 2}]}]
"""


def test_bandwidth_awareness_wins_on_a_thin_link_to_fast_devices(tmp_path: Path) -> None:
    """Completion-time keeps every job with its data and beats every bandwidth-blind policy."""
    rows = ["submit_s,duration_s,accelerator_count,dataset"]
    rows += [f"{200 * i},1000,1,scans" for i in range(20)]
    result = replay(
        load_topology(write(tmp_path, "t.yaml", DATA_GRAVITY)),
        load_trace(write(tmp_path, "trace.csv", "\n".join(rows) + "\n")),
        list(DEFAULT_POLICIES),
    )
    policies = result.summary["policies"]
    mean = {name: m["jct_s"]["mean"] for name, m in policies.items()}
    assert all(m["jobs_completed"] == 20 for m in policies.values())
    assert mean["completion-time"] == pytest.approx(1000.0)
    assert policies["completion-time"]["wan_bytes"] == 0
    assert mean["data-local"] == pytest.approx(1000.0)
    for blind in ("greedy", "round-robin", "static-weights", "dynamic-weights", "least-loaded"):
        assert mean[blind] > 1.5 * mean["completion-time"], blind
        assert policies[blind]["wan_bytes"] > 0, blind
    # Greedy sends the first 8 jobs to fast (4,400.05 s each) until its GPUs are all held.
    assert policies["greedy"]["wan_bytes"] == 8 * 50_000_000_000
    assert mean["greedy"] == pytest.approx((8 * 4400.05 + 12 * 1000) / 20)


def test_every_profile_builds_and_the_default_is_the_coordinators() -> None:
    """Each named policy is a valid profile; completion-time is exactly the default profile."""
    for name in PROFILES:
        build_policy(name)
    assert PROFILES["completion-time"].filters == DEFAULT_FILTERS
    assert dict(PROFILES["completion-time"].scorers) == dict(DEFAULT_SCORERS)
    with pytest.raises(UnknownPolicyError, match="known: completion-time"):
        build_policy("fastest")


def test_feasibility_key_ignores_what_filters_do_not_read() -> None:
    """Duration and arrival order do not split groups; inputs do only under data-local."""
    from federation.placement.request import Input, Request

    def req(duration: float, sequence: int, dataset: str) -> Request:
        return Request(
            replicas=1,
            cpu=1,
            memory_mib=1,
            accelerator_kind=1,
            accelerator_count=1,
            accelerator_models=frozenset(),
            accelerator_vendor="",
            accelerator_min_memory_mib=0,
            domains=frozenset(),
            regions=frozenset(),
            sites=frozenset(),
            node_labels=(),
            inputs=(Input(dataset, 1),),
            duration_s=duration,
            sequence=sequence,
        )

    a, b = req(10, 1, "x"), req(99, 2, "y")
    assert feasibility_key(DEFAULT_FILTERS, a) == feasibility_key(DEFAULT_FILTERS, b)
    local = PROFILES["data-local"].filters
    assert feasibility_key(local, a) != feasibility_key(local, b)
    assert feasibility_key(("Unknown",), a) != feasibility_key(("Unknown",), req(99, 1, "x"))
