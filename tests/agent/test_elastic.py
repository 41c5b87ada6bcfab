"""An elastic site's nodes: offers go to running nodes first and to launchable ones only
when those lack room, a commit launches them (once, however many tasks wait), the tasks start
once they run, more than the site may launch is declined, idle nodes are released down to
warm_min, and the launch delay is learned from the site's own launches."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from federation.agent.elastic import (
    LAUNCHABLE,
    RUNNING,
    Elastic,
    ElasticSettings,
    LaunchError,
    SimulatedProvider,
)
from federation.agent.embedded_core import EmbeddedCore
from federation.agent.inventory import InventoryError, load_inventory, load_node_types
from federation.api.v1 import jobs_pb2, resources_pb2
from federation.common.node_types import NodeType
from federation.placement.snapshot import launch_price_per_hour

from .cores import Recorder, commit_for, node, offer

A100 = node("template", devices=2, model="A100-80GB")


def a100x2(max_nodes: int = 2, delay_s: float = 0.3, *, spot: bool = False) -> NodeType:
    template = resources_pb2.Node()
    template.CopyFrom(A100)
    template.name = ""
    return NodeType(
        "a100x2", template, max_nodes, 8.0, spot_price_per_hour=3.0, delay_s=delay_s, spot=spot
    )


class FailingProvider(SimulatedProvider):
    async def launch(self, node: str, node_type: NodeType) -> None:
        raise RuntimeError("quota exceeded in us-east-1")


def states(core: EmbeddedCore) -> dict[str, int]:
    return {n.name: n.launch.state for n in core.nodes() if n.HasField("launch")}


async def test_running_nodes_first_then_a_launch_that_the_task_waits_for(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    elastic = Elastic([a100x2()], SimulatedProvider(), ElasticSettings(idle_release_s=60))
    core = make_core([node("fixed", devices=2, model="A100-80GB")], elastic=elastic)
    await core.adopt()
    small = offer("small", devices=2, code="print('fixed')")
    answer = await core.offer(small)
    assert answer.accepted, answer.reason
    assert states(core) == {"a100x2-0": LAUNCHABLE, "a100x2-1": LAUNCHABLE}
    # Nothing fixed is left: the next gang takes both launchable nodes.
    gang = offer("gang", devices=2, replicas=2, code="print('launched')")
    taken = await core.offer(gang)
    assert taken.accepted, taken.reason
    started = await core.commit(commit_for(gang, taken))
    assert started.started
    async with asyncio.timeout(2):
        while set(states(core).values()) != {resources_pb2.NodeLaunch.STATE_LAUNCHING}:
            recorder.changed.clear()
            await recorder.changed.wait()  # the core tells of each launch
    assert jobs_pb2.JOB_STATE_RUNNING not in recorder.states("gang")  # not before the launch
    final = await recorder.final("gang")
    assert final.state == jobs_pb2.JOB_STATE_SUCCEEDED
    assert set(states(core).values()) == {RUNNING}
    assert {r.state for r in recorder.reports if r.job_id == "gang"} >= {jobs_pb2.JOB_STATE_RUNNING}
    p50, _ = elastic.delays("a100x2")
    assert p50 == pytest.approx(0.3, abs=0.2)  # learned, not configured


async def test_more_than_the_site_may_launch_is_declined(
    make_core: Callable[..., EmbeddedCore],
) -> None:
    elastic = Elastic([a100x2()], SimulatedProvider(), ElasticSettings())
    core = make_core([], elastic=elastic)
    answer = await core.offer(offer("big", devices=2, replicas=3))
    assert not answer.accepted
    assert "2 of 3 replicas fit" in answer.reason


async def test_a_failed_launch_fails_the_task_with_the_provider_answer(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    elastic = Elastic([a100x2()], FailingProvider(), ElasticSettings())
    core = make_core([], elastic=elastic)
    o = offer("doomed", devices=2)
    answer = await core.offer(o)
    await core.commit(commit_for(o, answer))
    final = await recorder.final("doomed")
    assert final.state == jobs_pb2.JOB_STATE_FAILED
    assert "launching node a100x2-0 (a100x2) failed: quota exceeded in us-east-1" in final.reason
    assert set(states(core).values()) == {LAUNCHABLE}


async def test_idle_nodes_are_released_down_to_warm_min() -> None:
    now = [1000.0]
    elastic = Elastic(
        [a100x2(delay_s=0)],
        SimulatedProvider(),
        ElasticSettings(idle_release_s=30, warm_min=1),
        clock=lambda: now[0],
    )
    await elastic.ensure_running(["a100x2-0", "a100x2-1"], lambda: None)
    assert await elastic.release_idle({"a100x2-1"}, lambda: None) == []  # not idle long yet
    now[0] += 31
    # a100x2-0 idle 31 s: released; a100x2-1 holds a task and keeps one running.
    assert await elastic.release_idle({"a100x2-1"}, lambda: None) == ["a100x2-0"]
    now[0] += 60
    # a100x2-1 idle since its task ended, 60 s on: kept, the one warm node.
    assert await elastic.release_idle(set(), lambda: None) == []
    now[0] += 60
    assert await elastic.release_idle(set(), lambda: None) == []
    assert elastic.ready("a100x2-1")
    assert not elastic.ready("a100x2-0")


async def test_one_launch_serves_every_task_that_waits_for_the_node() -> None:
    launches: list[str] = []

    class Counting(SimulatedProvider):
        async def launch(self, node: str, node_type: NodeType) -> None:
            launches.append(node)
            await asyncio.sleep(0.05)

    elastic = Elastic([a100x2()], Counting(), ElasticSettings())
    await asyncio.gather(
        elastic.ensure_running(["a100x2-0"], lambda: None),
        elastic.ensure_running(["a100x2-0"], lambda: None),
    )
    assert launches == ["a100x2-0"]
    with pytest.raises(LaunchError):
        await Elastic([a100x2()], FailingProvider(), ElasticSettings()).ensure_running(
            ["a100x2-1"], lambda: None
        )


def test_node_types_are_read_from_the_inventory(tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(
        "node_types:\n"
        "  - name: a100x2\n"
        "    cpu_cores: 16\n"
        "    memory_mib: 131072\n"
        "    devices: [{kind: GPU, vendor: nvidia, model: A100-80GB, count: 2}]\n"
        "    max: 4\n"
        "    price_per_hour: 8.5\n"
        "    delay_s: 90\n"
    )
    (found,) = load_node_types(inventory)
    assert (found.name, found.max, found.price_per_hour, found.delay_s) == ("a100x2", 4, 8.5, 90)
    assert len(found.template.devices) == 2
    assert load_inventory(inventory) == []  # no node runs until one is launched
    inventory.write_text("node_types:\n  - {name: x, max: 0}\n")
    with pytest.raises(InventoryError, match=r"node_types\[0\]\.max: must be 1 to 1000, got 0"):
        load_node_types(inventory)


def test_a_spot_node_type_is_read_with_its_spot_price(tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(
        "node_types:\n"
        "  - {name: a, cpu_cores: 4, price_per_hour: 8, spot_price_per_hour: 3, spot: true}\n"
        "  - {name: b, cpu_cores: 4, price_per_hour: 8}\n"
    )
    spot, on_demand = load_node_types(inventory)
    assert (spot.spot, spot.spot_price_per_hour, on_demand.spot) == (True, 3.0, False)
    inventory.write_text("node_types:\n  - {name: a, price_per_hour: 8, spot: true}\n")
    with pytest.raises(
        InventoryError,
        match=r"node_types\[0\]\.spot_price_per_hour: a spot node type must declare its spot",
    ):
        load_node_types(inventory)
    inventory.write_text("node_types:\n  - {name: a, spot: 'yes', spot_price_per_hour: 3}\n")
    with pytest.raises(InventoryError, match=r"node_types\[0\]\.spot: expected true or false"):
        load_node_types(inventory)


async def test_a_spot_node_taken_back_stops_its_tasks_as_interrupted(
    make_core: Callable[..., EmbeddedCore], recorder: Recorder
) -> None:
    """A spot node its provider reports taken back (the simulated provider, 0.5 s after the
    launch): its task ends CANCELLED and interrupted (the coordinator places such a task again,
    from its checkpoint), and the node is launchable; a second report of it is ignored."""
    provider = SimulatedProvider(spot_reclaim_after_s=0.5)
    elastic = Elastic([a100x2(delay_s=0, spot=True)], provider, ElasticSettings())
    core = make_core([], elastic=elastic)
    o = offer("spot", devices=2, code="import time; time.sleep(60)")
    answer = await core.offer(o)
    await core.commit(commit_for(o, answer))
    await recorder.reached("spot", jobs_pb2.JOB_STATE_RUNNING)
    final = await recorder.final("spot")
    assert final.state == jobs_pb2.JOB_STATE_CANCELLED
    assert final.interrupted
    assert (
        "node a100x2-0 was taken back by its provider: spot capacity reclaimed "
        "(simulated, 0.5s after launch)" in final.reason
    )
    assert states(core)["a100x2-0"] == LAUNCHABLE
    assert provider.launched == ["a100x2-0"]
    elastic._reported_lost("a100x2-0", "again")  # not running: nothing to do
    assert states(core)["a100x2-0"] == LAUNCHABLE


async def test_on_demand_and_released_nodes_are_not_taken_back() -> None:
    """The simulated provider takes back spot nodes only, and none it released."""
    lost: list[str] = []
    told = asyncio.Event()
    provider = SimulatedProvider(spot_reclaim_after_s=0.2)
    spot = NodeType("spot", A100, 1, spot_price_per_hour=3.0, delay_s=0, spot=True)
    elastic = Elastic([a100x2(delay_s=0), spot], provider, ElasticSettings(idle_release_s=0.01))

    def taken_back(node: str, why: str) -> None:
        lost.append(node)
        told.set()

    elastic.on_taken_back(taken_back)
    await elastic.ensure_running(["a100x2-0", "spot-0"], lambda: None)
    await asyncio.sleep(0.02)
    assert sorted(await elastic.release_idle(set(), lambda: None)) == ["a100x2-0", "spot-0"]
    await elastic.ensure_running(["a100x2-0"], lambda: None)
    await asyncio.sleep(0.4)  # past when the released spot node would have been taken back
    assert lost == []
    assert elastic.ready("a100x2-0")
    await elastic.ensure_running(["spot-0"], lambda: None)
    async with asyncio.timeout(2):
        await told.wait()
    assert lost == ["spot-0"]
    assert not elastic.ready("spot-0")


def test_a_spot_node_publishes_and_is_charged_its_spot_price() -> None:
    on_demand, spot = a100x2(), a100x2(spot=True)
    published = Elastic([spot], SimulatedProvider(), ElasticSettings()).nodes()[0]
    assert published.launch.spot
    assert launch_price_per_hour(published) == 3.0
    assert (
        launch_price_per_hour(
            Elastic([on_demand], SimulatedProvider(), ElasticSettings()).nodes()[0]
        )
        == 8.0
    )
