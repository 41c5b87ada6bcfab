"""Drains and node cordons over real agents: a drained site's checkpointing task resumes
elsewhere from its checkpoint at once, its plain task runs to the deadline and is then placed
again, nothing new lands there until an uncordon, and a cordoned node takes no replica."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2
from federation.local import LocalFederation, SiteSpec

from .conftest import admin, jobs, running, spec, until, wait_for_job
from .test_cli import fedctl

pytestmark = pytest.mark.xdist_group("e2e-drain")

RUNNING = jobs_pb2.JOB_STATE_RUNNING
DEADLINE_S = 4.0

# Counts steps from where it restored; a checkpoint per step when it has a policy; ends at the
# file "go". Marker start-JOB-SITE holds what it restored from.
TASK = """
import os, sys, time
def mark(folder, name, text):  # whole: a test reads a marker the moment it appears
    temporary = os.path.join(os.path.dirname(folder), "." + name)
    open(temporary, "w").write(text)
    os.rename(temporary, os.path.join(folder, name))
markers = sys.argv[1]
tag = os.environ["FEDERATION_JOB_ID"] + "-" + os.environ["FEDERATION_SITE"]
restore = os.environ.get("FEDERATION_RESTORE_FROM", "")
step = int(open(restore).read()) if restore else 0
mark(markers, "start-" + tag, restore)
folder = os.environ.get("FEDERATION_CHECKPOINT_DIR", "")
while not os.path.exists(os.path.join(markers, "go")):
    step += 1
    if folder:
        name = os.path.join(folder, "step-%04d" % step)
        open(name, "w").write(str(step))
        open(name + ".done", "w").close()
    time.sleep(0.2)
"""


def site(name: str, *nodes: str) -> SiteSpec:
    boxes = [{"name": n, "cpu_cores": 4, "memory_mib": 4096} for n in nodes]
    return SiteSpec(name, "edge", nodes=boxes)


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    sites = [site("drain-a", "a1", "a2"), site("drain-b", "b1")]
    with running(tmp_path_factory.mktemp("drain"), sites) as fed:
        yield fed


def job(job_id: str, markers: Path, *, checkpoint: bool, sites: list[str]) -> jobs_pb2.JobSpec:
    task: dict[str, object] = {
        "name": "t",
        "command": [sys.executable, "-c", TASK, str(markers)],
        "resources": {"cpu": 1, "memory_mib": 64},
    }
    if checkpoint:
        task["checkpoint"] = {"interval_s": 0.2}
    return spec(job_id, [task], id=job_id, constraints={"sites": sites})


async def get(channel: grpc.aio.Channel, job_id: str) -> jobs_pb2.Job:
    return (await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job


async def running_at(channel: grpc.aio.Channel, job_id: str, site: str) -> None:
    async def there() -> bool:
        task = (await get(channel, job_id)).tasks[0]
        return task.state == RUNNING and task.site == site

    await until(there, f"{job_id} running at {site}")


async def site_record(channel: grpc.aio.Channel, name: str) -> admin_service_pb2.Site:
    reply = await admin(channel).ListSites(admin_service_pb2.ListSitesRequest())
    return next(s for s in reply.sites if s.name == name)


async def test_a_drain_moves_checkpointing_work_now_and_the_rest_at_the_deadline(
    operator: grpc.aio.Channel, federation: LocalFederation, tmp_path: Path
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    both = ["drain-a", "drain-b"]
    stub, ops = jobs(operator), admin(operator)
    # Both jobs start at drain-a: drain-b is cordoned until they run.
    await ops.CordonSite(admin_service_pb2.CordonSiteRequest(site="drain-b"))
    for job_id, checkpoint in (("ckpt", True), ("plain", False)):
        submitted = job(job_id, markers, checkpoint=checkpoint, sites=both)
        await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=submitted))
        await running_at(operator, job_id, "drain-a")
    await until(lambda: _has_checkpoint(operator, "ckpt"), "a checkpoint of ckpt", timeout_s=30)
    await ops.UncordonSite(admin_service_pb2.UncordonSiteRequest(site="drain-b"))

    done = fedctl(
        federation,
        "sites",
        "drain",
        "drain-a",
        "--deadline",
        f"{DEADLINE_S:g}s",
        "--no-wait",
        "-o",
        "json",
    )
    assert done.returncode == 0, done.stderr
    drained = json.loads(done.stdout)
    assert drained["cordoned"] is True
    assert drained["drains"][0]["tasks_left"] == 2
    assert "deadline" in drained["drains"][0]

    # The checkpointing task moves at once, restoring from its checkpoint; the plain one is
    # still at drain-a meanwhile.
    await running_at(operator, "ckpt", "drain-b")
    await started(markers / "start-ckpt-drain-b")
    assert restored_step(markers / "start-ckpt-drain-b") >= 1
    plain = (await get(operator, "plain")).tasks[0]
    assert (plain.site, plain.state) == ("drain-a", RUNNING)
    # Nothing new lands on the drained site.
    pinned = job("pinned", markers, checkpoint=False, sites=["drain-a"])
    await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=pinned))

    async def refused_as_cordoned() -> bool:
        reply = await stub.ExplainJob(job_service_pb2.ExplainJobRequest(job_id="pinned"))
        return any(s.code == "SITE_CORDONED" for s in reply.tasks[0].sites)

    await until(refused_as_cordoned, "pinned refused at the cordoned drain-a")
    # At the deadline the plain task is stopped and placed again, from the start.
    await running_at(operator, "plain", "drain-b")
    await started(markers / "start-plain-drain-b")
    assert (markers / "start-plain-drain-b").read_text() == ""
    events = (
        await stub.GetJob(job_service_pb2.GetJobRequest(job_id="plain", include_events=True))
    ).events
    assert any("the drain of site drain-a" in e.reason for e in events), events
    assert (await site_record(operator, "drain-a")).drains[0].tasks_left == 0
    assert (await get(operator, "pinned")).state == jobs_pb2.JOB_STATE_PENDING

    # An uncordon ends the drain and the pinned job lands.
    undone = await ops.UncordonSite(admin_service_pb2.UncordonSiteRequest(site="drain-a"))
    assert not undone.site.cordoned
    assert not undone.site.drains
    await running_at(operator, "pinned", "drain-a")
    (markers / "go").touch()
    for job_id in ("ckpt", "plain", "pinned"):
        assert (await wait_for_job(operator, job_id)).state == jobs_pb2.JOB_STATE_SUCCEEDED


async def started(marker: Path) -> None:
    """Until the task's process has written its start marker (it reports RUNNING first)."""

    async def written() -> bool:
        return await asyncio.to_thread(marker.exists)

    await until(written, f"{marker.name} written")


def restored_step(marker: Path) -> int:
    """The step of the checkpoint a task's start marker says it restored from."""
    restored = Path(marker.read_text())
    assert restored.name.startswith("step-"), restored
    return int(restored.read_text())


async def _has_checkpoint(channel: grpc.aio.Channel, job_id: str) -> bool:
    return bool((await get(channel, job_id)).tasks[0].checkpoint.path)


async def test_a_cordoned_node_takes_no_replica(operator: grpc.aio.Channel, tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    (markers / "go").touch()  # each task ends after its first look
    ops = admin(operator)
    cordoned = await ops.CordonSite(admin_service_pb2.CordonSiteRequest(site="drain-a", node="a1"))
    assert list(cordoned.site.cordoned_nodes) == ["a1"]
    assert not cordoned.site.cordoned
    for i in range(3):
        job_id = f"node-{i}"
        submitted = job(job_id, markers, checkpoint=False, sites=["drain-a"])
        await jobs(operator).SubmitJob(job_service_pb2.SubmitJobRequest(spec=submitted))
        done = await wait_for_job(operator, job_id)
        assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
        assert list(done.tasks[0].nodes) == ["a2"]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await ops.CordonSite(admin_service_pb2.CordonSiteRequest(site="drain-a", node="a9"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "reports no node 'a9'" in (refused.value.details() or "")
    undone = await ops.UncordonSite(
        admin_service_pb2.UncordonSiteRequest(site="drain-a", node="a1")
    )
    assert not undone.site.cordoned_nodes
