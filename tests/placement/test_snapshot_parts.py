"""A snapshot is put together from per-site parts: each site's rows must read as if the site
were alone, whatever other sites come before it."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings

from federation.api.v1 import resources_pb2
from federation.placement.snapshot import SiteInput, Snapshot, build_snapshot, site_part

from .strategies import PlacementCase, placement_cases

GPU = resources_pb2.DEVICE_KIND_GPU
NPU = resources_pb2.DEVICE_KIND_NPU


def rows_of(snap: Snapshot, site: int) -> dict[str, object]:
    """Site ``site``'s nodes, devices, pairs and partitions, in numbers local to the site
    and with classes and groups told apart by what they are, not by their numbers."""
    nodes = np.flatnonzero(snap.node_site == site)
    first_node = int(nodes[0]) if len(nodes) else 0
    devices = np.flatnonzero(np.isin(snap.device_node, nodes))
    first_device = int(devices[0]) if len(devices) else 0
    groups = snap.device_group[devices]
    pairs = np.flatnonzero(np.isin(snap.pair_node, nodes))
    partitions = np.flatnonzero(np.isin(snap.partition_device, devices))
    return {
        "nodes": [
            (snap.node_cpu_free[n], snap.node_memory_free_mib[n], snap.node_schedulable[n])
            for n in nodes
        ],
        "labels": [snap.node_labels[n] for n in nodes],
        "devices": [
            (
                int(snap.device_node[d]) - first_node,
                snap.device_kind[d],
                snap.device_model[d],
                snap.device_available[d],
                snap.classes[snap.device_class[d]],
                snap.device_shareable[d],
                snap.device_free_fraction[d],
            )
            for d in devices
        ],
        # Two devices share a group here exactly when they shared one alone.
        "groups": [list(groups == g) for g in groups],
        "pairs": sorted(
            (
                int(snap.pair_node[p]) - first_node,
                repr(snap.classes[snap.pair_class[p]]),
                snap.pair_free[p],
            )
            for p in pairs
        ),
        "partitions": [
            (
                int(snap.partition_device[p]) - first_device,
                snap.partition_profile[p],
                snap.partition_free[p],
            )
            for p in partitions
        ],
    }


def assert_sites_read_as_alone(sites: list[SiteInput]) -> None:
    together = build_snapshot(sites)
    for i, name in enumerate(together.site_ids):
        alone = build_snapshot([next(s for s in sites if s.view.site == name)])
        assert rows_of(together, i) == rows_of(alone, 0), name
    # Groups never join devices of different nodes.
    pairs = set(zip(together.device_group, together.device_node, strict=True))
    assert len({g for g, _ in pairs}) == len(pairs)


def device(model: str, kind: int = GPU, **fields: object) -> resources_pb2.Device:
    return resources_pb2.Device(kind=kind, vendor="v", model=model, **fields)  # type: ignore[arg-type]


def test_classes_groups_and_partitions_survive_being_put_together() -> None:
    """Site b meets its classes in the opposite order to a, and has partitions and
    interconnect groups: each still reads as if alone, and b's cached part is used as is."""
    mig = [resources_pb2.PartitionProfile(profile="1g.10gb", total=7, free=3)]
    a = resources_pb2.SiteView(
        site="a",
        nodes=[
            resources_pb2.Node(name="n", cpu_free=8, devices=[device("H100"), device("910B", NPU)])
        ],
    )
    b = resources_pb2.SiteView(
        site="b",
        nodes=[
            resources_pb2.Node(
                name="m",
                cpu_free=4,
                devices=[
                    device("910B", NPU, interconnect_group="hccs"),
                    device("910B", NPU, interconnect_group="hccs"),
                    device("H100", partitions=mig),
                ],
            ),
            resources_pb2.Node(name="o", cpu_free=2, devices=[device("H100", allocated=True)]),
        ],
    )
    sites = [SiteInput(b, True, False, site_part(b.nodes)), SiteInput(a, True, False)]
    assert_sites_read_as_alone(sites)
    snap = build_snapshot(sites)
    assert [c.model for c in snap.classes] == ["H100", "910B"]  # first seen at a, then b
    assert snap.partition_device.tolist() == [4]  # b's third device, after a's two


@settings(max_examples=50, deadline=None)
@given(placement_cases())
def test_every_site_reads_as_if_it_were_alone(case: PlacementCase) -> None:
    assert_sites_read_as_alone(case.sites)
