"""Table tests for the baseline plugins the simulator compares against the default profile."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest

from federation.placement.framework import Framework
from federation.placement.plugins.baselines import (
    DataLocal,
    LeastLoaded,
    RoundRobin,
    RunTimeOnly,
    StaticWeights,
)
from federation.placement.plugins.capacity_fit import CapacityFit
from federation.placement.registry import FILTERS, SCORERS, build_framework
from federation.placement.request import Input
from federation.placement.snapshot import Snapshot

from .builders import GPU, device, node, request, site, snapshot


def _gpus(n: int, *, busy: int = 0, model: str = "A100-80GB") -> list:
    return [device(GPU, model=model, allocated=i < busy) for i in range(n)]


def three_sites() -> Snapshot:
    """a: 2 GPUs (1 busy), b: 8 GPUs (6 busy), c: 4 GPUs (none busy)."""
    return snapshot(
        site("a", node("a0", devices=_gpus(2, busy=1))),
        site("b", node("b0", devices=_gpus(8, busy=6))),
        site("c", node("c0", devices=_gpus(4))),
    )


def _first(framework: Framework, req_sequence: int, snap: Snapshot) -> str:
    req = dataclasses.replace(request(count=1, kind=GPU), sequence=req_sequence)
    return framework.place(req, snap).ranked[0]


def test_baselines_are_registered() -> None:
    """Every baseline plugin is in the registry under its stable name."""
    assert "DataLocal" in FILTERS
    assert {"RoundRobin", "StaticWeights", "LeastLoaded", "RunTimeOnly"} <= set(SCORERS)


def test_round_robin_takes_turns_in_site_order() -> None:
    """Consecutive sequence numbers go to consecutive sites, wrapping around."""
    framework = Framework([CapacityFit()], [(RoundRobin(), 1.0)])
    snap = three_sites()
    assert [_first(framework, n, snap) for n in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_round_robin_skips_a_site_that_cannot_take_the_task() -> None:
    """A full site's turn passes to the next site in order, and ranks follow the cycle."""
    framework = Framework([CapacityFit()], [(RoundRobin(), 1.0)])
    snap = three_sites()
    req = dataclasses.replace(request(count=2, kind=GPU), sequence=0)  # a has 1 GPU free
    assert framework.place(req, snap).ranked == ("b", "c")


def test_static_weights_share_turns_by_declared_devices_not_load() -> None:
    """Over many tasks each site gets turns in proportion to its total devices, busy or not."""
    framework = Framework([CapacityFit()], [(StaticWeights(), 1.0)])
    snap = three_sites()
    turns = Counter(_first(framework, n, snap) for n in range(1400))
    assert turns["a"] == pytest.approx(200, abs=10)
    assert turns["b"] == pytest.approx(800, abs=10)
    assert turns["c"] == pytest.approx(400, abs=10)


def test_least_loaded_prefers_the_largest_free_share() -> None:
    """c (4 of 4 free) beats a (1 of 2) and b (2 of 8), whatever the absolute numbers."""
    scores = LeastLoaded().score(request(count=1, kind=GPU), three_sites(), np.arange(3))
    assert scores.tolist() == pytest.approx([50.0, 25.0, 100.0])


def _with_data(snap: Snapshot, holder: int, size: int) -> Snapshot:
    datasets = tuple({"d": size} if i == holder else {} for i in range(snap.n_sites))
    bandwidth = np.full((snap.n_sites, snap.n_sites), 100.0)  # 100 Mbit/s between sites
    np.fill_diagonal(bandwidth, np.inf)
    rtt = np.zeros((snap.n_sites, snap.n_sites))
    known = np.ones((snap.n_sites, snap.n_sites), dtype=bool)
    return dataclasses.replace(
        snap,
        datasets=datasets,
        bandwidth_mbps=bandwidth,
        rtt_ms=rtt,
        link_known=known,
        queue_wait_s=np.zeros(snap.n_sites),
        price_per_device_hour=np.zeros(snap.n_sites),
    )


def test_data_local_keeps_only_holders_and_passes_everything_without_inputs() -> None:
    """With an input only its holder passes; with none every site does."""
    snap = _with_data(three_sites(), holder=1, size=10**9)
    reads = dataclasses.replace(request(count=1, kind=GPU), inputs=(Input("d", 0),))
    assert DataLocal().filter(reads, snap).mask.tolist() == [False, True, False]
    explicit = dataclasses.replace(reads, inputs=(Input("e", 5, site="c"),))
    assert DataLocal().filter(explicit, snap).mask.tolist() == [False, False, True]
    assert DataLocal().filter(request(count=1, kind=GPU), snap).mask.all()


def test_run_time_only_ignores_the_transfer_that_completion_time_counts() -> None:
    """A fast site behind a thin link wins for the greedy scorer and loses for the default."""
    snap = snapshot(
        site("fast", node("f0", devices=_gpus(1, model="H100-80GB"))),
        site("near", node("n0", devices=_gpus(1, model="A100-80GB"))),
    )
    snap = _with_data(snap, holder=1, size=50 * 10**9)  # 4,000 s away from "fast"
    req = dataclasses.replace(
        request(count=1, kind=GPU), inputs=(Input("d", 0),), duration_s=1000.0
    )
    greedy = build_framework(scorers={"RunTimeOnly": 1.0})
    default = build_framework()
    assert greedy.place(req, snap).ranked[0] == "fast"
    assert default.place(req, snap).ranked[0] == "near"
    scores = RunTimeOnly().score(req, snap, np.arange(2))
    assert scores.tolist() == pytest.approx([100.0, 40.0])  # 400 s vs 1,000 s of run
