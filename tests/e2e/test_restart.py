"""Killing the coordinator with SIGKILL mid-run loses no accepted job and runs none twice; an
agent restarted with SIGTERM adopts its running task, which an agent killed with SIGKILL takes
with it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.local import LocalFederation

from .conftest import SITES, jobs, python_task, read_marker, spec, until, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-restart")


async def started_pid(starts: Path) -> int:
    """The pid the task wrote in ``starts`` once it started (one line, one start)."""

    async def started() -> bool:
        return bool(read_marker(starts))

    await until(started, "the task to start", timeout_s=10)
    [pid] = (int(line) for line in read_marker(starts))
    return pid


@pytest.fixture
def fed(tmp_path: Path) -> Iterator[LocalFederation]:
    federation = LocalFederation(tmp_path / "fed", SITES)
    try:
        yield federation
    finally:
        federation.stop()


async def test_coordinator_sigkill_mid_run(fed: LocalFederation, tmp_path: Path) -> None:
    """Jobs accepted before a SIGKILL all finish after the restart, each exactly once."""
    await fed.start()
    markers = tmp_path / "markers"
    markers.mkdir()
    # Each run appends its job name to its own marker file: two lines would mean two runs.
    code = (
        "import os, sys, time; time.sleep(float(sys.argv[1])); "
        f"open(os.path.join({str(markers)!r}, sys.argv[2]), 'a').write(sys.argv[2] + '\\n')"
    )
    specs = []
    for i in range(6):
        task = python_task("t", code, resources={"cpu": 1, "memory_mib": 64})
        task["command"] = [*task["command"], "3" if i % 2 else "0.2", f"job{i}"]  # type: ignore[misc]
        specs.append(spec(f"job{i}", [task]))
    async with fed.operator().channel() as channel:
        reply = await jobs(channel).SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=specs))
        ids = [j.id for j in reply.jobs]
        # Wait until the long jobs run, so the kill lands while they are in flight.
        for job_id in ids[1::2]:
            await wait_for_job(channel, job_id, frozenset({jobs_pb2.JOB_STATE_RUNNING}))
    fed.kill("coordinator")
    await fed.start_coordinator(port=fed.port, join_port=fed.join_port)
    await fed.wait_connected()
    async with fed.operator().channel() as channel:
        for job_id in ids:
            done = await wait_for_job(channel, job_id)
            assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, (job_id, done.reason)
        listed = await jobs(channel).ListJobs(job_service_pb2.ListJobsRequest(page_size=100))
    assert {j.id for j in listed.jobs} == set(ids)
    for i in range(6):
        assert read_marker(markers / f"job{i}") == [f"job{i}"], (
            f"job{i} ran a wrong number of times"
        )
    assert fed.terminate("coordinator", 5.0), "the restarted coordinator ignored SIGTERM"


async def test_agent_sigkill_takes_its_tasks_and_they_run_again(
    fed: LocalFederation, tmp_path: Path
) -> None:
    """A SIGKILLed agent's task processes die with it; the task reruns once, at a new epoch."""
    await fed.start()
    pid_file, marker = tmp_path / "pid", tmp_path / "marker"
    code = (
        "import os, sys, time\n"
        f"pid_file = {str(pid_file)!r}\n"
        "if not os.path.exists(pid_file): open(pid_file, 'w').write(str(os.getpid()))\n"
        "time.sleep(float(sys.argv[1]))\n"
        f"open({str(marker)!r}, 'a').write('done\\n')\n"
    )
    task = python_task("t", code, resources={"accelerator": {"kind": "NPU", "count": 1}})
    task["command"] = [*task["command"], "2"]  # type: ignore[misc]
    async with fed.operator().channel() as channel:
        job = (
            await jobs(channel).SubmitJob(
                job_service_pb2.SubmitJobRequest(spec=spec("survivor", [task]))
            )
        ).job
        await wait_for_job(channel, job.id, frozenset({jobs_pb2.JOB_STATE_RUNNING}))
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text():
                break
            await asyncio.sleep(0.05)
        else:
            got = await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job.id))
            raise AssertionError(f"the task never started: {got.job}")
        first_pid = int(pid_file.read_text())
        fed.kill("edge-a")
        for _ in range(200):  # the kernel delivers the parent-death signal at once
            if not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == "zombie":
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the task outlived its agent")
        await fed.start_site(SITES[0])
        done = await wait_for_job(channel, job.id)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
    assert done.tasks[0].epoch >= 2
    assert read_marker(marker) == ["done"]


async def test_agent_sigterm_and_restart_adopts_its_running_task(tmp_path: Path) -> None:
    """SIGTERM and restart an agent under a running task: the same process (same pid) goes on
    and finishes, at the same epoch, and the job succeeds; the task ran once."""
    site = dataclasses.replace(SITES[0], settings={"stop_tasks_on_exit": False})
    fed = LocalFederation(tmp_path / "fed", [site])
    starts, marker, go = tmp_path / "starts", tmp_path / "marker", tmp_path / "go"
    code = (
        "import os, time\n"
        f"open({str(starts)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
        f"open({str(marker)!r}, 'a').write(f'done {{os.getpid()}}\\n')\n"
        "print('finished', os.getpid())\n"
    )
    task = python_task("t", code, resources={"accelerator": {"kind": "NPU", "count": 1}})
    try:
        await fed.start()
        async with fed.operator().channel() as channel:
            job = (
                await jobs(channel).SubmitJob(
                    job_service_pb2.SubmitJobRequest(spec=spec("adopted", [task]))
                )
            ).job
            running = await wait_for_job(channel, job.id, frozenset({jobs_pb2.JOB_STATE_RUNNING}))
            pid = await started_pid(starts)
            assert fed.terminate(site.name), "the agent ignored SIGTERM"
            assert psutil.pid_exists(pid), "the task died with its agent"
            await fed.start_site(site)
            await fed.wait_connected()
            go.touch()
            done = await wait_for_job(channel, job.id)
        assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
        assert done.tasks[0].epoch == running.tasks[0].epoch
        assert done.tasks[0].moves == 0
        assert done.tasks[0].output_tail == f"finished {pid}\n"
        assert read_marker(starts) == [str(pid)], "the task started again"
        assert read_marker(marker) == ["done", str(pid)]
    finally:
        go.touch()  # its agent does not stop it
        fed.stop()


async def test_an_agent_that_stops_takes_its_at_most_once_tasks_with_it(tmp_path: Path) -> None:
    """A task of a job with disconnect.stop_after_s does not outlive its agent (once gone, the
    agent could not stop it before its replacement): it is stopped, reported interrupted and
    placed again at once, without using an attempt, and runs to its end once the site is back."""
    site = dataclasses.replace(SITES[0], settings={"stop_tasks_on_exit": False})
    fed = LocalFederation(tmp_path / "fed", [site])
    starts, go = tmp_path / "starts", tmp_path / "go"
    code = (
        "import os, time\n"
        f"open({str(starts)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
    )
    task = python_task("t", code, resources={"accelerator": {"kind": "NPU", "count": 1}})
    job_spec = spec("at-most-once", [task], disconnect={"lost_after_s": 60, "stop_after_s": 30})
    try:
        await fed.start()
        async with fed.operator().channel() as channel:
            stub = jobs(channel)
            job = (await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=job_spec))).job
            await wait_for_job(channel, job.id, frozenset({jobs_pb2.JOB_STATE_RUNNING}))
            pid = await started_pid(starts)
            assert fed.terminate(site.name), "the agent ignored SIGTERM"
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
            request = job_service_pb2.GetJobRequest(job_id=job.id, include_events=True)
            got = await stub.GetJob(request)
            assert got.job.tasks[0].state == jobs_pb2.JOB_STATE_PENDING, got.job.tasks[0].reason
            assert any(
                e.state == jobs_pb2.JOB_STATE_PENDING and "the agent is stopping" in e.reason
                for e in got.events
            ), [e.reason for e in got.events]
            await fed.start_site(site)
            go.touch()
            done = await wait_for_job(channel, job.id)
        assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
        assert done.tasks[0].failed_attempts == 0
        assert len(read_marker(starts)) == 2
    finally:
        go.touch()
        fed.stop()
