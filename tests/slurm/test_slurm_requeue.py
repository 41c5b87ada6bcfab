"""Preempted or lost Slurm jobs come back, and tasks restart from their newest checkpoint.

Against the session's real Slurm: its own partition priority preemption (an ``urgent`` job
takes the node's GPUs), a node set DOWN, and a task placed again with a checkpoint to restore.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import pytest

from datacenter_agent.slurm.cli import SlurmCli, parse_records
from datacenter_agent.slurm.tasks import SlurmTask, follow
from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.testing.slurm_cluster import LocalSlurmCluster, SlurmClusterError

from .conftest import NODE, PARTITION, SETTINGS, URGENT
from .cores import RUNNING, Harness, MakeCore, slurm_job
from .tasks import checkpointing, eventually, gpu_task

pytestmark = pytest.mark.xdist_group("slurm")

DELEGATED = jobs_pb2.JOB_STATE_DELEGATED
SUCCEEDED = jobs_pb2.JOB_STATE_SUCCEEDED
FAILED = jobs_pb2.JOB_STATE_FAILED


def step_of(checkpoint: jobs_pb2.CheckpointRecord) -> int:
    """The step a checkpoint of CHECKPOINTING holds."""
    return int(Path(checkpoint.path).read_text())


async def until_checkpointed(harness: Harness, job_id: str) -> None:
    await eventually(
        lambda: any(r.checkpoint.path for r in harness.of(job_id)), f"{job_id} checkpointed"
    )


async def until_requeued(harness: Harness, job_id: str) -> site_link_service_pb2.TaskReport:
    """Waits for the report that the job is back in Slurm's queue; returns it."""

    def requeued() -> bool:
        return any(r.state == DELEGATED for r in harness.of(job_id))

    await eventually(requeued, f"{job_id} requeued")
    return next(r for r in harness.of(job_id) if r.state == DELEGATED)


async def until_running_again(harness: Harness, job_id: str) -> None:
    """Waits until Slurm starts the requeued job again (by itself: the test cluster's job
    credentials expire after 5 s, so it may start 6 s after it was requeued)."""
    reports = len(harness.of(job_id))

    def running_again() -> bool:
        return RUNNING in [r.state for r in harness.of(job_id)[reports:]]

    await eventually(running_again, f"{job_id} running again")


UP = frozenset({"idle", "mixed", "allocated", "completing"})
"""Node states in which Slurm runs jobs there: a requeued job may take the node back the
moment it is resumed, so "idle" alone may never be seen."""


async def node_back(cluster: LocalSlurmCluster) -> None:
    """Resumes the node set DOWN (Slurm may have taken it back already) until it is up."""
    with contextlib.suppress(SlurmClusterError):
        cluster.run("scontrol", "update", f"NodeName={NODE.name}", "State=RESUME")

    def up() -> bool:
        return cluster.run("sinfo", "-h", "-n", NODE.name, "-o", "%T").strip() in UP

    await eventually(up, f"{NODE.name} up again")


async def finishes_from(
    harness: Harness,
    markers: Path,
    job_id: str,
    tag: str,
    requeued: site_link_service_pb2.TaskReport,
) -> site_link_service_pb2.TaskReport:
    """The restarted run (``tag``) restores from the newest checkpoint reported before it was
    requeued, checkpoints on from there, and succeeds once told to finish."""
    restored = requeued.checkpoint
    assert restored.path
    start = markers / f"start-{tag}"
    await eventually(start.exists, f"run {tag} started")
    assert start.read_text() == restored.path

    def checkpointed_again() -> bool:
        reports = harness.of(job_id)
        later = reports[reports.index(requeued) + 1 :]
        return any(r.checkpoint.path != restored.path for r in later if r.checkpoint.path)

    await eventually(checkpointed_again, f"run {tag} checkpointed")
    (markers / "go").touch()
    final = await harness.until_final(job_id)
    assert final.state == SUCCEEDED, final.reason
    assert final.checkpoint.progress_s > restored.progress_s
    assert step_of(final.checkpoint) > step_of(restored)
    return final


@pytest.mark.parametrize("mode", ["REQUEUE", "CANCEL"])
async def test_a_job_slurm_preempts_comes_back_from_its_checkpoint(
    make_core: MakeCore, slurm_cluster: LocalSlurmCluster, tmp_path: Path, mode: str
) -> None:
    """A job of the urgent partition preempts the task's. Slurm requeues it (REQUEUE), or
    ends it PREEMPTED and the site requeues it (CANCEL): either way the task is never
    reported ended, and its next run restores from the checkpoint it saved on SIGTERM."""
    markers = tmp_path / "markers"
    if mode != "REQUEUE":
        slurm_cluster.run("scontrol", "update", f"PartitionName={PARTITION}", f"PreemptMode={mode}")
    try:
        harness = await make_core()
        slurm_id = await harness.run("victim", checkpointing(markers, gpus=2))
        await until_checkpointed(harness, "victim")
        urgent = (f"--partition={URGENT}", "--gres=gpu:a100:2", f"--output={tmp_path}/urgent.out")
        slurm_cluster.run("sbatch", *urgent, "--wrap=sleep 1")
        requeued = await until_requeued(harness, "victim")
    finally:
        slurm_cluster.run("scontrol", "update", f"PartitionName={PARTITION}", "PreemptMode=REQUEUE")
    assert (markers / "stopped-1-0").exists()  # Slurm's SIGTERM reached the task
    assert Path(requeued.checkpoint.path).name == "final-1-0"
    if mode == "CANCEL":
        assert f"Slurm job {slurm_id} was preempted" in requeued.reason
        assert requeued.reason.endswith("(PREEMPTED); requeued")
    else:
        assert requeued.reason == f"Slurm requeued job {slurm_id}"
    await until_running_again(harness, "victim")
    await finishes_from(harness, markers, "victim", "1-1", requeued)
    assert FAILED not in [r.state for r in harness.of("victim")]
    assert slurm_job(slurm_cluster, slurm_id)["Restarts"] == "1"  # the same Slurm job


async def test_a_job_whose_node_fails_comes_back_from_its_checkpoint(
    make_core: MakeCore, slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    """The task's node goes DOWN: Slurm requeues the job, the site follows it, and when the
    node is back the job restores from the newest checkpoint reported."""
    markers = tmp_path / "markers"
    harness = await make_core()
    slurm_id = await harness.run("lost-node", checkpointing(markers))
    await until_checkpointed(harness, "lost-node")
    slurm_cluster.run(
        "scontrol", "update", f"NodeName={NODE.name}", "State=DOWN", "Reason=test: node lost"
    )
    try:
        requeued = await until_requeued(harness, "lost-node")
    finally:
        await node_back(slurm_cluster)
    assert requeued.reason == f"Slurm requeued job {slurm_id}"
    await until_running_again(harness, "lost-node")
    await finishes_from(harness, markers, "lost-node", "1-1", requeued)
    assert FAILED not in [r.state for r in harness.of("lost-node")]
    assert slurm_job(slurm_cluster, slurm_id)["Restarts"] == "1"


async def test_a_job_slurm_may_not_requeue_fails_with_slurms_words(
    make_core: MakeCore, slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    """A job submitted --no-requeue (the site's own sbatch flags) ends NODE_FAIL when its
    node goes DOWN; Slurm refuses to requeue it, and the task fails saying so."""
    ready = tmp_path / "ready"
    code = f"import time; open({str(ready)!r}, 'w').close(); time.sleep(60)"
    harness = await make_core(dataclasses.replace(SETTINGS, extra_sbatch_args=["--no-requeue"]))
    slurm_id = await harness.run("no-requeue", gpu_task(code))
    await eventually(ready.exists, "ready")
    slurm_cluster.run(
        "scontrol", "update", f"NodeName={NODE.name}", "State=DOWN", "Reason=test: node lost"
    )
    try:
        report = await harness.until_final("no-requeue")
    finally:
        await node_back(slurm_cluster)
    assert report.state == FAILED
    assert report.reason.startswith(f"Slurm job {slurm_id} lost its node (NODE_FAIL")
    assert "; Slurm would not requeue it: Requested operation is presently disabled" in (
        report.reason
    )


async def test_a_task_placed_again_restores_from_its_newest_checkpoint(
    make_core: MakeCore, tmp_path: Path
) -> None:
    """Epoch 1 is stopped (as the coordinator preempts it) after checkpointing; epoch 2,
    offered that checkpoint, starts from it and counts its work on from the checkpoint's."""
    markers = tmp_path / "markers"
    harness = await make_core()
    await harness.run("placed-again", checkpointing(markers))
    await until_checkpointed(harness, "placed-again")
    await harness.core.cancel("placed-again", "main", 1, "preempted by a job of priority 900")
    stopped = harness.of("placed-again")[-1]
    assert stopped.state == jobs_pb2.JOB_STATE_CANCELLED
    assert Path(stopped.checkpoint.path).name == "final-1-0"
    folder = tmp_path / "work/placed-again/main/1/checkpoints"
    assert Path(stopped.checkpoint.path).parent == folder
    harness.core.forget("placed-again", "main", 1)
    await harness.run("placed-again", checkpointing(markers), epoch=2, restore=stopped.checkpoint)
    start = markers / "start-2-0"
    await eventually(start.exists, "epoch 2 started")
    assert start.read_text() == stopped.checkpoint.path
    await eventually(
        lambda: any(r.epoch == 2 and r.checkpoint.path for r in harness.of("placed-again")),
        "epoch 2 checkpointed",
    )
    (markers / "go").touch()
    final = await harness.until_final("placed-again")
    assert final.state == SUCCEEDED, final.reason
    assert Path(final.checkpoint.path).parent == tmp_path / "work/placed-again/main/2/checkpoints"
    assert final.checkpoint.progress_s > stopped.checkpoint.progress_s


@pytest.mark.parametrize(
    ("state", "states"),
    [("COMPLETING", [RUNNING]), ("RUNNING", [RUNNING, DELEGATED, RUNNING])],
)
async def test_a_requeue_seen_only_by_its_count(state: str, states: list[int]) -> None:
    """A job read only once it runs again (the agent did not read Slurm meanwhile) is
    requeued all the same: its count went up. While it is still COMPLETING it is not yet."""
    reports: list[site_link_service_pb2.TaskReport] = []
    task = SlurmTask(("job", "main", 1), "5", "slurm-5", ())
    cli = SlurmCli({})  # not asked: the job has not ended

    async def read(text: str) -> None:
        [record] = parse_records(text)
        await follow(task, record, cli, lambda t: reports.append(t.report()))

    await read("JobId=5 JobState=RUNNING Restarts=0 NodeList=fed-node-1")
    await read(f"JobId=5 JobState={state} Restarts=1 NodeList=fed-node-1")
    assert [r.state for r in reports] == states
    assert task.restarts == states.count(RUNNING) - 1


async def test_a_restarted_agent_watches_the_checkpoints_of_the_jobs_it_adopts(
    make_core: MakeCore, slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    """The agent restarts while the task runs: the new core adopts the Slurm job, reports the
    checkpoints it completes from then on, and when Slurm requeues the job the next run
    restores from the newest of them, as before the restart."""
    markers = tmp_path / "markers"
    first = await make_core()
    slurm_id = await first.run("adopted", checkpointing(markers))
    await until_checkpointed(first, "adopted")
    await first.shutdown()  # the agent exits; Slurm keeps the job
    before = max(step_of(r.checkpoint) for r in first.of("adopted") if r.checkpoint.path)
    second = await make_core(site=first.site)
    assert [t.job_id for t in second.core.tasks()] == ["adopted"]

    def checkpointed_after_restart() -> bool:
        steps = [step_of(r.checkpoint) for r in second.of("adopted") if r.checkpoint.path]
        return any(step > before for step in steps)

    await eventually(checkpointed_after_restart, "a checkpoint reported by the new core")
    slurm_cluster.run("scontrol", "requeue", slurm_id)
    requeued = await until_requeued(second, "adopted")
    assert requeued.reason == f"Slurm requeued job {slurm_id}"
    assert step_of(requeued.checkpoint) > before
    await until_running_again(second, "adopted")
    await finishes_from(second, markers, "adopted", "1-1", requeued)
