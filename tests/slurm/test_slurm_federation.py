"""End to end: a coordinator and Slurm site agents as processes, jobs run by a real Slurm."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from datacenter_agent.slurm.cli import parse_records
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
from federation.testing.slurm_cluster import LocalSlurmCluster
from federation.watch import events_of

from .conftest import GRES, MAX_MEM_PER_NODE_MIB, NODE, PARTITION
from .tasks import CHECKPOINTING, WAIT_S, eventually, until

pytestmark = pytest.mark.xdist_group("slurm")

SITE = "dc-slurm"
BROKEN = "dc-broken"
SUCCEEDED = jobs_pb2.JOB_STATE_SUCCEEDED
TERMINAL = (jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED)


def slurm_site(name: str, cluster: LocalSlurmCluster, partition: str) -> SiteSpec:
    slurm = {"partition": partition, "conf": cluster.conf, "poll_interval_s": 0.5, "gres": GRES}
    return SiteSpec(name, "datacenter", settings={"scheduler": "slurm", "slurm": slurm})


@pytest.fixture(scope="module")
def federation(
    slurm_cluster: LocalSlurmCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalFederation]:
    """A coordinator, a Slurm site on the test cluster, and one whose partition is wrong.
    Jobs of the class ``urgent`` may preempt others at once."""
    root = tmp_path_factory.mktemp("fed")
    config = root / "coordinator.toml"
    config.write_text(
        "preemption_min_run_s = 0.0\n"
        "[priority_classes.urgent]\nvalue = 900\nmay_preempt = true\npreemptible = false\n"
    )
    fed = LocalFederation(
        root,
        [slurm_site(SITE, slurm_cluster, PARTITION), slurm_site(BROKEN, slurm_cluster, "nope")],
        coordinator_args=["--config", str(config)],
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


def gpu_job(name: str, code: str, gpus: int = 1, **resources: object) -> jobs_pb2.JobSpec:
    """A one-task job running ``python -c code`` on ``gpus`` A100s."""
    task = {
        "name": "main",
        "command": [sys.executable, "-c", code],
        "resources": {
            "cpu": 1,
            "memory_mib": 256,
            "accelerator": {"kind": "GPU", "count": gpus, "models": ["A100-80GB"]},
            **resources,
        },
    }
    return job_spec_from_dict({"name": name, "tasks": [task]})


async def submit(channel: grpc.aio.Channel, spec: jobs_pb2.JobSpec) -> str:
    stub = job_service_pb2_grpc.JobServiceStub(channel)
    return (await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec))).job.id


async def wait_job(
    channel: grpc.aio.Channel, job_id: str, until: tuple[int, ...] = TERMINAL
) -> jobs_pb2.Job:
    """Follows WatchJobs until the job reaches a state in ``until``."""
    stub = job_service_pb2_grpc.JobServiceStub(channel)

    async def follow() -> jobs_pb2.Job:
        request = job_service_pb2.WatchJobsRequest(job_ids=[job_id], include_current=True)
        async for event in events_of(stub.WatchJobs(request)):
            if event.job_state in until:
                break
        return (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job

    return await asyncio.wait_for(follow(), WAIT_S)


async def site_view(channel: grpc.aio.Channel, name: str) -> resources_pb2.SiteView:
    stub = admin_service_pb2_grpc.AdminServiceStub(channel)
    reply = await stub.ListSites(admin_service_pb2.ListSitesRequest())
    return next(site.view for site in reply.sites if site.name == name)


async def until_view(
    channel: grpc.aio.Channel, name: str, nodes: list[str]
) -> resources_pb2.SiteView:
    """Polls the coordinator's view of a site until it lists exactly ``nodes``."""
    return await until(
        lambda: site_view(channel, name),
        lambda view: [n.name for n in view.nodes] == nodes,
        f"{name} showing nodes {nodes}",
    )


def slurm_jobs_of(cluster: LocalSlurmCluster, job_id: str) -> list[dict[str, str]]:
    """What Slurm lists of the federation job's Slurm jobs (found by their comment)."""
    records = parse_records(cluster.run("scontrol", "show", "job", "-o"))
    mark = f"federation:{SITE}:{job_id}:"
    return [dict(r.pairs) for r in records if r.value("Comment").startswith(mark)]


async def test_gpu_job_runs_under_slurm_and_reports_its_exit_code(
    operator: grpc.aio.Channel, slurm_cluster: LocalSlurmCluster
) -> None:
    """A GPU job is delegated to the Slurm site, runs as a Slurm job, and fails with its code."""
    code = (
        "import os, time; print('slurm job', os.environ['SLURM_JOB_ID'], "
        "'gpus', os.environ['CUDA_VISIBLE_DEVICES'], os.environ['FEDERATION_DEVICES']); "
        "time.sleep(1); raise SystemExit(3)"
    )
    job_id = await submit(operator, gpu_job("under-slurm", code))
    job = await wait_job(operator, job_id)
    [task] = job.tasks
    [slurm_job] = slurm_jobs_of(slurm_cluster, job_id)
    assert (job.state, task.site, task.exit_code) == (jobs_pb2.JOB_STATE_FAILED, SITE, 3)
    assert task.reason == f"Slurm job {slurm_job['JobId']} exited with 3 (FAILED)"
    assert (slurm_job["JobState"], slurm_job["ExitCode"]) == ("FAILED", "3:0")
    [device] = task.devices
    assert device.startswith(f"{NODE.name}:GPU:")
    index = device.rsplit(":", 1)[1]
    assert f"slurm job {slurm_job['JobId']} gpus {index} {device}" in task.output_tail


async def test_job_too_big_for_the_partition_is_declined_in_slurms_words(
    operator: grpc.aio.Channel, slurm_cluster: LocalSlurmCluster
) -> None:
    """Memory the node has but the partition's limit refuses is declined with Slurm's reason."""
    memory_mib = MAX_MEM_PER_NODE_MIB + 1000
    assert memory_mib < NODE.memory_mib  # the view shows room: only Slurm knows the limit
    job_id = await submit(operator, gpu_job("too-big", "pass", memory_mib=memory_mib))
    stub = job_service_pb2_grpc.JobServiceStub(operator)

    async def read() -> jobs_pb2.Job:
        return (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job

    def declined(job: jobs_pb2.Job) -> bool:
        return any(v.site == SITE and "declined" in v.reason for v in job.tasks[0].verdicts)

    try:
        job = await until(read, declined, f"declined by {SITE}")
        verdicts = {v.site: v.reason for v in job.tasks[0].verdicts}
        assert job.tasks[0].state == jobs_pb2.JOB_STATE_PENDING
        assert "Slurm: " in verdicts[SITE]
        assert "Memory required by task is not available" in verdicts[SITE]
        assert slurm_jobs_of(slurm_cluster, job_id) == []
    finally:
        await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id, reason="test over"))


async def test_cancel_reaches_scancel(
    operator: grpc.aio.Channel, slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    """Cancelling a running job signals its Slurm job (it checkpoints) and ends it in Slurm."""
    ready = tmp_path / "ready"
    code = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    print('checkpoint saved', flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "time.sleep(60)\n"
    )
    job_id = await submit(operator, gpu_job("cancel-me", code))
    await wait_job(operator, job_id, until=(jobs_pb2.JOB_STATE_RUNNING,))
    await eventually(ready.exists, "ready")  # the task itself, not just Slurm, is running
    [running] = slurm_jobs_of(slurm_cluster, job_id)
    assert running["JobState"] == "RUNNING"
    stub = job_service_pb2_grpc.JobServiceStub(operator)
    await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id, reason="operator says"))
    job = await wait_job(operator, job_id)
    [task] = job.tasks
    assert job.state == jobs_pb2.JOB_STATE_CANCELLED
    assert "checkpoint saved" in task.output_tail
    [ended] = slurm_jobs_of(slurm_cluster, job_id)
    assert ended["JobState"] in ("COMPLETED", "CANCELLED")


async def test_a_preempted_slurm_task_restarts_from_its_last_checkpoint(
    operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """An urgent job needs a GPU the Slurm job of a checkpointing task holds: the site sends
    it SIGTERM, reports the checkpoint it saves then, and the task goes back to PENDING; placed
    again (a new epoch, a new Slurm job), it restores from that checkpoint and finishes.

    The victim is not placed at the site again until the urgent job has started there
    (``test_the_preemptor_starts_before_its_victims_run_again``); both are awaited at the end.
    """
    markers = tmp_path / "markers"
    spec = gpu_job("victim", CHECKPOINTING, gpus=2)
    spec.tasks[0].env["MARKERS"] = str(markers)
    spec.tasks[0].checkpoint.interval_s = 0.2
    markers.mkdir()
    victim = await submit(operator, spec)
    stub = job_service_pb2_grpc.JobServiceStub(operator)

    async def read() -> jobs_pb2.Job:
        return (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=victim))).job

    def checkpointed(job: jobs_pb2.Job) -> bool:
        return job.tasks[0].state == jobs_pb2.JOB_STATE_RUNNING and bool(
            job.tasks[0].checkpoint.path
        )

    first = (await until(read, checkpointed, "victim running with a checkpoint")).tasks[0]
    urgent = gpu_job("urgent", "import time; time.sleep(1)")
    urgent.priority_class = "urgent"
    urgent_id = await submit(operator, urgent)

    def restarts() -> list[Path]:
        return [m for m in markers.glob("start-*") if m.name != f"start-{first.epoch}-0"]

    await eventually(lambda: bool(restarts()), "victim restarted")
    (markers / "go").touch()
    job = await wait_job(operator, victim)
    [task] = job.tasks
    assert job.state == SUCCEEDED, task.reason
    assert task.preemptions == 1
    assert (await wait_job(operator, urgent_id)).state == SUCCEEDED
    [restarted] = restarts()
    assert restarted.name == f"start-{task.epoch}-0"
    assert (markers / f"stopped-{first.epoch}-0").exists()  # SIGTERM came first
    saved = Path(restarted.read_text())
    assert saved.name == f"final-{first.epoch}-0"  # the checkpoint saved on SIGTERM
    assert saved.parent.parent.name == str(first.epoch)


async def test_drained_node_disappears_from_the_view(
    operator: grpc.aio.Channel, slurm_cluster: LocalSlurmCluster
) -> None:
    """A node drained in Slurm leaves the coordinator's view; resumed, it comes back."""
    await until_view(operator, SITE, [NODE.name])
    slurm_cluster.run("scontrol", "update", f"NodeName={NODE.name}", "State=DRAIN", "Reason=fan")
    try:
        await until_view(operator, SITE, [])
    finally:
        slurm_cluster.run("scontrol", "update", f"NodeName={NODE.name}", "State=RESUME")
    view = await until_view(operator, SITE, [NODE.name])
    assert [d.model for d in view.nodes[0].devices] == ["A100-80GB"] * 2


async def test_misconfigured_site_is_degraded(operator: grpc.aio.Channel) -> None:
    """A Slurm site whose partition does not exist shows degraded with Slurm's reason."""
    view = await site_view(operator, BROKEN)
    [node] = view.nodes
    assert view.scheduler == "slurm"
    assert not node.schedulable
    assert node.labels["health"] == "degraded"
    assert "Partition nope not found" in node.labels["health_reason"]


def test_example_site_spec_writes_a_slurm_config(
    federation: LocalFederation, slurm_cluster: LocalSlurmCluster
) -> None:
    """The agent's config file names the Slurm core and the cluster's slurm.conf."""
    text = (federation.root / "sites" / SITE / "agent.toml").read_text()
    assert 'scheduler = "slurm"' in text
    assert str(slurm_cluster.conf) in text
    assert Path(slurm_cluster.conf).is_file()


async def test_a_task_slurm_requeues_shows_waiting_until_it_runs_again(
    operator: grpc.aio.Channel, slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    """``scontrol requeue`` puts the running task's Slurm job back in Slurm's queue: the
    coordinator shows the task DELEGATED (waiting at the site, no devices) while Slurm holds it
    pending, and RUNNING again once Slurm starts it; it restores from its checkpoint."""
    markers = tmp_path / "markers"
    markers.mkdir()
    spec = gpu_job("requeued", CHECKPOINTING)
    spec.tasks[0].env["MARKERS"] = str(markers)
    spec.tasks[0].checkpoint.interval_s = 0.2
    job_id = await submit(operator, spec)
    stub = job_service_pb2_grpc.JobServiceStub(operator)

    async def read() -> jobs_pb2.TaskStatus:
        return (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job.tasks[0]

    first = await until(
        read,
        lambda t: t.state == jobs_pb2.JOB_STATE_RUNNING and bool(t.checkpoint.path),
        "running with a checkpoint",
    )
    assert first.devices
    [slurm_job] = slurm_jobs_of(slurm_cluster, job_id)
    slurm_cluster.run("scontrol", "requeue", slurm_job["JobId"])
    waiting = await until(
        read, lambda t: t.state == jobs_pb2.JOB_STATE_DELEGATED, "waiting at the site again"
    )
    [pending] = slurm_jobs_of(slurm_cluster, job_id)
    assert pending["JobState"] == "PENDING"  # as Slurm has it while the coordinator says so
    assert (waiting.site, waiting.epoch) == (SITE, first.epoch)
    assert waiting.reason == f"waiting again at {SITE}: Slurm requeued job {slurm_job['JobId']}"
    assert not waiting.devices
    assert not waiting.HasField("started_at")
    await until(read, lambda t: t.state == jobs_pb2.JOB_STATE_RUNNING, "running again")
    await eventually((markers / f"start-{first.epoch}-1").exists, "the second run started")
    (markers / "go").touch()
    job = await wait_job(operator, job_id)
    assert job.state == SUCCEEDED, job.tasks[0].reason
    restored = Path((markers / f"start-{first.epoch}-1").read_text())
    assert restored.name.startswith(("final-", "step-"))


# Writes when it started (epoch and wall clock) to MARKERS/NAME-EPOCH; on SIGTERM, waits
# STOP_S (a checkpoint taking a while) and exits; else runs RUN_S and succeeds.
TIMED = """
import os, signal, sys, time
def mark(folder, name, text):  # whole: a test reads a marker the moment it appears
    temporary = os.path.join(os.path.dirname(folder), "." + name)
    open(temporary, "w").write(text)
    os.rename(temporary, os.path.join(folder, name))
name = os.environ["NAME"] + "-" + os.environ["FEDERATION_EPOCH"]
mark(os.environ["MARKERS"], name, repr(time.time()))
def stop(*_):
    time.sleep(float(os.environ["STOP_S"]))
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
time.sleep(float(os.environ["RUN_S"]))
"""


def timed_job(name: str, markers: Path, gpus: int, run_s: float, stop_s: float) -> jobs_pb2.JobSpec:
    spec = gpu_job(name, TIMED, gpus=gpus)
    env = {"MARKERS": str(markers), "NAME": name, "RUN_S": str(run_s), "STOP_S": str(stop_s)}
    spec.tasks[0].env.update(env)
    return spec


async def test_the_preemptor_starts_before_its_victims_run_again(
    operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """An urgent job of both GPUs stops two tasks of one GPU each; the first to stop is not
    placed back on the GPU it freed while the urgent job waits for the second: Slurm starts
    the urgent job first, and both victims run again after it."""
    markers = tmp_path / "markers"
    markers.mkdir()
    quick = await submit(operator, timed_job("quick", markers, 1, run_s=3, stop_s=0))
    slow = await submit(operator, timed_job("slow", markers, 1, run_s=3, stop_s=2))
    for job_id in (quick, slow):
        await wait_job(operator, job_id, until=(jobs_pb2.JOB_STATE_RUNNING,))
    await eventually(lambda: (markers / "quick-1").exists(), "quick running")
    await eventually(lambda: (markers / "slow-1").exists(), "slow running")
    urgent = timed_job("urgent", markers, 2, run_s=1, stop_s=0)
    urgent.priority_class = "urgent"
    urgent_id = await submit(operator, urgent)
    assert (await wait_job(operator, urgent_id)).state == SUCCEEDED
    for job_id in (quick, slow):
        job = await wait_job(operator, job_id)
        assert job.state == SUCCEEDED, job.tasks[0].reason
        assert job.tasks[0].preemptions == 1
    started = {m.name: float(m.read_text()) for m in markers.iterdir()}
    assert started["urgent-1"] < started["quick-2"]
    assert started["urgent-1"] < started["slow-2"]
