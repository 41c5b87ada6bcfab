"""A launched Ray node lost after Ray ended its job FAILED: the task is still interrupted.

Its own head (the elastic tests' kind): the fake provider counts a killed node as its own
(pending) for ever, so a head gives one launched node to kill, and the elastic tests' is
taken by theirs.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from datacenter_agent.ray_cluster.core import RayCore
from datacenter_agent.ray_cluster.groups import submission_id
from datacenter_agent.ray_cluster.launch import REPLICA_LOST
from federation.agent.elastic import Elastic
from federation.api.v1 import jobs_pb2
from federation.testing.ray_head import LocalRayHead

from .test_ray_core import FINAL, commit, gang, last, offer, until
from .test_ray_elastic import Reports, elastic_head, end_site, ray_nodes_of, start_site

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def head() -> Iterator[LocalRayHead]:
    yield from elastic_head()


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


def replica_worker(command: list[str]) -> int | None:
    """The pid of the Ray worker (the replica's actor) that runs ``command``, if one does."""
    wanted = [part.encode() for part in command]
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and (entry / "cmdline").read_bytes().split(b"\0")[:-1] == wanted
            ):
                return int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    return None


async def test_a_job_ray_failed_before_its_node_was_found_dead_is_interrupted(
    head: LocalRayHead, site: tuple[RayCore, Elastic, Reports]
) -> None:
    """The replica's actor dies first (its worker killed), so Ray ends the job FAILED while
    its node is alive; the raylet is killed only then: the task waits for Ray's word on the
    node, and ends CANCELLED and interrupted once the node is found dead, not FAILED."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    core, _, reports = site
    command = ["sleep", "117"]
    answer = await core.offer(offer("j-race", gang(command, replicas=1, a100s=2)))
    assert answer.accepted, answer.reason
    assert (await core.commit(commit("j-race", answer.reservation_id))).started
    running = jobs_pb2.JOB_STATE_RUNNING
    await until(
        lambda: (r := last(reports, "j-race")) is not None and r.state == running,
        "running on the launched node",
        timeout_s=60,
    )
    ray_id = {n.name: n for n in core.nodes()}["a100x2-0"].labels["ray_node_id"]
    await until(lambda: replica_worker(command) is not None, "the replica's process")
    worker = replica_worker(command)
    assert worker is not None
    os.kill(worker, signal.SIGKILL)
    jobs, sid = JobSubmissionClient(head.dashboard), submission_id("elastic", ("j-race", "main", 1))
    await until(lambda: jobs.get_job_status(sid) == JobStatus.FAILED, "FAILED in Ray")
    assert jobs.get_job_info(sid).driver_exit_code == REPLICA_LOST
    assert ray_id in {n["NodeID"] for n in ray_nodes_of("a100x2")}  # alive yet
    await asyncio.sleep(1.0)  # the core has read the job's end by now
    waiting = last(reports, "j-race")
    assert waiting is not None
    assert waiting.state == running
    head.kill_node(ray_id)
    await until(
        lambda: (r := last(reports, "j-race")) is not None and r.state in FINAL,
        "the task ended",
        timeout_s=30,
    )
    report = last(reports, "j-race")
    assert report is not None
    assert (report.state, report.interrupted) == (jobs_pb2.JOB_STATE_CANCELLED, True), report
    assert report.reason.startswith("node a100x2-0 was taken back by its provider"), report
    assert "lost: ActorDiedError" in report.output_tail
