"""Preemption over real agents: an urgent job stops lower-priority work to start; each victim
is stopped whole (every replica of a gang), goes back to PENDING by itself, restarts from its
newest checkpoint and finishes exactly once."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2, queues_pb2
from federation.local import LocalFederation

from .conftest import admin, gpu_site, jobs, running, spec, until, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-preemption")

SITE = gpu_site("gpu-p", 2, kill_grace_s=5.0)
RUNNING = jobs_pb2.JOB_STATE_RUNNING
SUCCEEDED = jobs_pb2.JOB_STATE_SUCCEEDED
RECLAIM_MIN_RUN_S = 3.0

# Counts steps, a checkpoint per step, from the restored step on; stops at the file "go".
# Markers: start-TAG holds where it restored from, stopped-TAG when SIGTERM came, done-TAG.
TASK = """
import os, signal, sys, time
def mark(folder, name, text):  # whole: a test reads a marker the moment it appears
    temporary = os.path.join(os.path.dirname(folder), "." + name)
    open(temporary, "w").write(text)
    os.rename(temporary, os.path.join(folder, name))
markers = sys.argv[1]
tag = "-".join(os.environ[k] for k in ("FEDERATION_JOB_ID", "FEDERATION_EPOCH",
                                       "FEDERATION_REPLICA")).replace(":", "_")
def stop(*_):
    open(os.path.join(markers, "stopped-" + tag), "w").close()
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
folder = os.environ["FEDERATION_CHECKPOINT_DIR"]
restore = os.environ.get("FEDERATION_RESTORE_FROM", "")
step = int(open(restore).read()) if restore else 0
mark(markers, "start-" + tag, restore)
while not os.path.exists(os.path.join(markers, "go")):
    step += 1
    if os.environ["FEDERATION_REPLICA"] == "0":
        name = os.path.join(folder, "step-%04d" % step)
        open(name, "w").write(str(step))
        open(name + ".done", "w").close()
    time.sleep(0.2)
mark(markers, "done-" + tag, str(step))
"""


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    root = tmp_path_factory.mktemp("preemption")
    config = root / "coordinator.toml"
    config.write_text(
        "preemption_min_run_s = 0.0\n"
        f"reclaim_min_run_s = {RECLAIM_MIN_RUN_S}\n"
        "[priority_classes.urgent]\nvalue = 900\nmay_preempt = true\npreemptible = false\n"
        "[priority_classes.batch]\nvalue = -100\n"
    )
    with running(root / "fed", [SITE], ["--config", str(config)]) as fed:
        yield fed


def batch_job(job_id: str, markers: Path, replicas: int = 1) -> jobs_pb2.JobSpec:
    task = {
        "name": "t",
        "command": [sys.executable, "-c", TASK, str(markers)],
        "replicas": replicas,
        "resources": {"accelerator": {"kind": "GPU", "count": 1}},
        "checkpoint": {"interval_s": 0.2},
    }
    return spec(job_id, [task], id=job_id, priority_class="batch")


def urgent_job(job_id: str) -> jobs_pb2.JobSpec:
    task = {
        "name": "t",
        "command": [sys.executable, "-c", "import time; time.sleep(1)"],
        "resources": {"accelerator": {"kind": "GPU", "count": 1}},
    }
    return spec(job_id, [task], id=job_id, priority_class="urgent")


async def get(channel: grpc.aio.Channel, job_id: str) -> jobs_pb2.Job:
    reply = await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
    return reply.job


async def checkpointed(channel: grpc.aio.Channel, *job_ids: str) -> None:
    async def all_have() -> bool:
        for job_id in job_ids:
            task = (await get(channel, job_id)).tasks[0]
            if task.state != RUNNING or not task.checkpoint.path:
                return False
        return True

    await until(all_have, f"{job_ids} running with a checkpoint")


def markers_of(folder: Path, kind: str, job_id: str) -> list[Path]:
    return sorted(folder.glob(f"{kind}-{job_id}-*"))


async def test_an_urgent_job_preempts_and_the_victim_restarts_from_its_checkpoint(
    operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    stub = jobs(operator)
    for job_id in ("low-a", "low-b"):
        await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=batch_job(job_id, tmp_path)))
    await checkpointed(operator, "low-a", "low-b")
    submitted = time.monotonic()
    await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=urgent_job("urgent-1")))
    urgent = await wait_for_job(operator, "urgent-1")
    assert urgent.state == SUCCEEDED
    assert time.monotonic() - submitted < 5.0 + 10  # the victim's grace, and some margin
    victims = [
        job_id
        for job_id in ("low-a", "low-b")
        if (await get(operator, job_id)).tasks[0].preemptions == 1
    ]
    assert len(victims) == 1  # one GPU was needed: one task stopped, not both
    (victim,) = victims
    (tmp_path / "go").touch()
    for job_id in ("low-a", "low-b"):
        assert (await wait_for_job(operator, job_id)).state == SUCCEEDED
    reply = await jobs(operator).GetJob(
        job_service_pb2.GetJobRequest(job_id=victim, include_events=True)
    )
    reasons = [e.reason for e in reply.events]
    assert any(r.startswith("preempted by a job of priority 900") for r in reasons), reasons
    assert not any("urgent-1" in r for r in reasons)  # no other job is named to its tenant
    starts = markers_of(tmp_path, "start", victim)
    assert len(starts) == 2
    assert starts[0].read_text() == ""  # first start: fresh
    assert "step-" in starts[1].read_text()  # the restart: from its checkpoint
    assert len(markers_of(tmp_path, "stopped", victim)) == 1
    assert len(markers_of(tmp_path, "done", victim)) == 1  # finished exactly once
    other = "low-b" if victim == "low-a" else "low-a"
    assert len(markers_of(tmp_path, "start", other)) == 1  # never stopped
    assert (await get(operator, other)).tasks[0].preemptions == 0


async def test_a_gang_is_preempted_whole(operator: grpc.aio.Channel, tmp_path: Path) -> None:
    stub = jobs(operator)
    gang = batch_job("gang", tmp_path, replicas=2)
    await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=gang))
    await checkpointed(operator, "gang")
    await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=urgent_job("urgent-2")))
    assert (await wait_for_job(operator, "urgent-2")).state == SUCCEEDED
    stopped = markers_of(tmp_path, "stopped", "gang")
    assert [p.name.rsplit("-", 1)[1] for p in stopped] == ["0", "1"]  # both replicas
    (tmp_path / "go").touch()
    done = await wait_for_job(operator, "gang")
    assert done.state == SUCCEEDED
    assert done.tasks[0].preemptions == 1
    assert len(markers_of(tmp_path, "done", "gang")) == 2  # each replica once, after restart


async def test_a_queue_takes_back_the_quota_another_borrowed(
    operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """team-l borrows the GPU that is team-o's nominal quota; when team-o submits, one of
    team-l's tasks is stopped to give it back (once it has run ``reclaim_min_run_s``, though
    priority preemption here needs no time), and restarts from its checkpoint later."""
    stub = admin(operator)
    for name, tenant, borrow in (("lend", "team-l", 1.0), ("own", "team-o", 0.0)):
        quota = queues_pb2.Quota(resource="gpu", nominal=1, borrowing_limit=borrow)
        await stub.CreateQueue(
            admin_service_pb2.CreateQueueRequest(
                queue=queues_pb2.Queue(name=name, tenant=tenant, quotas=[quota])
            )
        )
    for job_id in ("lend-1", "lend-2"):
        job = batch_job(job_id, tmp_path)
        job.tenant, job.queue = "team-l", "lend"
        await jobs(operator).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))
    lent = ("team-l:lend-1", "team-l:lend-2")  # a tenant's chosen ids are its own
    await checkpointed(operator, *lent)  # one of them on borrowed quota
    owed = urgent_job("owed")
    owed.tenant, owed.queue, owed.priority_class = "team-o", "own", ""
    await jobs(operator).SubmitJob(job_service_pb2.SubmitJobRequest(spec=owed))
    assert (await wait_for_job(operator, "team-o:owed")).state == SUCCEEDED
    stopped = [(await get(operator, j)).tasks[0].preemptions for j in lent]
    assert sorted(stopped) == [0, 1]
    victim = lent[stopped.index(1)].replace(":", "_")
    [first_start, *_] = markers_of(tmp_path, "start", victim)
    [sigterm] = markers_of(tmp_path, "stopped", victim)
    ran_s = sigterm.stat().st_mtime - first_start.stat().st_mtime
    assert ran_s >= RECLAIM_MIN_RUN_S - 0.2, f"reclaimed after {ran_s:.2f} s"
    (tmp_path / "go").touch()
    for job_id in lent:
        assert (await wait_for_job(operator, job_id)).state == SUCCEEDED


async def test_urgent_jobs_at_once_each_stop_their_own_victim(
    operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """Two urgent jobs submitted together choose different victims in the same pass (each
    chooses once while it waits), so both victims are stopped and both urgent jobs run."""
    stub = jobs(operator)
    for job_id in ("pair-a", "pair-b"):
        await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=batch_job(job_id, tmp_path)))
    await checkpointed(operator, "pair-a", "pair-b")
    urgent = [urgent_job("both-1"), urgent_job("both-2")]
    await stub.SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=urgent))
    done = [await wait_for_job(operator, job_id) for job_id in ("both-1", "both-2")]
    assert all(job.state == SUCCEEDED for job in done)
    assert [(await get(operator, j)).tasks[0].preemptions for j in ("pair-a", "pair-b")] == [1, 1]
    (tmp_path / "go").touch()
    for job_id in ("pair-a", "pair-b"):
        assert (await wait_for_job(operator, job_id)).state == SUCCEEDED
