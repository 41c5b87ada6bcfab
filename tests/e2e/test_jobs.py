"""Jobs through a real federation: placement by fit, real processes, failure, cancel, cordon."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2
from federation.common import job_state
from federation.coordinator.server import SERVICE_NAMES
from federation.listing import list_sites
from federation.local import LocalFederation
from federation.watch import events_of

from .conftest import admin, jobs, python_task, spec, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-jobs")

PRINT_DEVICES = (
    "import os; print('DEV', os.environ['FEDERATION_DEVICES'], "
    "os.environ.get('CUDA_VISIBLE_DEVICES'), os.environ.get('ASCEND_RT_VISIBLE_DEVICES'))"
)


async def submit(channel: grpc.aio.Channel, job: jobs_pb2.JobSpec) -> jobs_pb2.Job:
    return (await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))).job


@pytest.mark.parametrize(
    ("accelerator", "site", "env_value"),
    [
        ({"kind": "NPU", "count": 1}, "edge-a", "ASCEND"),
        ({"kind": "GPU", "count": 2, "models": ["H100-80GB"]}, "cloud-a", "CUDA"),
        ({"kind": "GPU", "count": 3}, "dc-a", "CUDA"),
    ],
)
async def test_job_runs_where_its_accelerator_is(
    operator: grpc.aio.Channel, accelerator: dict[str, object], site: str, env_value: str
) -> None:
    """A job lands on the only site with the devices it asks for and sees them in its env."""
    job = await submit(
        operator,
        spec(
            f"fit-{site}",
            [
                python_task(
                    "main",
                    PRINT_DEVICES,
                    resources={"cpu": 1, "memory_mib": 256, "accelerator": accelerator},
                )
            ],
        ),
    )
    done = await wait_for_job(operator, job.id)
    task = done.tasks[0]
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, task.reason
    assert task.site == site
    assert len(task.devices) == accelerator["count"]
    count = int(str(accelerator["count"]))
    line = next(x for x in task.output_tail.splitlines() if x.startswith("DEV"))
    _, devices, cuda, ascend = line.split(" ")
    visible = ascend if env_value == "ASCEND" else cuda
    assert len(visible.split(",")) == count
    assert devices.count(":") == 2 * count


async def test_constraint_picks_the_domain(operator: grpc.aio.Channel) -> None:
    """A CPU job constrained to the edge domain runs at the edge site."""
    job = await submit(
        operator,
        spec("edge-only", [python_task("t", "print('hi')")], constraints={"domains": ["edge"]}),
    )
    done = await wait_for_job(operator, job.id)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED
    assert done.tasks[0].site == "edge-a"
    assert "hi" in done.tasks[0].output_tail


async def test_failing_job_reports_exit_code_and_output(operator: grpc.aio.Channel) -> None:
    """A non-zero exit makes the job FAILED with the exit code and the tail of its output."""
    job = await submit(
        operator, spec("fails", [python_task("t", "print('about to fail'); raise SystemExit(7)")])
    )
    done = await wait_for_job(operator, job.id)
    assert done.state == jobs_pb2.JOB_STATE_FAILED
    assert done.tasks[0].exit_code == 7
    assert "about to fail" in done.tasks[0].output_tail


async def test_multi_task_job_waits_for_every_task(operator: grpc.aio.Channel) -> None:
    """A job with tasks in two domains succeeds only once both tasks have."""
    job = await submit(
        operator,
        spec(
            "two-tasks",
            [
                python_task(
                    "npu", "print(1)", resources={"accelerator": {"kind": "NPU", "count": 1}}
                ),
                python_task(
                    "h100",
                    "print(2)",
                    resources={"accelerator": {"kind": "GPU", "count": 1, "models": ["H100-80GB"]}},
                ),
            ],
        ),
    )
    done = await wait_for_job(operator, job.id)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED
    assert {t.name: t.site for t in done.tasks} == {"npu": "edge-a", "h100": "cloud-a"}


async def test_cancel_stops_the_running_process(operator: grpc.aio.Channel, tmp_path: Path) -> None:
    """Cancelling a running job signals its process, which is gone afterwards."""
    pid_file = tmp_path / "pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    job = await submit(operator, spec("sleeper", [python_task("t", code)]))
    await wait_for_job(operator, job.id, frozenset({jobs_pb2.JOB_STATE_RUNNING}))
    for _ in range(200):  # RUNNING is reported at spawn; wait until the child has really begun
        if pid_file.exists() and pid_file.read_text():
            break
        await asyncio.sleep(0.05)
    stub = jobs(operator)
    await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=job.id, reason="test says stop"))
    done = await wait_for_job(operator, job.id)
    assert done.state == jobs_pb2.JOB_STATE_CANCELLED
    assert done.tasks[0].reason == "test says stop"
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_job_that_fits_nowhere_stays_pending_with_reasons(
    operator: grpc.aio.Channel,
) -> None:
    """A job too big for every site stays PENDING and names each site's problem."""
    job = await submit(
        operator,
        spec(
            "too-big",
            [python_task("t", "print()", resources={"accelerator": {"kind": "GPU", "count": 9}})],
        ),
    )
    pending = await wait_for_job(
        operator, job.id, frozenset({jobs_pb2.JOB_STATE_PENDING}), timeout_s=10
    )
    for _ in range(100):  # verdicts are written once the scheduler has looked at the job
        if pending.tasks[0].verdicts:
            break
        await asyncio.sleep(0.05)
        pending = (await jobs(operator).GetJob(job_service_pb2.GetJobRequest(job_id=job.id))).job
    verdicts = {v.site: v for v in pending.tasks[0].verdicts}
    assert set(verdicts) == {"edge-a", "dc-a", "cloud-a"}
    assert all(v.stage == "CapacityFit" for v in verdicts.values())
    assert "9xGPU" in verdicts["dc-a"].reason
    await jobs(operator).CancelJob(job_service_pb2.CancelJobRequest(job_id=job.id))
    assert (await wait_for_job(operator, job.id)).state == jobs_pb2.JOB_STATE_CANCELLED


async def test_cordoned_site_takes_no_work_until_uncordoned(
    operator: grpc.aio.Channel, federation: LocalFederation
) -> None:
    """A job for a cordoned site waits with the reason, and runs once the site is uncordoned."""
    ops = admin(operator)
    await ops.CordonSite(admin_service_pb2.CordonSiteRequest(site="edge-a"))
    try:
        job = await submit(
            operator,
            spec("waits", [python_task("t", "print()")], constraints={"sites": ["edge-a"]}),
        )
        for _ in range(100):  # verdicts are written once the scheduler has looked at the job
            current = (
                await jobs(operator).GetJob(job_service_pb2.GetJobRequest(job_id=job.id))
            ).job
            if current.tasks[0].verdicts:
                break
            await asyncio.sleep(0.05)
        assert current.state == jobs_pb2.JOB_STATE_PENDING
        edge = next(v for v in current.tasks[0].verdicts if v.site == "edge-a")
        assert edge.reason == "site is cordoned"
    finally:
        await ops.UncordonSite(admin_service_pb2.UncordonSiteRequest(site="edge-a"))
    done = await wait_for_job(operator, job.id)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED
    assert done.tasks[0].site == "edge-a"


async def test_every_transition_is_recorded_and_watched(operator: grpc.aio.Channel) -> None:
    """Each step PENDING..SUCCEEDED is stored as an event, numbered, and streamed to watchers."""
    job = await submit(operator, spec("watched", [python_task("t", "print()")]))
    stub = jobs(operator)
    watch = stub.WatchJobs(job_service_pb2.WatchJobsRequest(job_ids=[job.id], include_current=True))
    streamed: list[int] = []
    async for event in events_of(watch):
        streamed.append(event.sequence)
        if job_state.is_terminal(event.job_state):
            break
    watch.cancel()
    recorded = await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job.id, include_events=True))
    sequences = [e.sequence for e in recorded.events]
    assert sequences == list(range(1, len(sequences) + 1))
    states = [e.job_state for e in recorded.events]
    expected = [
        jobs_pb2.JOB_STATE_PENDING,  # offers need no write: it stays PENDING until one is taken
        jobs_pb2.JOB_STATE_DELEGATED,
        jobs_pb2.JOB_STATE_RUNNING,
        jobs_pb2.JOB_STATE_SUCCEEDED,
    ]
    assert [s for i, s in enumerate(states) if i == 0 or s != states[i - 1]] == expected
    # The stream starts from the state at subscription (sequence 0), then follows the record.
    assert streamed[0] == 0
    assert streamed[1:] == sequences[len(sequences) - len(streamed) + 1 :]


async def test_batch_submit_and_paged_listing(operator: grpc.aio.Channel) -> None:
    """SubmitJobs stores a whole batch; ListJobs pages through it without gaps or repeats."""
    stub = jobs(operator)
    specs = [
        spec(f"batch-{i}", [python_task("t", "print()")], labels={"batch": "b1"}) for i in range(7)
    ]
    reply = await stub.SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=specs))
    ids = {j.id for j in reply.jobs}
    assert len(ids) == 7
    listed: list[str] = []
    token = ""
    while True:
        page = await stub.ListJobs(job_service_pb2.ListJobsRequest(page_size=3, page_token=token))
        listed += [j.id for j in page.jobs]
        token = page.next_page_token
        if not token:
            break
    assert len(listed) == len(set(listed))
    assert ids <= set(listed)
    for job_id in ids:
        assert (await wait_for_job(operator, job_id)).state == jobs_pb2.JOB_STATE_SUCCEEDED
    succeeded = await stub.ListJobs(
        job_service_pb2.ListJobsRequest(states=[jobs_pb2.JOB_STATE_SUCCEEDED], page_size=1000)
    )
    assert ids <= {j.id for j in succeeded.jobs}
    assert all(j.state == jobs_pb2.JOB_STATE_SUCCEEDED for j in succeeded.jobs)


async def test_status_shows_sites_and_declared_devices(operator: grpc.aio.Channel) -> None:
    """GetFederationStatus counts the connected sites; ListSites shows each with its declared
    devices marked."""
    status = await admin(operator).GetFederationStatus(
        admin_service_pb2.GetFederationStatusRequest()
    )
    assert dict(status.sites_by_state) == {"SITE_STATE_CONNECTED": 3}
    assert status.sites_cordoned == 0
    sites = {s.name: s for s in await list_sites(admin(operator))}
    assert set(sites) == {"edge-a", "dc-a", "cloud-a"}
    assert all(s.state == admin_service_pb2.SITE_STATE_CONNECTED for s in sites.values())
    devices = [d for n in sites["dc-a"].view.nodes for d in n.devices]
    assert len(devices) == 4
    assert all(d.provenance == 2 for d in devices)  # PROVENANCE_DECLARED
    assert sites["cloud-a"].view.price_per_device_hour == 3.0


async def test_health_reports_the_lone_coordinator_serving(operator: grpc.aio.Channel) -> None:
    """With the embedded store the coordinator leads: Check and Watch say SERVING throughout."""
    health = health_pb2_grpc.HealthStub(operator)
    for service in ("", *SERVICE_NAMES):
        request = health_pb2.HealthCheckRequest(service=service)
        assert (await health.Check(request)).status == health_pb2.HealthCheckResponse.SERVING
        stream = health.Watch(request)
        first = await anext(aiter(stream))
        stream.cancel()
        assert first.status == health_pb2.HealthCheckResponse.SERVING, service
