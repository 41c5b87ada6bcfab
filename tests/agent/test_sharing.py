"""The embedded core hands out shares of shareable devices and partition slots, never both."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from federation.agent.device_env import mps_thread_percentage
from federation.agent.embedded_core import EmbeddedCore
from federation.api.v1 import resources_pb2

from .cores import DUMP_ENV, NPU, SUCCEEDED, Recorder, node, offer, run

MIG = {"1g.10gb": 7, "3g.40gb": 2}


def fractions(core: EmbeddedCore) -> list[float]:
    """free_fraction of every device of the core's only node."""
    (view,) = core.nodes()
    return [round(d.free_fraction, 9) for d in view.devices]


def slots(core: EmbeddedCore) -> list[dict[str, int]]:
    """Free slots per profile of every device of the core's only node."""
    (view,) = core.nodes()
    return [{p.profile: p.free for p in d.partitions} for d in view.devices]


def held_whole(core: EmbeddedCore) -> list[bool]:
    """``allocated`` of every device of the core's only node."""
    (view,) = core.nodes()
    return [d.allocated for d in view.devices]


async def test_two_halves_share_one_device_and_a_third_is_declined(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """Two 0.5 shares land on the one shareable GPU, still unallocated; a third is declined."""
    core = make_core([node("n", devices=1, shareable=True)])
    assert fractions(core) == [1.0]
    assert (await core.offer(offer("job-1", fraction=0.5))).accepted
    assert fractions(core) == [0.5]
    assert (await core.offer(offer("job-2", fraction=0.5))).accepted
    assert fractions(core) == [0.0]
    assert held_whole(core) == [False]
    third = await core.offer(offer("job-3", fraction=0.5))
    assert not third.accepted
    assert third.reason == (
        "needs 0.5 of a shareable GPU per replica; best node n has at most 0 free on one "
        "shareable device"
    )


async def test_shares_go_to_the_fullest_device_that_fits(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """Each share takes the device with the least free share that still holds it (best fit)."""
    core = make_core([node("n", devices=2, shareable=True)])
    for job, fraction, expected in [
        ("job-1", 0.25, [0.75, 1.0]),
        ("job-2", 0.5, [0.25, 1.0]),
        ("job-3", 0.5, [0.25, 0.5]),
        ("job-4", 0.25, [0.0, 0.5]),
    ]:
        assert (await core.offer(offer(job, fraction=fraction))).accepted
        assert fractions(core) == expected, job


async def test_a_gang_of_shares_fits_on_one_device(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """Four replicas of 0.2 share one device, and a fifth 0.2 still fits despite float error."""
    core = make_core([node("n", devices=1, shareable=True)])
    assert (await core.offer(offer(replicas=4, fraction=0.2))).accepted
    assert fractions(core) == [0.2]
    assert (await core.offer(offer("job-2", fraction=0.2))).accepted
    assert fractions(core) == [0.0]


async def test_a_device_that_is_not_shareable_takes_no_share(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """A share of a device not declared shareable is declined, naming why."""
    core = make_core([node("n", devices=2)])
    answer = await core.offer(offer(fraction=0.25))
    assert not answer.accepted
    assert answer.reason == (
        "needs 0.25 of a shareable GPU per replica; best node n has no matching shareable device"
    )


async def test_shares_and_whole_devices_exclude_each_other(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """A shared device cannot be given whole, and a device given whole takes no share."""
    core = make_core([node("n", devices=1, shareable=True)])
    share = await core.offer(offer("job-1", fraction=0.25))
    assert share.accepted
    whole = await core.offer(offer("job-2", devices=1))
    assert not whole.accepted
    assert whole.reason == "needs 1 GPU per replica; best node n has 0 free"
    await core.release(share.reservation_id)
    assert (await core.offer(offer("job-2", devices=1))).accepted
    assert (held_whole(core), fractions(core)) == ([True], [0.0])
    refused = await core.offer(offer("job-3", fraction=0.25))
    assert not refused.accepted
    assert refused.reason.endswith("has at most 0 free on one shareable device")


async def test_partition_slots_count_down_and_come_back(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """Each slot takes 1/total of its device; released slots are free again."""
    core = make_core([node("n", devices=1, partitions=MIG)])
    assert slots(core) == [{"1g.10gb": 7, "3g.40gb": 2}]
    small = await core.offer(offer("job-1", partition="1g.10gb"))
    assert small.accepted
    assert slots(core) == [{"1g.10gb": 6, "3g.40gb": 1}]
    large = await core.offer(offer("job-2", partition="3g.40gb"))
    assert large.accepted
    assert slots(core) == [{"1g.10gb": 2, "3g.40gb": 0}]
    refused = await core.offer(offer("job-3", partition="3g.40gb"))
    assert not refused.accepted
    assert refused.reason == "needs a GPU partition 3g.40gb per replica; best node n has 0 free"
    assert held_whole(core) == [False]
    await core.release(small.reservation_id)
    await core.release(large.reservation_id)
    assert slots(core) == [{"1g.10gb": 7, "3g.40gb": 2}]


async def test_partitions_exclude_shares_and_whole_use(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    """A device with a slot in use takes no share and is not given whole; a shared one no slot."""
    core = make_core([node("n", devices=1, shareable=True, partitions=MIG)])
    cut = await core.offer(offer("job-1", partition="1g.10gb"))
    assert cut.accepted
    assert fractions(core) == [0.0]
    assert not (await core.offer(offer("job-2", fraction=0.1))).accepted
    assert not (await core.offer(offer("job-2", devices=1))).accepted
    await core.release(cut.reservation_id)
    assert (await core.offer(offer("job-2", fraction=0.1))).accepted
    assert slots(core) == [{"1g.10gb": 0, "3g.40gb": 0}]
    refused = await core.offer(offer("job-3", partition="1g.10gb"))
    assert not refused.accepted
    assert refused.reason.endswith("best node n has 0 free")


async def test_slots_go_to_a_device_already_cut(make_core: Callable[..., EmbeddedCore]) -> None:
    """A slot goes to a device that already has slots in use, even one with more slots left."""
    box = node("n", devices=2, shareable=True, partitions={"1g.10gb": 7})
    box.devices[0].partitions[0].total = 2  # a tighter fit than device 1, were it untouched
    core = make_core([box])
    share = await core.offer(offer("job-1", fraction=0.5))  # keeps device 0 from being cut
    assert (await core.offer(offer("job-2", partition="1g.10gb"))).accepted
    await core.release(share.reservation_id)
    assert (await core.offer(offer("job-3", partition="1g.10gb"))).accepted
    assert slots(core) == [{"1g.10gb": 2}, {"1g.10gb": 5}]


async def test_an_unknown_profile_is_declined(make_core: Callable[..., EmbeddedCore]) -> None:
    """A profile no device offers is declined, naming why."""
    core = make_core([node("n", devices=1, partitions=MIG)])
    answer = await core.offer(offer(partition="2g.20gb"))
    assert answer.reason == (
        "needs a GPU partition 2g.20gb per replica; best node n has no matching device with that "
        "profile"
    )


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        ({"fraction": 1.5}, "invalid fraction 1.5: must be in (0, 1]"),
        ({"fraction": -0.5}, "invalid fraction -0.5: must be in (0, 1]"),
        (
            {"fraction": 0.5, "devices": 1},
            "asks for more than one of count, fraction and partition",
        ),
        ({"fraction": 0.5, "partition": "1g.10gb"}, "asks for more than one of count, fraction "),
        ({"devices": 1, "selector": "device.kind =="}, "invalid selector: expected a value"),
    ],
)
async def test_malformed_requests_are_declined(
    make_core: Callable[..., EmbeddedCore], request_: dict[str, object], reason: str
) -> None:
    """A request the coordinator should have refused is declined here too, saying why."""
    core = make_core([node("n", devices=1, shareable=True, partitions=MIG)])
    answer = await core.offer(offer(**request_))  # type: ignore[arg-type]
    assert not answer.accepted
    assert answer.reason.startswith(reason)
    assert core.queue().pending_tasks == 0


@pytest.mark.parametrize(
    ("kind", "vendor", "visible", "mps"),
    [
        (resources_pb2.DEVICE_KIND_GPU, "nvidia", "CUDA_VISIBLE_DEVICES", "25"),
        (NPU, "huawei", "ASCEND_RT_VISIBLE_DEVICES", "100"),  # the task's own value, left alone
    ],
)
async def test_child_sees_its_share(
    make_core: Callable[..., EmbeddedCore],
    recorder: Recorder,
    tmp_path: Path,
    kind: resources_pb2.DeviceKind.ValueType,
    vendor: str,
    visible: str,
    mps: str,
) -> None:
    """A share's replica sees its device, the fraction and (NVIDIA only) the MPS thread limit."""
    box = node("n", devices=2, kind=kind, vendor=vendor, shareable=True)
    box.devices[0].shareable = False
    core = make_core([box])
    wider = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100", "FEDERATION_PARTITION": "7g.80gb"}
    await run(core, offer(kind=kind, fraction=0.25, code=DUMP_ENV, env=wider))
    report = await recorder.final()
    assert report.state == SUCCEEDED, report.reason
    label = f"n:{'GPU' if vendor == 'nvidia' else 'NPU'}:1"
    assert list(report.devices) == [label]
    env = json.loads((tmp_path / "work/job-1/train/1/0/env.json").read_text())
    assert env[visible] == "1"
    assert env["FEDERATION_DEVICES"] == label
    assert env["FEDERATION_DEVICE_FRACTION"] == "0.25"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == mps
    assert "FEDERATION_PARTITION" not in env
    assert fractions(core) == [1.0, 1.0]  # the share came back when the task ended


async def test_a_memory_share_gets_its_memory_limit(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, tmp_path: Path
) -> None:
    """A share that asks for device memory is told it, with the MPS memory limit, and the
    device publishes that memory booked while it runs."""
    core = make_core([node("n", devices=1, shareable=True)])
    code = DUMP_ENV + "; import time; time.sleep(1)"
    await run(core, offer(fraction=0.25, share_memory_mib=20480, code=code))
    assert core.nodes()[0].devices[0].memory_free_mib == 81920 - 20480
    report = await recorder.final()
    assert report.state == SUCCEEDED, report.reason
    env = json.loads((tmp_path / "work/job-1/train/1/0/env.json").read_text())
    assert env["FEDERATION_DEVICE_MEMORY_MIB"] == "20480"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert core.nodes()[0].devices[0].memory_free_mib == 81920


async def test_child_sees_its_partition(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, tmp_path: Path
) -> None:
    """A slot's replica sees the profile and its device labelled with it; the slot comes back."""
    core = make_core([node("n", devices=1, partitions=MIG)])
    await run(core, offer(partition="1g.10gb", code=DUMP_ENV))
    report = await recorder.final()
    assert report.state == SUCCEEDED, report.reason
    assert list(report.devices) == ["n:GPU:0/1g.10gb"]
    env = json.loads((tmp_path / "work/job-1/train/1/0/env.json").read_text())
    assert env["FEDERATION_PARTITION"] == "1g.10gb"
    assert env["FEDERATION_DEVICES"] == "n:GPU:0/1g.10gb"
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "FEDERATION_DEVICE_FRACTION" not in env
    assert slots(core) == [{"1g.10gb": 7, "3g.40gb": 2}]


@pytest.mark.parametrize(
    ("fraction", "percentage"), [(1.0, 100), (0.25, 25), (0.29, 29), (0.999, 99), (0.004, 1)]
)
def test_mps_thread_percentage_rounds_down_to_at_least_one(
    fraction: float, percentage: int
) -> None:
    """The MPS limit is the share in percent, rounded down, and never 0."""
    assert mps_thread_percentage(fraction) == percentage


async def test_each_slot_of_a_device_that_names_its_instances_sees_its_own(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder, tmp_path: Path
) -> None:
    """Where the device names its MIG instances, each replica's runtime is given one of them
    alone (CUDA_VISIBLE_DEVICES=MIG-...), never one another replica holds."""
    box = node("n", devices=1)
    box.devices[0].partitions.add(
        profile="1g.10gb", total=2, free=2, instances=["MIG-aaaa", "MIG-bbbb"]
    )
    core = make_core([box])
    assert (await core.offer(offer("job-1", partition="1g.10gb"))).accepted  # holds MIG-aaaa
    await run(core, offer("job-2", partition="1g.10gb", code=DUMP_ENV))
    report = await recorder.final("job-2")
    assert report.state == SUCCEEDED, report.reason
    env = json.loads((tmp_path / "work/job-2/train/1/0/env.json").read_text())
    assert env["CUDA_VISIBLE_DEVICES"] == "MIG-bbbb"
    assert env["FEDERATION_PARTITION"] == "1g.10gb"
