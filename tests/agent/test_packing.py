"""The embedded core's packer weighs what a placement leaves behind: it does not break up an
idle node a gang could use, nor take a scarce model that a plentiful one could replace."""

from __future__ import annotations

import pytest

from federation.agent.packing import (
    Placed,
    Slot,
    Usage,
    fragmentation,
    place,
    place_as_estimated,
)
from federation.api.v1 import jobs_pb2, resources_pb2
from federation.placement.devices import device_speeds

from .cores import node, offer

SPEED = device_speeds("training")
A100, V100 = SPEED("A100-80GB", 0.0), SPEED("V100", 0.0)
DURATION_S = 3600.0


def gpu_task(devices: int, replicas: int = 1) -> jobs_pb2.TaskSpec:
    """A task of ``replicas`` x ``devices`` GPUs of any model, an hour on an A100."""
    spec = offer(devices=devices, replicas=replicas).spec
    spec.estimated_duration_s = DURATION_S
    return spec


def nodes_of(slots: tuple[Slot, ...]) -> list[str]:
    return [slot.node for slot in slots]


def test_fragmentation_counts_devices_no_gang_of_the_mix_can_use() -> None:
    """An idle 8-device node strands nothing; one device taken from it strands the most."""
    assert fragmentation(8) == fragmentation(0) == 0
    assert fragmentation(7) > fragmentation(3) > fragmentation(2) > fragmentation(4)


@pytest.mark.parametrize("held", [5, 6])
def test_one_gpu_fills_a_partly_used_node_rather_than_break_an_idle_eight(held: int) -> None:
    """A 1-GPU task goes to the 16-GPU node that is partly used (10 or 11 GPUs free), not to
    the idle 8-GPU node, though best fit alone (fewest devices left) would take the idle one;
    so a gang of 2 x 8 GPUs still fits afterwards."""
    nodes = [node("big", devices=16), node("idle", devices=8)]
    usage = Usage.of([Slot("big", 1, 256, tuple(range(held)))])
    small = place(nodes, gpu_task(1), usage)
    assert not isinstance(small, str), small
    assert nodes_of(small) == ["big"]
    usage.add(small[0])
    gang = place(nodes, gpu_task(8, replicas=2), usage)
    assert not isinstance(gang, str), gang
    assert sorted(nodes_of(gang)) == ["big", "idle"]


def test_the_tighter_partly_used_node_still_wins() -> None:
    """With 3 GPUs free on a partly used node, the 1-GPU task goes there, as before."""
    nodes = [node("a-idle", devices=8), node("b-used", devices=8)]
    usage = Usage.of([Slot("b-used", 1, 256, tuple(range(5)))])
    placed = place(nodes, gpu_task(1), usage)
    assert not isinstance(placed, str), placed
    assert nodes_of(placed) == ["b-used"]


def scarce_and_plentiful() -> list[resources_pb2.Node]:
    """Four A100s on "a-a100" (first in every tie) and eight V100s on two nodes."""
    return [
        node("a-a100", devices=4, model="A100-80GB"),
        node("b-v100", devices=4, model="V100"),
        node("c-v100", devices=4, model="V100"),
    ]


def test_a_slow_tolerant_task_takes_the_plentiful_model() -> None:
    """Estimated at V100 speed, the task may run on an A100 or a V100 and keep the promise;
    it takes a V100 (8 free) and leaves the scarce A100s (4 free) to tasks that need them."""
    placed = place_as_estimated(scarce_and_plentiful(), gpu_task(1), Usage(), V100)
    assert isinstance(placed, Placed), placed
    assert nodes_of(placed.slots) == ["b-v100"]
    assert placed.device_model == "V100"
    assert placed.run_s == pytest.approx(DURATION_S / V100)


def test_scarcity_never_breaks_the_promise() -> None:
    """Estimated at A100 speed, the same task gets an A100, scarce or not."""
    placed = place_as_estimated(scarce_and_plentiful(), gpu_task(1), Usage(), A100)
    assert isinstance(placed, Placed), placed
    assert nodes_of(placed.slots) == ["a-a100"]
    assert placed.run_s == pytest.approx(DURATION_S / A100)


def test_on_a_mixed_node_the_plentiful_model_goes_first() -> None:
    """One node with an A100 at index 0 and three V100s: a 1-GPU task without a promise takes
    a V100, the model with more devices free."""
    mixed = node("mixed", devices=4, model="V100")
    mixed.devices[0].model = "A100-80GB"
    placed = place([mixed], gpu_task(1), Usage())
    assert not isinstance(placed, str), placed
    assert placed[0].device_positions == (1,)
