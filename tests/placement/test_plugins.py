"""Table tests for each placement plugin, on hand-built snapshots."""

from __future__ import annotations

import numpy as np
import pytest

from federation.api.v1 import resources_pb2
from federation.placement.plugins.capacity_fit import CapacityFit
from federation.placement.plugins.constraints import Constraints
from federation.placement.plugins.free_capacity import FreeCapacity
from federation.placement.plugins.site_state import SiteState
from federation.placement.request import Request
from federation.placement.snapshot import SiteInput

from .builders import (
    CLOUD,
    DATACENTER,
    EDGE,
    GPU,
    NPU,
    device,
    node,
    request,
    site,
    snapshot,
)

# SiteState


@pytest.mark.parametrize(
    ("connected", "cordoned", "passes", "reason"),
    [
        (True, False, True, None),
        (False, False, False, "site agent is not connected"),
        (True, True, False, "site is cordoned"),
        (False, True, False, "site is cordoned"),
    ],
)
def test_site_state_admits_only_connected_uncordoned_sites(
    connected: bool, cordoned: bool, passes: bool, reason: str | None
) -> None:
    """Only a connected, uncordoned site passes, and a failing one says which flag failed."""
    snap = snapshot(
        site("a", node(), connected=connected, cordoned=cordoned),
        site("b", node()),
    )
    verdict = SiteState().filter(request(cpu=1), snap)
    assert verdict.mask.tolist() == [passes, True]
    assert verdict.reasons.get(0) == reason
    assert 1 not in verdict.reasons


# Constraints


def _constraint_sites() -> list[SiteInput]:
    return [
        site("dc-eu", node(), domain=DATACENTER, region="eu-west"),
        site("edge-eu", node(), domain=EDGE, region="eu-west"),
        site("edge-us", node(), domain=EDGE, region="us-east"),
        site("cloud-us", node(), domain=CLOUD, region="us-east"),
    ]


@pytest.mark.parametrize(
    ("constraints", "passing"),
    [
        ({}, {"dc-eu", "edge-eu", "edge-us", "cloud-us"}),
        ({"domains": [EDGE]}, {"edge-eu", "edge-us"}),
        ({"domains": [EDGE, CLOUD]}, {"edge-eu", "edge-us", "cloud-us"}),
        ({"regions": ["us-east"]}, {"edge-us", "cloud-us"}),
        ({"sites": ["dc-eu", "cloud-us"]}, {"dc-eu", "cloud-us"}),
        ({"domains": [EDGE], "regions": ["eu-west"]}, {"edge-eu"}),
        ({"domains": [EDGE], "sites": ["dc-eu"]}, set()),
    ],
)
def test_constraints_keep_only_matching_sites(
    constraints: dict[str, list[int] | list[str]], passing: set[str]
) -> None:
    """Domain, region and site constraints each narrow the sites, and they combine with AND."""
    snap = snapshot(*_constraint_sites())
    verdict = Constraints().filter(request(cpu=1, **constraints), snap)  # type: ignore[arg-type]
    assert {snap.site_ids[i] for i in np.flatnonzero(verdict.mask)} == passing
    assert set(verdict.reasons) == set(np.flatnonzero(~verdict.mask).tolist())


def test_constraints_reason_names_the_wanted_and_actual_domain() -> None:
    """A site outside the wanted domain is told which domain was wanted and what it is."""
    snap = snapshot(site("dc", node(), domain=DATACENTER))
    verdict = Constraints().filter(request(domains=[EDGE, CLOUD]), snap)
    assert not verdict.mask[0]
    assert "cloud, edge" in verdict.reasons[0]
    assert "site is datacenter" in verdict.reasons[0]


def test_constraints_report_the_first_rule_a_site_breaks() -> None:
    """A site breaking both the domain and the region rule is rejected for the domain."""
    snap = snapshot(site("dc", node(), domain=DATACENTER, region="eu-west"))
    verdict = Constraints().filter(request(domains=[EDGE], regions=["us-east"]), snap)
    assert "domain" in verdict.reasons[0]
    assert "region" not in verdict.reasons[0]


@pytest.mark.parametrize(
    ("constraints", "needle"),
    [({"regions": ["us-east", "ap-south"]}, "ap-south, us-east"), ({"sites": ["x"]}, "site x")],
)
def test_constraints_reason_names_the_wanted_region_or_site(
    constraints: dict[str, list[str]], needle: str
) -> None:
    """A region or site rejection lists the regions or sites the job asked for."""
    snap = snapshot(site("dc", node(), region="eu-west"))
    verdict = Constraints().filter(request(**constraints), snap)  # type: ignore[arg-type]
    assert needle in verdict.reasons[0]


# CapacityFit

H100 = device(GPU, model="H100", memory_mib=81920)
A100_40G = device(GPU, model="A100", memory_mib=40960)
MI300 = device(GPU, vendor="amd", model="MI300", memory_mib=196608)


@pytest.mark.parametrize(
    ("nodes", "req", "fits"),
    [
        pytest.param([node(cpu=4)], request(cpu=2, replicas=2), True, id="cpu-exact"),
        pytest.param([node(cpu=4)], request(cpu=2, replicas=3), False, id="cpu-short"),
        pytest.param(
            [node("a", cpu=2), node("b", cpu=2)], request(cpu=2, replicas=2), True, id="spread"
        ),
        pytest.param(
            [node("a", cpu=1.5), node("b", cpu=1.5)], request(cpu=2), False, id="cpu-split"
        ),
        pytest.param([node(memory_mib=4096)], request(memory_mib=4096), True, id="mem-exact"),
        pytest.param([node(memory_mib=4096)], request(memory_mib=4097), False, id="mem-short"),
        pytest.param(
            [node("a", memory_mib=3072), node("b", memory_mib=3072)],
            request(memory_mib=4096),
            False,
            id="mem-split",
        ),
        pytest.param([node(devices=[H100, H100])], request(kind=GPU, count=2), True, id="2gpu"),
        pytest.param(
            [node("a", devices=[H100]), node("b", devices=[H100])],
            request(kind=GPU, count=2),
            False,
            id="gpus-on-two-nodes",
        ),
        pytest.param(
            [node("a", devices=[H100]), node("b", devices=[H100])],
            request(kind=GPU, count=1, replicas=2),
            True,
            id="one-gpu-replica-per-node",
        ),
        pytest.param(
            [node(devices=[H100, H100, H100])],
            request(kind=GPU, count=2, replicas=2),
            False,
            id="3gpus-2x2",
        ),
        pytest.param(
            [node(devices=[H100, device(allocated=True)])],
            request(kind=GPU, count=2),
            False,
            id="allocated",
        ),
        pytest.param(
            [node(devices=[H100, device(health=resources_pb2.DEVICE_HEALTH_UNHEALTHY)])],
            request(kind=GPU, count=2),
            False,
            id="unhealthy",
        ),
        pytest.param(
            [node(devices=[H100, device(health=resources_pb2.DEVICE_HEALTH_DEGRADED)])],
            request(kind=GPU, count=2),
            False,
            id="degraded",
        ),
        pytest.param([node(devices=[device(NPU)])], request(kind=GPU, count=1), False, id="kind"),
        pytest.param([node(devices=[device(NPU)])], request(kind=NPU, count=1), True, id="npu"),
        pytest.param(
            [node(devices=[A100_40G])],
            request(kind=GPU, count=1, models=["H100"]),
            False,
            id="model-excluded",
        ),
        pytest.param(
            [node(devices=[A100_40G, H100])],
            request(kind=GPU, count=2, models=["H100", "A100"]),
            True,
            id="any-listed-model",
        ),
        pytest.param(
            [node(devices=[MI300])],
            request(kind=GPU, count=1, vendor="nvidia"),
            False,
            id="vendor-excluded",
        ),
        pytest.param(
            [node(devices=[MI300])], request(kind=GPU, count=1, vendor="amd"), True, id="vendor"
        ),
        pytest.param(
            [node(devices=[A100_40G])],
            request(kind=GPU, count=1, min_memory_mib=40961),
            False,
            id="min-memory-short",
        ),
        pytest.param(
            [node(devices=[A100_40G])],
            request(kind=GPU, count=1, min_memory_mib=40960),
            True,
            id="min-memory-exact",
        ),
        pytest.param(
            [node(cpu=1, devices=[H100, H100])],
            request(cpu=2, kind=GPU, count=1),
            False,
            id="gpus-but-no-cpu",
        ),
        pytest.param(
            [node("a", cpu=0, devices=[H100]), node("b", cpu=8)],
            request(cpu=1, kind=GPU, count=1),
            False,
            id="gpu-and-cpu-on-different-nodes",
        ),
        pytest.param([node(schedulable=False)], request(cpu=1), False, id="unschedulable"),
        pytest.param([], request(), False, id="no-nodes"),
        pytest.param([node(cpu=0, memory_mib=0)], request(replicas=5), True, id="no-demand"),
        pytest.param(
            [node(labels={"zone": "a"})],
            request(cpu=1, node_labels={"zone": "a"}),
            True,
            id="label-match",
        ),
        pytest.param(
            [node(labels={"zone": "a"})],
            request(cpu=1, node_labels={"zone": "b"}),
            False,
            id="label-value-differs",
        ),
        pytest.param(
            [node(labels={"zone": "a"})],
            request(cpu=1, node_labels={"zone": "a", "net": "ib"}),
            False,
            id="label-missing",
        ),
        pytest.param(
            [node("a", labels={"zone": "b"}), node("b", cpu=1, labels={"zone": "a"})],
            request(cpu=1, replicas=2, node_labels={"zone": "a"}),
            False,
            id="only-labelled-nodes-count",
        ),
    ],
)
def test_capacity_fit_table(nodes: list[resources_pb2.Node], req: Request, fits: bool) -> None:
    """A site passes exactly when its nodes can each hold whole replicas adding up to enough."""
    snap = snapshot(site("s", *nodes))
    verdict = CapacityFit().filter(req, snap)
    assert verdict.mask.tolist() == [fits]
    assert (0 in verdict.reasons) is not fits


def test_capacity_fit_judges_each_site_on_its_own_nodes() -> None:
    """Capacity on one site never counts towards another site."""
    snap = snapshot(
        site("a", node(devices=[H100])),
        site("b", node(devices=[H100, H100])),
        site("c", node(cpu=0, devices=[H100, H100])),
    )
    verdict = CapacityFit().filter(request(cpu=1, kind=GPU, count=2), snap)
    assert verdict.mask.tolist() == [False, True, False]


def test_capacity_fit_reason_describes_demand_and_room() -> None:
    """A rejected site's reason spells out the demand, the room found and matching devices."""
    snap = snapshot(site("s", node("a", devices=[H100]), node("b", devices=[H100])))
    req = request(cpu=1.5, memory_mib=2048, replicas=2, kind=GPU, count=2, models=["H100"])
    verdict = CapacityFit().filter(req, snap)
    reason = verdict.reasons[0]
    assert "2 replica(s) of 1.5 CPU, 2048 MiB, 2xGPU (H100)" in reason
    assert "room for 0" in reason
    assert "2 matching free device(s)" in reason


def test_capacity_fit_reason_counts_partial_room() -> None:
    """A site with room for some replicas but not all says how many fit."""
    snap = snapshot(site("s", node(cpu=3, memory_mib=1 << 20)))
    verdict = CapacityFit().filter(request(cpu=1, replicas=5), snap)
    assert "needs 5 replica(s) of 1 CPU" in verdict.reasons[0]
    assert "room for 3" in verdict.reasons[0]
    assert "device" not in verdict.reasons[0]


def test_capacity_fit_reason_mentions_min_memory() -> None:
    """The demand text includes the minimum device memory when the job set one."""
    snap = snapshot(site("s", node(devices=[A100_40G])))
    verdict = CapacityFit().filter(request(kind=GPU, count=1, min_memory_mib=81920), snap)
    assert ">= 81920 MiB" in verdict.reasons[0]
    assert "0 matching free device(s)" in verdict.reasons[0]


# FreeCapacity


def test_free_capacity_prefers_the_roomier_site() -> None:
    """Scores are proportional to how many replicas each site can still hold; best gets 100."""
    snap = snapshot(
        site("big", node(cpu=8)),
        site("small", node(cpu=2)),
        site("mid", node("a", cpu=2), node("b", cpu=2)),
    )
    feasible = np.arange(snap.n_sites, dtype=np.int64)
    scores = FreeCapacity().score(request(cpu=1), snap, feasible)
    by_site = dict(zip(snap.site_ids, scores.tolist(), strict=True))
    assert by_site == {"big": 100.0, "mid": 50.0, "small": 25.0}


def test_free_capacity_scores_only_the_feasible_sites() -> None:
    """The score array matches the feasible indices, normalised among them alone."""
    snap = snapshot(site("a", node(cpu=16)), site("b", node(cpu=4)), site("c", node(cpu=2)))
    scores = FreeCapacity().score(request(cpu=1), snap, np.array([1, 2], dtype=np.int64))
    assert scores.tolist() == [100.0, 50.0]


def test_free_capacity_counts_matching_devices_not_cpu() -> None:
    """For a GPU task, room is measured in matching free devices, not spare CPU."""
    snap = snapshot(
        site("cpu-rich", node(cpu=64, devices=[H100])),
        site("gpu-rich", node(cpu=4, devices=[H100] * 4)),
    )
    feasible = np.arange(2, dtype=np.int64)
    scores = FreeCapacity().score(request(cpu=1, kind=GPU, count=1), snap, feasible)
    assert scores.tolist() == [25.0, 100.0]


@pytest.mark.parametrize(
    "req",
    [request(), request(cpu=0.5), request(memory_mib=1), request(kind=GPU, count=1)],
    ids=["no-demand", "cpu", "memory", "gpu"],
)
def test_free_capacity_scores_stay_within_0_and_100(req: Request) -> None:
    """Whatever the demand, scores are finite and in [0, 100]."""
    snap = snapshot(
        site("a", node(cpu=4, memory_mib=8, devices=[H100])),
        site("b", node(cpu=1024, memory_mib=1 << 30)),
        site("c", node("x"), node("y", devices=[H100] * 8)),
    )
    scores = FreeCapacity().score(req, snap, np.arange(3, dtype=np.int64))
    assert scores.shape == (3,)
    assert np.all(np.isfinite(scores))
    assert np.all((scores >= 0) & (scores <= 100))
    assert scores.max() == 100.0


# Regressions of bugs found by these tests.


def test_capacity_fit_counts_fractional_cpu_exactly() -> None:
    """A node with 0.3 free CPU holds three 0.1-CPU replicas."""
    snap = snapshot(site("s", node(cpu=0.3)))
    assert CapacityFit().filter(request(cpu=0.1, replicas=3), snap).mask.tolist() == [True]


def test_capacity_fit_vendor_match_ignores_case() -> None:
    """A request for vendor 'NVIDIA' matches devices reported with vendor 'nvidia'."""
    snap = snapshot(site("s", node(devices=[H100])))
    assert CapacityFit().filter(request(kind=GPU, count=1, vendor="NVIDIA"), snap).mask[0]


def test_capacity_fit_rejects_a_site_with_nan_cpu_instead_of_raising() -> None:
    """One site reporting NaN free CPU is rejected; other sites are still judged."""
    snap = snapshot(site("bad", node(cpu=float("nan"))), site("good", node(cpu=4)))
    assert CapacityFit().filter(request(cpu=1), snap).mask.tolist() == [False, True]
