"""Rediscovery merged into the node the core holds: positions kept, health and readings new."""

from __future__ import annotations

from collections.abc import Callable

from federation.agent.embedded_core import EmbeddedCore
from federation.agent.host_watch import GONE, merge_rediscovered, worth_publishing
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
