"""NearRegion: a service that asks to be near a region goes to the site with the shortest
measured RTT to it, whatever else the profile prefers; RTTs within one step tie and the rest of
the profile decides; a site with no measured link to the region comes after measured ones."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from federation.api.v1 import jobs_pb2
from federation.placement.framework import Framework
from federation.placement.plugins.near_region import NearRegion, describe, rtt_to_region
from federation.placement.registry import build_framework
from federation.placement.request import Request
from federation.placement.snapshot import SiteInput, Snapshot

from .builders import GPU, device, node, request, site, snapshot


def linked(s: SiteInput, rtt_ms: Mapping[str, float]) -> SiteInput:
    """``s`` with a link to each peer of ``rtt_ms``, as its agent would publish it."""
    for peer, rtt in rtt_ms.items():
        s.view.links.add(peer_site=peer, bandwidth_mbps=1000.0, rtt_ms=rtt)
    return s


def gpu_site(name: str, gpus: int, region: str, rtt_ms: Mapping[str, float]) -> SiteInput:
    return linked(site(name, node(devices=[device(GPU)] * gpus), region=region), rtt_ms)


def fleet() -> Snapshot:
    """``paris`` (eu-west) has no GPU; ``frankfurt`` 1 GPU 12 ms from it, ``virginia`` 4 GPUs
    90 ms from it, ``tokyo`` 8 GPUs and no link to it."""
    return snapshot(
        site("paris", node(), region="eu-west"),
        gpu_site("frankfurt", 1, "eu-central", {"paris": 12.0}),
        gpu_site("virginia", 4, "us-east", {"paris": 90.0}),
        gpu_site("tokyo", 8, "ap-northeast", {}),
    )


def gpu_service(near_region: str = "") -> Request:
    return dataclasses.replace(request(kind=GPU, count=1), near_region=near_region)


def test_the_request_reads_near_region_from_the_service_policy() -> None:
    task = jobs_pb2.TaskSpec(
        name="api",
        kind=jobs_pb2.TASK_KIND_SERVICE,
        service=jobs_pb2.ServicePolicy(near_region="eu-west"),
    )
    assert Request.from_spec(jobs_pb2.JobSpec(tasks=[task]), task).near_region == "eu-west"


def test_a_service_near_a_region_goes_to_the_nearest_site_not_the_roomiest() -> None:
    """Without near_region the roomiest site wins (FreeCapacity); with it, the site nearest
    eu-west, then the farther one, then the one with no measured link."""
    framework = build_framework()
    assert framework.place(gpu_service(), fleet()).ranked == ("tokyo", "virginia", "frankfurt")
    decision = framework.place(gpu_service("eu-west"), fleet())
    assert decision.ranked == ("frankfurt", "virginia", "tokyo")
    near = dict(zip(decision.ranked, decision.terms["NearRegion"], strict=True))
    # 100 x 100 / (100 + RTT in 5 ms steps); unmeasured 0.
    assert near == {"frankfurt": 100 * 100 / 110, "virginia": 100 * 100 / 190, "tokyo": 0.0}


def test_rtts_within_one_step_tie_and_the_profile_decides() -> None:
    """11 and 14 ms share the 10 ms step, so the roomier of the two goes first; 9.9 ms is a
    step nearer and beats both."""
    snap = snapshot(
        site("paris", node(), region="eu-west"),
        gpu_site("a", 1, "eu-central", {"paris": 11.0}),
        gpu_site("b", 4, "eu-central", {"paris": 14.0}),
        gpu_site("c", 1, "eu-central", {"paris": 9.9}),
    )
    assert build_framework().place(gpu_service("eu-west"), snap).ranked == ("c", "b", "a")


def test_a_site_in_the_region_is_at_0_ms_and_a_link_measured_one_way_counts() -> None:
    """``lyon`` is in eu-west; only ``paris`` published its link to ``frankfurt`` (8 ms),
    which stands for frankfurt's way too; frankfurt is nearer ``paris`` than ``marseille``."""
    snap = snapshot(
        linked(site("paris", node(), region="eu-west"), {"frankfurt": 8.0}),
        linked(site("marseille", node(), region="eu-west"), {"frankfurt": 20.0}),
        site("lyon", node(), region="eu-west"),
        site("frankfurt", node(), region="eu-central"),
    )
    rtt, via = rtt_to_region(snap, "eu-west")
    by_site = {name: (float(rtt[i]), snap.site_ids[via[i]]) for i, name in enumerate(snap.site_ids)}
    assert by_site["frankfurt"] == (8.0, "paris")
    assert by_site["lyon"] == (0.0, "lyon")
    decision = build_framework().place(
        dataclasses.replace(request(cpu=1), near_region="eu-west"), snap
    )
    assert decision.ranked[-1] == "frankfurt"


def test_no_site_in_the_region_changes_nothing_and_explain_says_so() -> None:
    """A region no site is in (yet) is no error: every site scores alike."""
    framework = build_framework()
    decision = framework.place(gpu_service("mars-1"), fleet())
    assert decision.ranked == framework.place(gpu_service(), fleet()).ranked
    assert set(decision.terms["NearRegion"]) == {100.0}
    assert describe(gpu_service("mars-1"), fleet(), decision.ranked) == (
        "no site in region mars-1: near_region weighs nothing until one joins"
    )


def test_explain_names_the_rtt_each_site_was_ranked_by() -> None:
    req = gpu_service("eu-west")
    snap = fleet()
    ranked = build_framework().place(req, snap).ranked
    assert describe(req, snap, (*ranked, "paris")) == (
        "near region eu-west, RTT first (a tie within 5 ms steps): "
        "frankfurt 12.0 ms (to paris), virginia 90.0 ms (to paris), "
        "tokyo unmeasured (ranked after measured sites), paris 0 ms (in eu-west)"
    )


class Roomy:
    """Scores ``b`` 100 and the others 0: the trade-off NearRegion must win over."""

    name: ClassVar[str] = "Roomy"

    def score(
        self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float64]:
        return np.array([100.0 if snap.site_ids[i] == "b" else 0.0 for i in feasible])


def test_a_scorer_that_ranks_first_outranks_any_weight_of_the_others() -> None:
    """NearRegion at weight 0.01 still orders the sites before Roomy at weight 100 (paris,
    in the region, first); at 0 it is off."""
    snap = snapshot(
        site("paris", region="eu-west"),
        linked(site("a", node(), region="x"), {"paris": 10.0}),
        linked(site("b", node(), region="x"), {"paris": 50.0}),
    )
    req = dataclasses.replace(request(cpu=1), near_region="eu-west")
    ranks_first = Framework([], [(Roomy(), 100.0), (NearRegion(), 0.01)]).place(req, snap)
    assert ranks_first.ranked == ("paris", "a", "b")
    off = Framework([], [(Roomy(), 100.0), (NearRegion(), 0.0)]).place(req, snap)
    assert off.ranked[0] == "b"
