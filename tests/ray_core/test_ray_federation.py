"""End to end: a coordinator, a Ray site agent and an embedded site's agent as processes; gangs
run by a real Ray head, and a pipeline across both sites."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    job_service_pb2,
    job_service_pb2_grpc,
    jobs_pb2,
    resources_pb2,
)
from federation.jobspec import job_spec_from_dict
from federation.local import LocalFederation, SiteSpec
from federation.testing.ray_head import LocalRayHead
from federation.watch import events_of

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(240)]

SITE = "dc-ray"
EMBEDDED = "dc-fpga"
"""An embedded site with one declared FPGA and no GPU: a task that asks for an FPGA runs there."""
WAIT_S = 60.0
KILL_GRACE_S = 2.0
"""What LocalFederation gives its agents."""
TERMINAL = (jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED)


FPGA_NODE = {
    "name": "fpga-box",
    "cpu_cores": 4,
    "memory_mib": 8192,
    "devices": [{"kind": "FPGA", "vendor": "xilinx", "model": "U250", "count": 1}],
}


@pytest.fixture(scope="module")
def federation(
    ray_head: LocalRayHead, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalFederation]:
    """A coordinator, a site whose core is the Ray head (declared A100s), and an embedded site
    with one FPGA."""
    ray = {
        "address": ray_head.address,
        "dashboard": ray_head.dashboard,
        "python": sys.executable,
        "poll_interval_s": 0.25,
        "devices": {"GPU_A100": {"model": "A100-80GB", "memory_mib": 81920, "declared": True}},
    }
    fed = LocalFederation(
        tmp_path_factory.mktemp("fed"),
        [
            SiteSpec(SITE, "datacenter", settings={"scheduler": "ray", "ray": ray}),
            SiteSpec(EMBEDDED, "datacenter", nodes=[FPGA_NODE]),
        ],
    )
    try:
        asyncio.run(fed.start())
        yield fed
    finally:
        fed.stop()


@pytest.fixture
async def operator(federation: LocalFederation) -> AsyncIterator[grpc.aio.Channel]:
    async with federation.operator().channel() as channel:
        yield channel


async def site_view(channel: grpc.aio.Channel) -> resources_pb2.SiteView:
    stub = admin_service_pb2_grpc.AdminServiceStub(channel)
    reply = await stub.ListSites(admin_service_pb2.ListSitesRequest())
    return next(site.view for site in reply.sites if site.name == SITE)


async def test_gang_of_two_a100_replicas_runs_on_ray(operator: grpc.aio.Channel) -> None:
    """The site publishes Ray's declared A100s; a 2-replica gang runs there and succeeds."""
    view = await site_view(operator)
    a100s = [d for n in view.nodes for d in n.devices if d.model == "A100-80GB"]
    assert len(a100s) == 2
    assert {d.provenance for d in a100s} == {resources_pb2.PROVENANCE_DECLARED}
    code = (
        "import os; "
        "print('replica', os.environ['FEDERATION_REPLICA'], os.environ['FEDERATION_DEVICES'])"
    )
    task = {
        "name": "main",
        "command": [sys.executable, "-c", code],
        "replicas": 2,
        "resources": {
            "cpu": 0.5,
            "memory_mib": 128,
            "accelerator": {"kind": "GPU", "count": 1, "models": ["A100-80GB"]},
        },
    }
    spec = job_spec_from_dict({"name": "ray-gang", "tasks": [task]})
    stub = job_service_pb2_grpc.JobServiceStub(operator)
    job_id = (await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec))).job.id

    async def follow() -> jobs_pb2.Job:
        request = job_service_pb2.WatchJobsRequest(job_ids=[job_id], include_current=True)
        async for event in events_of(stub.WatchJobs(request)):
            if event.job_state in TERMINAL:
                break
        return (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job

    job = await asyncio.wait_for(follow(), WAIT_S)
    [done] = job.tasks
    assert (job.state, done.site) == (jobs_pb2.JOB_STATE_SUCCEEDED, SITE), done.reason
    assert sorted(d.rsplit(":", 1)[1] for d in done.devices) == ["GPU_A100-0", "GPU_A100-1"]
    assert "[replica 0] replica 0" in done.output_tail
    assert "[replica 1] replica 1" in done.output_tail


async def test_a_pipeline_runs_across_an_embedded_site_and_the_ray_site(
    operator: grpc.aio.Channel,
) -> None:
    """prep needs an FPGA (the embedded site), train an A100 (Ray's) once prep succeeded:
    each runs at its site, train only after prep ended."""
    py = sys.executable
    tasks = [
        {
            "name": "prep",
            "command": [py, "-c", "print('prepared')"],
            "resources": {"cpu": 0.5, "accelerator": {"kind": "FPGA", "count": 1}},
        },
        {
            "name": "train",
            "command": [py, "-c", "print('trained')"],
            "depends_on": ["prep"],
            "resources": {
                "cpu": 0.5,
                "accelerator": {"kind": "GPU", "count": 1, "models": ["A100-80GB"]},
            },
        },
    ]
    spec = job_spec_from_dict({"name": "across", "tasks": tasks})
    stub = job_service_pb2_grpc.JobServiceStub(operator)
    job_id = (await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec))).job.id
    job = await until_state(stub, job_id, TERMINAL)
    done = {t.name: t for t in job.tasks}
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, [t.reason for t in job.tasks]
    assert (done["prep"].site, done["train"].site) == (EMBEDDED, SITE)
    assert "prepared" in done["prep"].output_tail
    assert "trained" in done["train"].output_tail
    prep_end = done["prep"].finished_at.ToNanoseconds()
    assert done["train"].started_at.ToNanoseconds() >= prep_end


def one_a100_task(code: str) -> jobs_pb2.JobSpec:
    task = {
        "name": "main",
        "command": [sys.executable, "-c", code],
        "resources": {"cpu": 0.5, "accelerator": {"kind": "GPU", "count": 1}},
    }
    return job_spec_from_dict({"name": "ray-one", "tasks": [task]})


async def until_state(
    stub: job_service_pb2_grpc.JobServiceStub, job_id: str, states: tuple[int, ...]
) -> jobs_pb2.Job:
    async def follow() -> jobs_pb2.Job:
        request = job_service_pb2.WatchJobsRequest(job_ids=[job_id], include_current=True)
        async for event in events_of(stub.WatchJobs(request)):
            if event.job_state in states:
                break
        return (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job

    return await asyncio.wait_for(follow(), WAIT_S)


async def test_cancel_runs_the_tasks_sigterm_handler(
    operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """Cancelling through the coordinator stops the Ray job: the task's handler runs."""
    started, saved = tmp_path / "started", tmp_path / "saved"
    code = (
        "import pathlib, signal, sys, time\n"
        f"def term(*_): pathlib.Path({str(saved)!r}).write_text('saved'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        f"pathlib.Path({str(started)!r}).touch()\n"
        "while True: time.sleep(0.1)\n"
    )
    stub = job_service_pb2_grpc.JobServiceStub(operator)
    job_id = (
        await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=one_a100_task(code)))
    ).job.id
    await until_state(stub, job_id, (jobs_pb2.JOB_STATE_RUNNING,))
    deadline = time.monotonic() + WAIT_S
    while not started.exists():
        assert time.monotonic() < deadline, "the task never started"
        await asyncio.sleep(0.05)
    began = time.monotonic()
    await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id))
    job = await until_state(stub, job_id, TERMINAL)
    took = time.monotonic() - began
    assert job.state == jobs_pb2.JOB_STATE_CANCELLED
    assert saved.read_text() == "saved"
    assert took < KILL_GRACE_S + 2.0, took


async def test_restarted_agent_adopts_the_running_ray_job(
    federation: LocalFederation, operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """An agent killed while its task runs in Ray comes back and reports the task's end."""
    gate = tmp_path / "go"
    code = (
        "import pathlib, time\n"
        f"while not pathlib.Path({str(gate)!r}).exists(): time.sleep(0.1)\n"
        "print('adopted and done')\n"
    )
    stub = job_service_pb2_grpc.JobServiceStub(operator)
    job_id = (
        await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=one_a100_task(code)))
    ).job.id
    await until_state(stub, job_id, (jobs_pb2.JOB_STATE_RUNNING,))
    federation.kill(SITE)
    [site] = [s for s in federation.sites if s.name == SITE]
    await federation.start_site(site)
    await federation.wait_connected([SITE])
    gate.touch()
    job = await until_state(stub, job_id, TERMINAL)
    [done] = job.tasks
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
    assert "adopted and done" in done.output_tail
