"""Quota invariants over real agents: queues beside each other never hold more than their
nominal quotas together, even where GPUs are left over (a queue owed its nominal quota has
the tasks of the queues that borrow it stopped, federation-wide or at the site a quota
counts; a restarted coordinator counts what the tasks being stopped give back), and
preemption counts the devices each victim holds, whatever its spec names."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2, queues_pb2
from federation.local import LocalFederation
from federation.testing.cluster import site_state

from .conftest import admin, gpu_site, jobs, python_task, running, spec, until, wait_for_job
from .test_preemption import TASK, batch_job, checkpointed, get
from .test_preemption_failover import HOLD_S
from .test_preemption_failover import TASK as HOLDING_TASK
from .test_queues import listed

pytestmark = pytest.mark.xdist_group("e2e-reclaim")

GPUS = 8
SITE = gpu_site("gpu-r", GPUS, kill_grace_s=5.0)
RUNNING = jobs_pb2.JOB_STATE_RUNNING
SUCCEEDED = jobs_pb2.JOB_STATE_SUCCEEDED


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    root = tmp_path_factory.mktemp("reclaim")
    config = root / "coordinator.toml"
    config.write_text(
        "preemption_min_run_s = 0.0\nreclaim_min_run_s = 1.0\n"
        "[priority_classes.urgent]\nvalue = 900\nmay_preempt = true\npreemptible = false\n"
        "[priority_classes.batch]\nvalue = -100\n"
    )
    with running(root / "fed", [SITE], ["--config", str(config)]) as fed:
        yield fed


def as_tenant(job: jobs_pb2.JobSpec, tenant: str, queue: str) -> jobs_pb2.JobSpec:
    job.tenant, job.queue = tenant, queue
    return job


@pytest.mark.parametrize(
    ("scope", "key"),
    [("all", "gpu"), ("site", f"gpu@site/{SITE.name}"), ("model", "gpu/A100-80GB")],
    ids=["federation-wide", "at-a-site", "of-a-model"],
)
async def test_a_lender_gets_its_nominal_quota_back_though_gpus_are_left_over(
    operator: grpc.aio.Channel, tmp_path: Path, scope: str, key: str
) -> None:
    """qa (nominal 2, may borrow 2) borrows 2 while qb (nominal 4) is idle. qb then wants its
    4 on a site of 8 GPUs: 2 of qa's tasks are stopped (whole, from their checkpoints) so
    that the two hold their 6 together, not 8; with the quotas counting one site, or one
    model (of tasks that name none), the same."""
    stub = admin(operator)
    names = {name: f"{name}-{scope}" for name in ("qa", "qb")}
    for name, nominal, borrow in (("qa", 2.0, 2.0), ("qb", 4.0, 0.0)):
        resource = key if scope == "model" else "gpu"
        quota = queues_pb2.Quota(resource=resource, nominal=nominal, borrowing_limit=borrow)
        quota.site = SITE.name if scope == "site" else ""
        made = queues_pb2.Queue(name=names[name], tenant=f"team-{name}", quotas=[quota])
        await stub.CreateQueue(admin_service_pb2.CreateQueueRequest(queue=made))
    lent = [f"a{n}-{scope}" for n in range(4)]
    for job_id in lent:
        job = as_tenant(batch_job(job_id, tmp_path), "team-qa", names["qa"])
        await jobs(operator).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))
    lent = [f"team-qa:{job_id}" for job_id in lent]
    await checkpointed(operator, *lent)  # 2 of them on borrowed quota
    owed = [f"b{n}-{scope}" for n in range(4)]
    (tmp_path / "b").mkdir()
    for job_id in owed:
        job = as_tenant(batch_job(job_id, tmp_path / "b"), "team-qb", names["qb"])
        await jobs(operator).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))
    owed = [f"team-qb:{job_id}" for job_id in owed]

    async def given_back() -> bool:
        theirs = [(await get(operator, job_id)).tasks[0] for job_id in lent]
        ours = [(await get(operator, job_id)).tasks[0] for job_id in owed]
        stopped = sum(t.preemptions for t in theirs)
        return stopped == 2 and all(t.state == RUNNING for t in ours)

    try:
        await until(given_back, "qb running its 4, 2 of qa's stopped for them")
        held = await listed(operator)
        assert held[names["qa"]].usage[key] == 2
        assert held[names["qb"]].usage[key] == 4
        assert not held[names["qa"]].borrowed
        victims = [j for j in lent if (await get(operator, j)).tasks[0].preemptions]
        for victim in victims:
            reply = await jobs(operator).GetJob(
                job_service_pb2.GetJobRequest(job_id=victim, include_events=True)
            )
            reasons = [e.reason for e in reply.events]
            assert any("a queue taking back the nominal quota it lent" in r for r in reasons)
    finally:  # the tasks end whatever happened, leaving the GPUs to the next test
        for folder in (tmp_path, tmp_path / "b"):
            (folder / "go").touch()
    for job_id in lent + owed:
        assert (await wait_for_job(operator, job_id)).state == SUCCEEDED


def gpus_job(job_id: str, markers: Path, count: int, models: list[str]) -> jobs_pb2.JobSpec:
    accelerator: dict[str, object] = {"kind": "GPU", "count": count}
    if models:
        accelerator["models"] = models
    task = {
        "name": "t",
        "command": [sys.executable, "-c", TASK, str(markers)],
        "resources": {"accelerator": accelerator},
        "checkpoint": {"interval_s": 0.2},
    }
    return spec(job_id, [task], id=job_id, priority_class="batch")


async def test_victims_count_the_devices_they_hold_whatever_their_spec_names(
    operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """Two batch jobs hold all 8 A100s, one naming no model, one two models; an urgent job
    that wants 2 A100s stops one of them: each holds A100s, as its site granted them."""
    stub = jobs(operator)
    held = [
        gpus_job("any-model", tmp_path, 4, []),
        gpus_job("two-models", tmp_path, 4, ["A100-80GB", "H100-80GB"]),
    ]
    for job in held:
        await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))
    held_ids = ("any-model", "two-models")
    await checkpointed(operator, *held_ids)
    urgent = spec(
        "urgent",
        [
            {
                "name": "t",
                "command": [sys.executable, "-c", "pass"],
                "resources": {"accelerator": {"kind": "GPU", "count": 2, "models": ["A100-80GB"]}},
            }
        ],
        id="urgent-a100",
        priority_class="urgent",
    )
    await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=urgent))
    try:
        assert (await wait_for_job(operator, "urgent-a100")).state == SUCCEEDED
        stopped = [(await get(operator, j)).tasks[0].preemptions for j in held_ids]
        assert sorted(stopped) == [0, 1]
    finally:
        (tmp_path / "go").touch()
    for job_id in held_ids:
        assert (await wait_for_job(operator, job_id)).state == SUCCEEDED


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[LocalFederation]:
    """A federation (not started yet) on the embedded store, reclaiming after 1 s."""
    config = tmp_path / "coordinator.toml"
    config.write_text("reclaim_min_run_s = 1.0\n")
    federation = LocalFederation(tmp_path / "fed", [], coordinator_args=["--config", str(config)])
    try:
        yield federation
    finally:
        federation.stop()


async def test_a_new_leader_counts_what_the_tasks_being_taken_back_give_back(
    restartable: LocalFederation, tmp_path: Path
) -> None:
    """qb is owed 2 GPUs; 2 of qa's tasks are being stopped for them (holding in their grace)
    when the coordinator restarts. The new one marks nothing of its own for those 2: it sees
    the quota they give back, and stops no more of qa's tasks."""
    fed = restartable
    await fed.start_coordinator(name="coordinator")
    fed.sites.append(gpu_site("gpu-f", GPUS, kill_grace_s=60.0))
    await fed.start_site(fed.sites[-1])
    await fed.wait_connected()
    markers = tmp_path / "markers"
    markers.mkdir()

    def task(job_id: str, tenant: str, queue: str) -> jobs_pb2.JobSpec:
        one = {
            "name": "t",
            "command": [sys.executable, "-c", HOLDING_TASK, str(markers), str(HOLD_S)],
            "resources": {"accelerator": {"kind": "GPU", "count": 1}},
            "checkpoint": {"interval_s": 0.2},
        }
        return as_tenant(spec(job_id, [one], id=job_id), tenant, queue)

    lent = [f"team-qa:f{n}" for n in range(4)]
    owed = [f"team-qb:f{n}" for n in range(4)]
    async with fed.operator().channel() as channel:
        stub = admin(channel)
        for name, nominal, borrow in (("qa", 2.0, 2.0), ("qb", 4.0, 0.0)):
            quota = queues_pb2.Quota(resource="gpu", nominal=nominal, borrowing_limit=borrow)
            made = queues_pb2.Queue(name=name, tenant=f"team-{name}", quotas=[quota])
            await stub.CreateQueue(admin_service_pb2.CreateQueueRequest(queue=made))
        specs = [task(f"f{n}", "team-qa", "qa") for n in range(4)]
        await jobs(channel).SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=specs))
        await checkpointed(channel, *lent)
        specs = [task(f"f{n}", "team-qb", "qb") for n in range(4)]
        await jobs(channel).SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=specs))

        async def stopping() -> bool:
            tasks = [(await get(channel, job_id)).tasks[0] for job_id in lent]
            return sum(bool(t.preempted_by) and t.state == RUNNING for t in tasks) == 2

        await until(stopping, "2 of qa's tasks marked and still in their grace")
    fed.kill("coordinator")
    await fed.start_coordinator(name="coordinator", port=fed.port, join_port=fed.join_port)
    async with fed.operator().channel() as channel:

        async def back() -> bool:
            try:
                site = await site_state(channel, "gpu-f")
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                return False  # not serving yet
            return site.state == admin_service_pb2.SITE_STATE_CONNECTED

        await until(back, "the site back with the restarted coordinator")

        # A job placed by the new leader: the cycle that placed it went through qb's too.
        sentinel = spec("sentinel", [python_task("t", "pass")], id="sentinel")
        await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=sentinel))
        assert (await wait_for_job(channel, "sentinel")).state == SUCCEEDED
        (markers / "release-gpu-f").touch()

        async def given_back() -> bool:
            tasks = [(await get(channel, job_id)).tasks[0] for job_id in owed]
            return all(t.state == RUNNING for t in tasks)

        await until(given_back, "qb running its 4")
        (markers / "go").touch()
        ended = {job_id: await wait_for_job(channel, job_id) for job_id in lent + owed}
    assert all(job.state == SUCCEEDED for job in ended.values())
    assert sum(ended[job_id].tasks[0].preemptions for job_id in lent) == 2
