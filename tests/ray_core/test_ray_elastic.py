"""An elastic Ray site: its node types launched by Ray's autoscaler (the fake multi-node
provider: each node one more raylet on this machine). A 2 x 2-A100 gang on a site with no A100
launches two a100x2 nodes, which appear in Ray and in the view under the site's names, runs on
them and succeeds; once idle the site releases them and Ray removes them. More than the site
may launch is declined, and a type Ray's autoscaler cannot launch fails the task with what the
autoscaler said.

Its own head (not the session's): it runs the autoscaler, and its nodes must not show in the
other tests' views.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from datacenter_agent.ray_cluster.autoscaler import RayAutoscalerProvider
from datacenter_agent.ray_cluster.core import RayCore
from federation.agent.elastic import LAUNCHABLE, LAUNCHING, RUNNING, Elastic, ElasticSettings
from federation.api.v1 import jobs_pb2, resources_pb2, site_link_service_pb2
from federation.common.node_types import NodeType
from federation.testing.ray_head import FakeNodeType, LocalRayHead, ray_binary

from .test_ray_core import FINAL, commit, gang, last, offer, until

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(240)]

DELAY_S = 10.0
"""The type's configured delay: the expected start until launches are measured."""
PRICE = 8.0
IDLE_RELEASE_S = 2.0
RAY_IDLE_S = 6.0
"""Ray's autoscaler removes a node idle this long that no request wants."""
Reports = list[site_link_service_pb2.TaskReport]


def node_type(name: str, max_nodes: int, model: str = "A100-80GB", cpus: int = 2) -> NodeType:
    template = resources_pb2.Node(cpu_cores=cpus, memory_mib=4096, schedulable=True)
    for _ in range(2):
        template.devices.append(
            resources_pb2.Device(
                kind=resources_pb2.DEVICE_KIND_GPU,
                vendor="nvidia",
                model=model,
                memory_total_mib=81920,
                memory_free_mib=81920,
                health=resources_pb2.DEVICE_HEALTH_HEALTHY,
                provenance=resources_pb2.PROVENANCE_DECLARED,
            )
        )
    return NodeType(name, template, max_nodes, price_per_hour=PRICE, delay_s=DELAY_S)


def elastic_head() -> Iterator[LocalRayHead]:
    """A head with 2 CPUs and no A100; its autoscaler launches up to 2 a100x2 nodes, and a
    dead node is found in a few seconds."""
    if ray_binary() is None:
        pytest.skip("Ray is not installed: pip install -e '.[ray]'")
    import ray

    ray.shutdown()  # a core of another module may have connected this process to its head
    a100x2 = FakeNodeType({"CPU": 2, "GPU_A100": 2, "a100x2": 1}, max_workers=2)
    head = LocalRayHead(
        cpus=2,
        a100s=0,
        worker_types={"a100x2": a100x2},
        idle_timeout_s=RAY_IDLE_S,
        quick_node_checks=True,
    )
    head.start()
    try:
        yield head
    finally:
        ray.shutdown()
        head.stop()


@pytest.fixture(scope="module")
def head() -> Iterator[LocalRayHead]:
    yield from elastic_head()


class RecordingProvider(RayAutoscalerProvider):
    """Ray's provider, recording every launch it is asked for."""

    def __init__(self, types: list[NodeType]) -> None:
        super().__init__(types, timeout_s=0.0, poll_s=0.2)
        self.asked: list[str] = []

    async def launch(self, node: str, node_type: NodeType) -> None:
        self.asked.append(node)
        await super().launch(node, node_type)


def start_site(head: LocalRayHead, work_dir: Path) -> tuple[RayCore, Elastic, Reports]:
    """A Ray core (not started) whose site may launch 2 a100x2 (Ray's type) and 1 l40s (no
    type of Ray's autoscaling config: it cannot be launched)."""
    types = [node_type("a100x2", 2), node_type("l40s", 1, model="L40S")]
    provider = RecordingProvider(types)
    settings = ElasticSettings(provider="ray", idle_release_s=IDLE_RELEASE_S)
    elastic = Elastic(types, provider, settings)
    provider.delays = elastic.delays
    reports: Reports = []
    core = RayCore(
        head.settings(),
        site="elastic",
        work_dir=work_dir,
        on_status=reports.append,
        on_change=lambda: None,
        kill_grace_s=2.0,
        elastic=elastic,
        autoscaler=provider,
    )
    return core, elastic, reports


async def end_site(core: RayCore) -> None:
    for report in core.tasks():
        if report.state not in FINAL:
            await core.cancel(report.job_id, report.task, 0, "test over")
    await core.close()


def provider_of(elastic: Elastic) -> RecordingProvider:
    provider = elastic._provider
    assert isinstance(provider, RecordingProvider)
    return provider


@pytest.fixture
async def site(
    head: LocalRayHead, tmp_path: Path
) -> AsyncIterator[tuple[RayCore, Elastic, Reports]]:
    core, elastic, reports = start_site(head, tmp_path / "work")
    await core.start()
    try:
        yield core, elastic, reports
    finally:
        await end_site(core)


def states(core: RayCore) -> dict[str, int]:
    return {n.name: n.launch.state for n in core.nodes() if n.HasField("launch")}


def ray_nodes_of(resource: str) -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource)]


async def test_more_than_the_site_may_launch_is_declined(
    site: tuple[RayCore, Elastic, Reports],
) -> None:
    """3 x 2 A100: the site may launch 2 a100x2: declined, nothing launches."""
    core, elastic, _ = site
    answer = await core.offer(offer("j-big", gang(["true"], replicas=3, a100s=2)))
    assert not answer.accepted
    assert "replicas fit" in answer.reason, answer.reason
    assert set(states(core).values()) == {LAUNCHABLE}
    assert provider_of(elastic).asked == []  # no launch was asked of Ray
    assert core.queue().pending_tasks == 0  # and nothing is held for one


async def test_a_launch_ray_cannot_make_fails_the_task_with_its_word(
    site: tuple[RayCore, Elastic, Reports],
) -> None:
    """l40s is no node type of Ray's autoscaling config: the launch times out (3 x its p90,
    here cut to 3 s) and the task fails with what the autoscaler said."""
    core, elastic, reports = site
    provider = provider_of(elastic)
    provider._timeout_s = 3.0
    spec = gang(["true"], replicas=1, a100s=2)
    del spec.resources.accelerator.models[:]
    spec.resources.accelerator.models.append("L40S")
    answer = await core.offer(offer("j-l40s", spec))
    assert answer.accepted, answer.reason
    assert answer.expected_start_s == DELAY_S
    assert (await core.commit(commit("j-l40s", answer.reservation_id))).started
    await until(lambda: states(core)["l40s-0"] == LAUNCHING, "launching")
    await until(lambda: (r := last(reports, "j-l40s")) is not None and r.state in FINAL, "ended")
    report = last(reports, "j-l40s")
    assert report is not None
    assert report.state == jobs_pb2.JOB_STATE_FAILED
    assert "launching node l40s-0 (l40s) failed: Ray started no l40s node" in report.reason
    assert "its autoscaler reports" in report.reason
    print("failed launch:", report.reason)
    assert states(core)["l40s-0"] == LAUNCHABLE


async def test_a_gang_launches_ray_nodes_runs_on_them_and_they_are_released(
    site: tuple[RayCore, Elastic, Reports],
) -> None:
    core, elastic, reports = site
    assert states(core) == {"a100x2-0": LAUNCHABLE, "a100x2-1": LAUNCHABLE, "l40s-0": LAUNCHABLE}
    code = 'echo "replica $FEDERATION_REPLICA on $FEDERATION_DEVICES"'
    spec = gang(["sh", "-c", code], replicas=2, a100s=2)
    answer = await core.offer(offer("j-gang", spec))
    assert answer.accepted, answer.reason
    assert answer.expected_start_s == DELAY_S  # the configured delay: nothing measured yet
    began = time.monotonic()
    assert (await core.commit(commit("j-gang", answer.reservation_id))).started
    await until(
        lambda: states(core)["a100x2-0"] == states(core)["a100x2-1"] == LAUNCHING, "launching"
    )
    report = last(reports, "j-gang")
    assert report is None or report.state == jobs_pb2.JOB_STATE_DELEGATED

    # Both nodes launch: two a100x2 nodes alive in Ray, in the view under the site's names.
    launched = await until(
        lambda: states(core)["a100x2-0"] == states(core)["a100x2-1"] == RUNNING,
        "both nodes running",
        timeout_s=60,
    )
    in_ray = ray_nodes_of("a100x2")
    assert len(in_ray) == 2
    view = {n.name: n for n in core.nodes()}
    assert {view["a100x2-0"].labels["ray_node_id"], view["a100x2-1"].labels["ray_node_id"]} == {
        n["NodeID"] for n in in_ray
    }
    assert [d.id for d in view["a100x2-0"].devices] == ["GPU_A100-0", "GPU_A100-1"]

    await until(lambda: (r := last(reports, "j-gang")) is not None and r.state in FINAL, "ended")
    report = last(reports, "j-gang")
    assert report is not None
    assert report.state == jobs_pb2.JOB_STATE_SUCCEEDED, report
    assert sorted(report.devices) == [
        f"a100x2-{i}:GPU_A100-{d}" for i in range(2) for d in range(2)
    ]
    assert "replica 0 on a100x2-" in report.output_tail
    assert "replica 1 on a100x2-" in report.output_tail
    p50, p90 = elastic.delays("a100x2")
    assert p50 != DELAY_S  # measured now
    print(f"launch of 2 nodes: {launched:.1f}s; learned p50 {p50:.1f}s p90 {p90:.1f}s")
    print(f"commit to end: {time.monotonic() - began:.1f}s")

    # Idle: the site releases them, and Ray's autoscaler removes them.
    await until(lambda: set(states(core).values()) == {LAUNCHABLE}, "released", timeout_s=30)
    gone = await until(lambda: not ray_nodes_of("a100x2"), "removed by Ray", timeout_s=60)
    print(f"removed by Ray {gone:.1f}s after their release")
    view = {n.name: n for n in core.nodes()}
    assert "ray_node_id" not in view["a100x2-0"].labels  # the type's node, launchable again


async def test_a_task_cancelled_while_its_node_launches_ends_cancelled_and_the_node_goes(
    site: tuple[RayCore, Elastic, Reports],
) -> None:
    """Cancelled while its node launches: the task ends CANCELLED at once (not interrupted: it
    was the coordinator's word); the launch goes on, and the node, idle, is released."""
    core, elastic, reports = site
    answer = await core.offer(offer("j-early", gang(["sleep", "60"], replicas=1, a100s=2)))
    assert answer.accepted, answer.reason
    assert (await core.commit(commit("j-early", answer.reservation_id))).started
    await until(lambda: states(core)["a100x2-0"] == LAUNCHING, "launching")
    await core.cancel("j-early", "main", 1, "cancelled by its owner")
    report = last(reports, "j-early")
    assert report is not None
    assert report.state == jobs_pb2.JOB_STATE_CANCELLED
    assert not report.interrupted
    assert report.reason == "cancelled by its owner"
    assert provider_of(elastic).asked == ["a100x2-0"]
    assert states(core)["a100x2-0"] == LAUNCHING  # the launch goes on ...
    await until(lambda: states(core)["a100x2-0"] == RUNNING, "launched", timeout_s=60)
    # ... and the node, which no task holds, is released; its demand withdrawn, Ray removes it.
    await until(lambda: states(core)["a100x2-0"] == LAUNCHABLE, "released", timeout_s=30)
    assert provider_of(elastic)._wanted == {}
    await until(lambda: not ray_nodes_of("a100x2"), "removed by Ray", timeout_s=60)
    assert [r.state for r in reports if r.job_id == "j-early"] == [jobs_pb2.JOB_STATE_CANCELLED]


async def test_a_restarted_agent_adopts_the_nodes_it_launched_and_releases_them_when_idle(
    head: LocalRayHead, tmp_path: Path
) -> None:
    """An agent launches a node for a long task, then stops (the job stays with Ray). The next
    agent of the site takes the alive Ray node as its a100x2-0, running, without launching it
    again, adopts the job, and once the job is cancelled releases the idle node."""
    first, elastic, reports = start_site(head, tmp_path / "work")
    await first.start()
    try:
        answer = await first.offer(offer("j-kept", gang(["sleep", "120"], replicas=1, a100s=2)))
        assert answer.accepted, answer.reason
        assert (await first.commit(commit("j-kept", answer.reservation_id))).started
        await until(
            lambda: (
                (r := last(reports, "j-kept")) is not None and r.state == jobs_pb2.JOB_STATE_RUNNING
            ),
            "running on the launched node",
            timeout_s=60,
        )
        ray_id = {n.name: n for n in first.nodes()}["a100x2-0"].labels["ray_node_id"]
    finally:
        await first.close()  # the agent exits: its job keeps running in Ray

    second, elastic, reports = start_site(head, tmp_path / "work")
    await second.start()
    try:
        view = {n.name: n for n in second.nodes()}
        assert states(second)["a100x2-0"] == RUNNING
        assert view["a100x2-0"].labels["ray_node_id"] == ray_id
        assert states(second)["a100x2-1"] == LAUNCHABLE
        assert provider_of(elastic).asked == []  # adopted, not launched again
        (adopted,) = second.tasks()
        assert (adopted.job_id, adopted.state) == ("j-kept", jobs_pb2.JOB_STATE_RUNNING)
        # The adopted job names no nodes: every launched node is busy while it runs.
        assert "a100x2-0" in second._busy_nodes()
        await second.cancel("j-kept", "main", 0, "done with it")
        assert (r := last(reports, "j-kept")) is not None
        assert r.state == jobs_pb2.JOB_STATE_CANCELLED
        await until(lambda: states(second)["a100x2-0"] == LAUNCHABLE, "released", timeout_s=30)
        assert provider_of(elastic).asked == []
        await until(lambda: not ray_nodes_of("a100x2"), "removed by Ray", timeout_s=60)
    finally:
        await end_site(second)


async def test_a_launched_node_that_dies_is_taken_back_and_its_task_interrupted(
    head: LocalRayHead, site: tuple[RayCore, Elastic, Reports]
) -> None:
    """The raylet of a launched node is killed (a spot node the cloud took back): the site's
    view shows the node launchable again, its demand is withdrawn from the autoscaler, and the
    task on it ends CANCELLED and interrupted, which the coordinator places again.

    Last in the module: the fake provider still counts the killed node as its own (pending),
    so its type's next launch would wait for it in vain."""
    core, elastic, reports = site
    answer = await core.offer(offer("j-spot", gang(["sleep", "120"], replicas=1, a100s=2)))
    assert answer.accepted, answer.reason
    assert (await core.commit(commit("j-spot", answer.reservation_id))).started
    await until(
        lambda: (
            (r := last(reports, "j-spot")) is not None and r.state == jobs_pb2.JOB_STATE_RUNNING
        ),
        "running on the launched node",
        timeout_s=60,
    )
    view = {n.name: n for n in core.nodes()}
    ray_id = view["a100x2-0"].labels["ray_node_id"]
    head.kill_node(ray_id)
    killed = time.monotonic()
    await until(
        lambda: (r := last(reports, "j-spot")) is not None and r.state in FINAL,
        "the task ended",
        timeout_s=90,
    )
    report = last(reports, "j-spot")
    assert report is not None
    assert report.state == jobs_pb2.JOB_STATE_CANCELLED, report
    assert report.interrupted
    assert report.reason == (
        f"node a100x2-0 was taken back by its provider: its Ray node {ray_id} is no longer alive"
    )
    print(f"a killed node's task reported interrupted {time.monotonic() - killed:.1f}s after")
    assert states(core)["a100x2-0"] == LAUNCHABLE
    assert "ray_node_id" not in {n.name: n for n in core.nodes()}["a100x2-0"].labels
    assert provider_of(elastic)._wanted == {}  # Ray is not asked for another
    assert provider_of(elastic).asked == ["a100x2-0"]
