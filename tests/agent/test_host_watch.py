"""Rediscovery merged into the node the core holds: positions kept, health and readings new."""

from __future__ import annotations

from collections.abc import Callable

from federation.agent.embedded_core import EmbeddedCore
from federation.agent.host_watch import (
    FAST,
    GONE,
    PACES,
    Pace,
    merge_rediscovered,
    readings_pace,
    worth_publishing,
)
from federation.api.v1 import resources_pb2

from .cores import Recorder, node, offer

HEALTHY = resources_pb2.DEVICE_HEALTH_HEALTHY
UNHEALTHY = resources_pb2.DEVICE_HEALTH_UNHEALTHY


def box(*ids: str) -> resources_pb2.Node:
    found = node("host", devices=len(ids))
    for device, device_id in zip(found.devices, ids, strict=True):
        device.id = device_id
    return found


def test_a_device_gone_stays_in_place_unhealthy_and_a_new_one_goes_last() -> None:
    current, found = box("a", "b", "c"), box("a", "c", "d")
    found.devices[1].health = UNHEALTHY
    found.devices[1].health_reason = "Xid 79"
    changes = merge_rediscovered(current, found)
    assert [d.id for d in current.devices] == ["a", "b", "c", "d"]
    assert [(d.health, d.health_reason) for d in current.devices] == [
        (HEALTHY, ""),
        (UNHEALTHY, GONE),
        (UNHEALTHY, "Xid 79"),
        (HEALTHY, ""),
    ]
    assert changes == [
        "device b is gone",
        "device c is unhealthy (Xid 79)",
        "device d (H100) is new",
    ]
    # The same discovery again changes nothing; the device coming back is healthy again.
    assert merge_rediscovered(current, found) == []
    assert merge_rediscovered(current, box("a", "b", "c", "d")) == [
        "device b is healthy",
        "device c is healthy",
    ]


def test_readings_are_sent_when_they_move_enough() -> None:
    before, after = box("a"), box("a")
    before.devices[0].measured.compute = after.devices[0].measured.compute = 0.50
    assert not worth_publishing(before, after)
    after.devices[0].measured.compute = 0.53
    assert not worth_publishing(before, after)
    after.devices[0].measured.compute = 0.56
    assert worth_publishing(before, after)
    after.devices[0].measured.compute = 0.50
    after.measured.memory_used_mib = int(0.03 * after.memory_mib)
    assert worth_publishing(before, after)


async def test_an_unhealthy_device_gets_no_new_work(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    core = make_core([box("a", "b")])
    changed = recorder.changes
    found = box("a", "b")
    found.devices[0].health = UNHEALTHY
    core.refresh(found)
    assert recorder.changes == changed + 1
    answer = await core.offer(offer("one", devices=1))
    assert answer.accepted
    assert [d.allocated for d in core.nodes()[0].devices] == [False, True]
    assert not (await core.offer(offer("two", devices=1))).accepted


def test_a_thinner_link_to_the_coordinator_gets_fewer_coarser_readings() -> None:
    def link(mbps: float) -> resources_pb2.Link:
        return resources_pb2.Link(bandwidth_mbps=mbps, rtt_ms=20, measured_at=1.0)

    assert readings_pace(None) == FAST
    assert readings_pace(resources_pb2.Link(bandwidth_mbps=1)) == FAST  # never measured
    paces = [readings_pace(link(mbps)) for mbps in (1000, 50, 2)]
    assert paces == [pace for _, pace in PACES]
    intervals = [p.min_interval_s for p in paces]
    steps = [p.compute_step for p in paces]
    assert intervals == sorted(intervals)
    assert steps == sorted(steps)
    before, after = box("a"), box("a")
    after.devices[0].measured.compute = 0.12
    assert worth_publishing(before, after, paces[0])
    assert not worth_publishing(before, after, paces[2])


async def test_readings_go_at_the_pace_of_the_link(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """Small moves wait until they add up to a step; within the interval nothing is sent;
    health is sent at once whatever the pace."""
    core = make_core([box("a")])
    slow = Pace(min_interval_s=1.0, compute_step=0.2, memory_step=0.5)
    start = recorder.changes

    def readings(compute: float) -> resources_pb2.Node:
        found = box("a")
        found.devices[0].measured.compute = compute
        found.devices[0].measured.measured_at = 1.0
        return found

    core.refresh(readings(0.1), slow)
    core.refresh(readings(0.15), slow)
    assert recorder.changes == start  # 0.1 and 0.15 are within a step of 0.0
    core.refresh(readings(0.25), slow)  # a step from what was last published: sent
    assert recorder.changes == start + 1
    core.refresh(readings(0.9), slow)  # a step, but within the interval
    assert recorder.changes == start + 1
    unhealthy = readings(0.9)
    unhealthy.devices[0].health = UNHEALTHY
    core.refresh(unhealthy, slow)  # health goes at once
    assert recorder.changes == start + 2
    core.refresh(readings(0.9), slow)  # healthy again: at once too, though within the interval
    assert recorder.changes == start + 3
