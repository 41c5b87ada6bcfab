"""Image locality: a site that holds a task's image is charged no pull; the others are charged
the image's pull bytes over their measured link (``estimates._pull``). Sites that run no
images are filtered out with their own reason (``ImagePolicy``)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from federation.api.v1 import jobs_pb2, resources_pb2
from federation.placement.estimates import estimate, pull_seconds
from federation.placement.framework import Code
from federation.placement.plugins.image_policy import ImagePolicy
from federation.placement.registry import DEFAULT_FILTERS, build_framework
from federation.placement.request import Request
from federation.placement.snapshot import UNKNOWN_BANDWIDTH_MBPS, UNKNOWN_RTT_MS, SiteInput

from .builders import node, request, site, snapshot

IMAGE = "registry.example.org:5000/team/train:1"
DIGEST = "registry.example.org:5000/team/train@sha256:" + "ab" * 32
MIB = 1 << 20


def holding(
    name: str = "n0", *, pull_bytes: int = 40 * MIB, size_bytes: int = 0, schedulable: bool = True
) -> resources_pb2.Node:
    held = node(name, schedulable=schedulable)
    held.images.add(
        references=[IMAGE, DIGEST], id="c" * 64, pull_bytes=pull_bytes, size_bytes=size_bytes
    )
    return held


def with_view(entry: SiteInput, **fields: object) -> SiteInput:
    """``entry`` with its view's site-level fields set (``coordinator_link``, the policy)."""
    view = resources_pb2.SiteView()
    view.CopyFrom(entry.view)
    for key, value in fields.items():
        if isinstance(value, resources_pb2.Link):
            getattr(view, key).CopyFrom(value)
        elif isinstance(value, list):
            getattr(view, key).extend(value)
        else:
            setattr(view, key, value)
    return dataclasses.replace(entry, view=view)


def uplink(mbps: float, rtt_ms: float) -> resources_pb2.Link:
    return resources_pb2.Link(bandwidth_mbps=mbps, rtt_ms=rtt_ms, measured_at=1.0)


def image_request(image: str = IMAGE, **kwargs: object) -> Request:
    return dataclasses.replace(request(cpu=1, **kwargs), image=image)  # type: ignore[arg-type]


def test_the_holder_pays_no_pull_the_others_its_bytes_over_their_measured_link() -> None:
    snap = snapshot(
        with_view(site("far", node()), coordinator_link=uplink(80.0, 10.0)),
        with_view(site("holder", holding()), coordinator_link=uplink(80.0, 10.0)),
    )
    est = estimate(image_request(), snap)
    far, holder = snap.site_ids.index("far"), snap.site_ids.index("holder")
    expected = 40 * MIB * 8 / 80e6 + 0.010
    assert est.pull_s[far] == pytest.approx(expected)
    assert est.pull_bytes[far] == 40 * MIB
    assert est.image_held.tolist() == [False, True]
    assert (est.pull_s[holder], est.pull_bytes[holder]) == (0.0, 0.0)
    # The pull is part of the transfer, so of the total every scorer reads.
    assert est.transfer_s[far] == pytest.approx(expected)
    assert est.total_s[far] - est.total_s[holder] == pytest.approx(expected)
    assert not est.unknown_links.any()
    one = pull_seconds(40 * MIB, np.array([80.0]), np.array([10.0]))
    assert one.tolist() == [pytest.approx(expected)]  # the formula the bench checks


def test_the_default_profile_prefers_the_site_that_holds_the_image() -> None:
    """Alike but for the image, the first by name ("a-far") would win; the holder does."""
    snap = snapshot(site("a-far", node()), site("b-holder", holding()))
    decision = build_framework().place(image_request(), snap)
    assert decision.ranked == ("b-holder", "a-far")
    plain = build_framework().place(request(cpu=1), snap)
    assert plain.ranked == ("a-far", "b-holder")


def test_a_reference_by_digest_matches_the_same_image() -> None:
    snap = snapshot(site("far", node()), site("holder", holding()))
    est = estimate(image_request(DIGEST), snap)
    assert est.image_held.tolist() == [False, True]
    assert est.pull_bytes.tolist() == [40 * MIB, 0]


def test_an_unmeasured_link_is_assumed_and_marked_unknown() -> None:
    snap = snapshot(site("far", node()), site("holder", holding()))
    est = estimate(image_request(), snap)
    assumed = 40 * MIB * 8 / (UNKNOWN_BANDWIDTH_MBPS * 1e6) + UNKNOWN_RTT_MS / 1000
    assert est.pull_s[0] == pytest.approx(assumed)
    assert est.unknown_links.tolist() == [True, False]


def test_an_image_no_node_holds_has_no_known_size_and_costs_nothing_anywhere() -> None:
    snap = snapshot(site("a", node()), site("b", node()))
    est = estimate(image_request(), snap)
    assert est.pull_s.tolist() == [0.0, 0.0]
    assert est.image_held.tolist() == [False, False]
    assert not est.unknown_links.any()


def test_a_node_that_loaded_the_image_gives_its_unpacked_size() -> None:
    """No manifest (pull_bytes 0): the unpacked size, which a pull would not exceed."""
    snap = snapshot(site("far", node()), site("holder", holding(pull_bytes=0, size_bytes=MIB)))
    assert estimate(image_request(), snap).pull_bytes.tolist() == [MIB, 0]


def test_an_unschedulable_node_holds_nothing_for_placement() -> None:
    snap = snapshot(site("far", node()), site("drained", holding(schedulable=False)))
    est = estimate(image_request(), snap)
    assert est.image_held.tolist() == [False, False]


def test_a_task_without_an_image_pays_no_pull() -> None:
    snap = snapshot(site("far", node()), site("holder", holding()))
    est = estimate(request(cpu=1), snap)
    assert est.pull_s.tolist() == [0.0, 0.0]
    assert est.image_held.tolist() == [False, False]


def test_sites_that_refuse_images_are_filtered_with_their_own_reason() -> None:
    refusal = "this site does not run containers: [containers] enabled = false"
    snap = snapshot(
        with_view(site("off", node()), image_refusal=refusal),
        with_view(site("other-registry", node()), image_registries=["registry.internal"]),
        with_view(site("same-registry", node()), image_registries=["registry.example.org:5000"]),
        site("any", node()),
    )
    assert "ImagePolicy" in DEFAULT_FILTERS
    decision = build_framework().place(image_request(), snap)
    assert decision.ranked == ("any", "same-registry")
    rejected = {r.site: (r.plugin, r.code, r.reason) for r in decision.rejections}
    assert rejected == {
        "off": ("ImagePolicy", Code.IMAGE_REFUSED, f"{refusal} (image {IMAGE})"),
        "other-registry": (
            "ImagePolicy",
            Code.IMAGE_REFUSED,
            "the site pulls images from registry.internal only, not from registry.example.org:5000",
        ),
    }
    # A task that names no image goes anywhere.
    assert ImagePolicy().filter(request(cpu=1), snap).mask.all()


def test_the_request_carries_the_spec_image() -> None:
    req = request(cpu=1)
    assert req.image == ""
    task = jobs_pb2.TaskSpec(name="t", command=["x"], image=IMAGE)
    assert Request.from_spec(jobs_pb2.JobSpec(tasks=[task]), task).image == IMAGE
