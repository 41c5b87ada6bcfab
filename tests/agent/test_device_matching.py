"""Which devices a request accepts on the embedded core: CEL selectors and interconnect groups."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from federation.agent.embedded_core import EmbeddedCore
from federation.api.v1 import resources_pb2

from .cores import allocated, node, offer

CUDA_12 = 'device.attributes["cuda"] >= "12"'


def two_cuda_versions() -> resources_pb2.Node:
    """A node whose GPU 0 has CUDA 11.8 and GPU 1 CUDA 12.4."""
    box = node("n", devices=2, shareable=True)
    box.devices[0].attributes["cuda"] = "11.8"
    box.devices[1].attributes["cuda"] = "12.4"
    return box


async def test_selector_picks_the_device_whose_attributes_match(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """A CUDA >= 12 selector takes GPU 1, then finds nothing more, and says so."""
    core = make_core([two_cuda_versions()])
    assert (await core.offer(offer("job-1", devices=1, selector=CUDA_12))).accepted
    assert allocated(core) == {"n": [1]}
    answer = await core.offer(offer("job-2", devices=1, selector=CUDA_12))
    assert not answer.accepted
    assert (
        answer.reason == f"needs 1 GPU (matching {CUDA_12!r}) per replica; best node n has 0 free"
    )


@pytest.mark.parametrize(
    ("selector", "accepted"),
    [
        ('device.attributes["cuda"] == "12.4"', True),
        ('device.attributes["cuda"] >= "13"', False),
        ('device.attributes["rocm"] == "6.1"', False),  # an attribute no device has
        ('device.vendor == "nvidia" && device.memory_gib >= 80.0', True),
        ("device.memory_gib > 80.0", False),
        ('device.kind == "GPU" && !device.declared', True),
    ],
)
async def test_selector_sees_the_coordinators_attributes(
    make_core: Callable[..., EmbeddedCore], selector: str, accepted: bool
) -> None:
    """Selectors read kind, vendor, memory_gib, declared and the attributes map."""
    core = make_core([two_cuda_versions()])
    assert (await core.offer(offer(devices=1, selector=selector))).accepted is accepted


async def test_selector_applies_to_shares(make_core: Callable[..., EmbeddedCore]) -> None:
    """A share with a selector goes to the matching shareable device, not the fullest one."""
    core = make_core([two_cuda_versions()])
    assert (await core.offer(offer("job-1", fraction=0.5, selector=CUDA_12))).accepted
    assert (await core.offer(offer("job-2", fraction=0.25, selector=CUDA_12))).accepted
    (view,) = core.nodes()
    assert [d.free_fraction for d in view.devices] == [1.0, 0.25]


def grouped(groups: list[str], unhealthy: tuple[int, ...] = ()) -> resources_pb2.Node:
    """A node with one GPU per entry of ``groups`` (its interconnect group)."""
    box = node("n", devices=len(groups))
    for device, group in zip(box.devices, groups, strict=True):
        device.interconnect_group = group
        if device.index in unhealthy:
            device.health = resources_pb2.DEVICE_HEALTH_UNHEALTHY
    return box


async def test_same_interconnect_declines_when_no_group_has_enough(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """Two free GPUs in two groups hold a 2-GPU replica, but not one that asks for one group."""
    core = make_core([grouped(["nvl-0", "nvl-0", "nvl-1", "nvl-1"], unhealthy=(1, 2))])
    answer = await core.offer(offer("job-1", devices=2, same_interconnect=True))
    assert not answer.accepted
    assert answer.reason == (
        "needs 2 GPU (in one interconnect group) per replica; best node n has at most 1 free in "
        "one group"
    )
    assert (await core.offer(offer("job-2", devices=2))).accepted
    assert allocated(core) == {"n": [0, 3]}


async def test_same_interconnect_fills_groups_one_replica_each(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """Each 2-GPU replica takes a whole group, and once none is left a third is declined."""
    core = make_core([grouped(["nvl-a", "nvl-b", "nvl-a", "nvl-b"])])
    assert (await core.offer(offer("job-1", devices=2, same_interconnect=True))).accepted
    assert allocated(core) == {"n": [0, 2]}
    assert (await core.offer(offer("job-2", devices=2, same_interconnect=True))).accepted
    assert allocated(core) == {"n": [0, 1, 2, 3]}
    assert not (await core.offer(offer("job-3", devices=1, same_interconnect=True))).accepted


async def test_devices_without_a_group_are_each_their_own(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """Each ungrouped GPU is its own group: 2 GPUs in one group never fit there, 1 GPU does."""
    core = make_core([node("n", devices=2)])
    assert not (await core.offer(offer("job-1", devices=2, same_interconnect=True))).accepted
    assert (await core.offer(offer("job-2", devices=1, same_interconnect=True))).accepted
