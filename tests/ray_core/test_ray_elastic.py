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

import asyncio
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


@pytest.fixture(scope="module")
def head() -> Iterator[LocalRayHead]:
    """A head with 2 CPUs and no A100; its autoscaler launches up to 2 a100x2 nodes."""
    if ray_binary() is None:
        pytest.skip("Ray is not installed: pip install -e '.[ray]'")
    import ray

    ray.shutdown()  # a core of another module may have connected this process to its head
    a100x2 = FakeNodeType({"CPU": 2, "GPU_A100": 2, "a100x2": 1}, max_workers=2)
    head = LocalRayHead(cpus=2, a100s=0, worker_types={"a100x2": a100x2}, idle_timeout_s=RAY_IDLE_S)
    head.start()
    try:
        yield head
    finally:
        ray.shutdown()
        head.stop()


@pytest.fixture
async def site(
    head: LocalRayHead, tmp_path: Path
) -> AsyncIterator[tuple[RayCore, Elastic, Reports]]:
    """A Ray core whose site may launch 2 a100x2 (Ray's type) and 1 l40s (no type of Ray's
    autoscaling config: it cannot be launched)."""
    types = [node_type("a100x2", 2), node_type("l40s", 1, model="L40S")]
    provider = RayAutoscalerProvider(types, timeout_s=0.0, poll_s=0.2)
    settings = ElasticSettings(provider="ray", idle_release_s=IDLE_RELEASE_S)
    elastic = Elastic(types, provider, settings)
    provider.delays = elastic.delays
    reports: Reports = []
    core = RayCore(
        head.settings(),
        site="elastic",
        work_dir=tmp_path / "work",
        on_status=reports.append,
        on_change=lambda: None,
        kill_grace_s=2.0,
        elastic=elastic,
        autoscaler=provider,
    )
    await core.start()
    try:
        yield core, elastic, reports
    finally:
        for report in core.tasks():
            if report.state not in FINAL:
                await core.cancel(report.job_id, report.task, 0, "test over")
        await core.close()


def states(core: RayCore) -> dict[str, int]:
    return {n.name: n.launch.state for n in core.nodes() if n.HasField("launch")}


def ray_nodes_of(resource: str) -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(resource)]


async def test_more_than_the_site_may_launch_is_declined(
    site: tuple[RayCore, Elastic, Reports],
) -> None:
    """3 x 2 A100: the site may launch 2 a100x2: declined, nothing launches."""
    core, _, _ = site
    answer = await core.offer(offer("j-big", gang(["true"], replicas=3, a100s=2)))
    assert not answer.accepted
    assert "replicas fit" in answer.reason, answer.reason
    assert set(states(core).values()) == {LAUNCHABLE}
    await asyncio.sleep(2.0)
    assert ray_nodes_of("a100x2") == []


async def test_a_launch_ray_cannot_make_fails_the_task_with_its_word(
    site: tuple[RayCore, Elastic, Reports],
) -> None:
    """l40s is no node type of Ray's autoscaling config: the launch times out (3 x its p90,
    here cut to 3 s) and the task fails with what the autoscaler said."""
    core, elastic, reports = site
    provider = elastic._provider
    assert isinstance(provider, RayAutoscalerProvider)
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
