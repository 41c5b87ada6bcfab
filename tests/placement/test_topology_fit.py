"""The coordinator's CapacityFit honours a required topology level: a site fits only where
one value of the level (one rack) holds every replica, and the reason code says that is what
it lacks."""

from __future__ import annotations

import dataclasses

from federation.placement.framework import Code
from federation.placement.plugins.capacity_fit import CapacityFit

from .builders import GPU, device, node, request, site, snapshot


def racks(name: str, free_per_rack: dict[str, int]) -> list:  # type: ignore[type-arg]
    return [
        node(f"{name}-{rack}", devices=[device() for _ in range(free)], labels={"rack": rack})
        for rack, free in free_per_rack.items()
    ]


def test_a_site_fits_only_where_one_rack_holds_every_replica() -> None:
    snap = snapshot(
        site("split", *racks("split", {"r1": 2, "r2": 2})),  # 4 GPUs, 2 a rack
        site("whole", *racks("whole", {"r1": 4})),
    )
    four = dataclasses.replace(request(replicas=4, kind=GPU, count=1), topology_required="rack")
    verdict = CapacityFit().filter(four, snap)
    fits = {snap.site_ids[i]: bool(verdict.mask[i]) for i in range(snap.n_sites)}
    assert fits == {"split": False, "whole": True}
    split = snap.site_ids.index("split")
    assert verdict.codes is not None
    assert verdict.codes[split] == Code.TOPOLOGY_UNMET
    assert "room for 2 in its roomiest rack" in verdict.reasons[split]
    # Without the topology both fit.
    plain = CapacityFit().filter(request(replicas=4, kind=GPU, count=1), snap)
    assert plain.mask.all()


def test_nodes_without_the_level_hold_nothing_for_it() -> None:
    snap = snapshot(site("bare", node("n1", devices=[device() for _ in range(4)])))
    two = dataclasses.replace(request(replicas=2, kind=GPU, count=1), topology_required="rack")
    assert not CapacityFit().filter(two, snap).mask.any()
