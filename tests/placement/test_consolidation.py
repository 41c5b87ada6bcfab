"""Consolidation: busy sites win ties on completion time, and only ties (within the slack)."""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt
import pytest

from federation.placement.plugins.energy import Consolidation
from federation.placement.registry import DEFAULT_FILTERS, DEFAULT_SCORERS, build_framework
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot

from .builders import GPU, device, node, request, site, snapshot

ONE_GPU = dataclasses.replace(request(cpu=1, kind=GPU, count=1), duration_s=1000.0)
# The default profile plus Consolidation, as the simulator's ``energy`` policy has it.
WITH_CONSOLIDATION = {**DEFAULT_SCORERS, "Consolidation": 0.3}


def two_sites(busy_model: str, idle_model: str) -> Snapshot:
    """``busy``: one node of 2 GPUs, one of them in use; ``idle``: one node of 2 free GPUs."""
    return snapshot(
        site(
            "busy",
            node(devices=[device(model=busy_model, allocated=True), device(model=busy_model)]),
        ),
        site("idle", node(devices=[device(model=idle_model), device(model=idle_model)])),
    )


def snap_indices(snap: Snapshot) -> npt.NDArray[np.int64]:
    """Every site, as the feasible indices a scorer is given."""
    return np.arange(snap.n_sites, dtype=np.int64)


def ranked(scorers: dict[str, float], snap: Snapshot, req: Request = ONE_GPU) -> tuple[str, ...]:
    return build_framework(DEFAULT_FILTERS, scorers).place(req, snap).ranked


def test_busier_site_wins_when_completion_estimates_tie() -> None:
    """Same devices, same estimate: the default spreads to the roomier idle site, and
    Consolidation sends the task to the node already in use."""
    snap = two_sites("A100-80GB", "A100-80GB")
    assert ranked(dict(DEFAULT_SCORERS), snap) == ("idle", "busy")
    assert ranked(WITH_CONSOLIDATION, snap) == ("busy", "idle")
    # busy: all of the task fits on a node in use (0.9 x 1) and half its devices are in use.
    scores = Consolidation().score(ONE_GPU, snap, snap_indices(snap))
    assert scores.tolist() == pytest.approx([100 * (0.9 + 0.1 * 0.5), 0.0])


def test_busier_site_loses_when_it_is_much_slower() -> None:
    """The busy site's V100s (speed 0.38) finish far later than the idle A100s (1.0): outside
    the slack, Consolidation gives it nothing and completion time decides."""
    snap = two_sites("V100", "A100-80GB")
    assert Consolidation().score(ONE_GPU, snap, snap_indices(snap)).tolist() == [0.0, 0.0]
    assert ranked(WITH_CONSOLIDATION, snap) == ("idle", "busy")


def test_slack_decides_how_much_later_a_busy_site_may_finish() -> None:
    """A100-40GB (0.95) is 5.3 % slower than A100-80GB: inside a 10 % slack, outside 5 %."""
    snap = two_sites("A100-40GB", "A100-80GB")
    feasible = snap_indices(snap)
    assert Consolidation(slack=0.10).score(ONE_GPU, snap, feasible)[0] > 90
    assert Consolidation(slack=0.05).score(ONE_GPU, snap, feasible)[0] == 0.0
    assert ranked(WITH_CONSOLIDATION, snap) == ("idle", "busy")


def test_gang_counts_only_replicas_that_fit_on_nodes_in_use() -> None:
    """Two replicas of 2 GPUs: one fits on the node in use, the other needs a cold node."""
    snap = snapshot(
        site(
            "a",
            node("warm", devices=[device(allocated=True)] + [device()] * 2),
            node("cold", devices=[device()] * 2),
        ),
    )
    req = dataclasses.replace(request(cpu=1, kind=GPU, count=2, replicas=2), duration_s=60.0)
    score = Consolidation().score(req, snap, snap_indices(snap))
    assert score.tolist() == pytest.approx([100 * (0.9 * 0.5 + 0.1 * 1 / 5)])


def test_no_feasible_site_and_a_negative_slack() -> None:
    """No feasible site gives no scores; a negative slack is refused."""
    snap = two_sites("A100-80GB", "A100-80GB")
    assert Consolidation().score(ONE_GPU, snap, snap_indices(snap)[:0]).shape == (0,)
    with pytest.raises(ValueError, match="slack"):
        Consolidation(slack=-0.1)
