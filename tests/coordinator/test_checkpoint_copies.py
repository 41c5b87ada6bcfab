"""Which copy of an uploaded checkpoint a task placed again restores from: the one that gets
to its new site soonest over the links placement reads."""

from __future__ import annotations

from federation.api.v1 import jobs_pb2, resources_pb2
from federation.coordinator.data.staged_inputs import nearest_first
from federation.placement.snapshot import SiteInput, build_snapshot

GIB = 1 << 30


def site(name: str, **links_mbps: float) -> SiteInput:
    links = [
        resources_pb2.Link(peer_site=peer, bandwidth_mbps=mbps, rtt_ms=5)
        for peer, mbps in links_mbps.items()
    ]
    view = resources_pb2.SiteView(site=name, links=links)
    return SiteInput(view=view, is_connected=True, is_cordoned=False)


def copy_at(name: str) -> jobs_pb2.Artifact:
    return jobs_pb2.Artifact(site=name, key=f"k/{name}", bytes=GIB)


def test_the_copy_nearest_the_new_site_comes_first() -> None:
    # far-a reaches new-c at 10 Mbit/s, near-b at 1 Gbit/s.
    snap = build_snapshot(
        [site("far-a", **{"new-c": 10}), site("near-b", **{"new-c": 1000}), site("new-c")]
    )
    held = [copy_at("far-a"), copy_at("near-b")]
    assert [c.site for c in nearest_first(held, GIB, "new-c", snap)] == ["near-b", "far-a"]
    # The new site holding a copy itself needs no transfer at all.
    assert [c.site for c in nearest_first(held, GIB, "far-a", snap)] == ["far-a", "near-b"]
    # A holder the federation no longer knows is tried last; an unknown target keeps the order.
    gone = [copy_at("gone-x"), *held]
    assert [c.site for c in nearest_first(gone, GIB, "new-c", snap)][-1] == "gone-x"
    assert nearest_first(held, GIB, "nowhere", snap) == held
