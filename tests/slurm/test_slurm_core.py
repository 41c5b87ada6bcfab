"""The Slurm core against a real Slurm: the view, offers, held jobs, runs, cancels, health."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from datacenter_agent.slurm.core import DEGRADED_NODE
from datacenter_agent.slurm.offer import SLURM_DATA_REFUSAL
from federation.agent.config import SlurmSettings
from federation.agent.core import gang_refusal
from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.testing.slurm_cluster import LocalSlurmCluster, free_port

from .conftest import NODE
from .cores import RUNNING, MakeCore, slurm_job
from .tasks import eventually, gpu_task

pytestmark = pytest.mark.xdist_group("slurm")

SHOW_ENV = (
    "import os, time; "
    "print('CUDA_VISIBLE_DEVICES=' + os.environ.get('CUDA_VISIBLE_DEVICES', '-')); "
    "print('FEDERATION_DEVICES=' + os.environ['FEDERATION_DEVICES']); "
    "print('FEDERATION_CHECKPOINT_DIR=' + os.environ.get('FEDERATION_CHECKPOINT_DIR', '-')); "
    "print('SLURM_JOB_ID=' + os.environ['SLURM_JOB_ID']); "
    "time.sleep(1); raise SystemExit(3)"
)


async def test_view_comes_from_slurm(make_core: MakeCore) -> None:
    """The view is Slurm's node with its CPUs, memory and GRES GPUs described as configured."""
    harness = await make_core()
    assert harness.core.health == ""
    [node] = harness.core.nodes()
    assert (node.name, node.cpu_cores, node.memory_mib) == (NODE.name, 8, 16000)
    assert node.schedulable
    assert [(d.model, d.vendor, d.allocated) for d in node.devices] == [
        ("A100-80GB", "nvidia", False)
    ] * 2
    assert harness.core.name == "slurm"


async def test_offer_holds_a_job_until_the_lease_lapses(
    make_core: MakeCore, slurm_cluster: LocalSlurmCluster
) -> None:
    """An accepted offer is a held Slurm job the view counts; a lapsed lease cancels it."""
    harness = await make_core()
    answer = await harness.offer("held", gpu_task("pass", gpus=2), lease_s=1.0)
    assert answer.accepted, answer.reason
    slurm_id = answer.reservation_id.removeprefix("slurm-")
    job = slurm_job(slurm_cluster, slurm_id)
    assert (job["JobState"], job["Reason"]) == ("PENDING", "JobHeldUser")
    assert job["Comment"] == f"federation:{harness.site}:held:main:1"
    assert all(d.allocated for d in harness.core.nodes()[0].devices)
    await eventually(
        lambda: slurm_job(slurm_cluster, slurm_id)["JobState"] == "CANCELLED", "lease lapsed"
    )
    assert not any(d.allocated for d in harness.core.nodes()[0].devices)
    commit = site_link_service_pb2.Commit(
        reservation_id=answer.reservation_id, job_id="held", task="main", epoch=1
    )
    refused = await harness.core.commit(commit)
    assert not refused.started
    assert refused.reason == f"unknown reservation {answer.reservation_id!r} (lapsed or released)"


async def test_release_cancels_the_held_job(
    make_core: MakeCore, slurm_cluster: LocalSlurmCluster
) -> None:
    """Releasing a reservation scancels its held job at once."""
    harness = await make_core()
    answer = await harness.offer("released", gpu_task("pass"))
    await harness.core.release(answer.reservation_id)
    slurm_id = answer.reservation_id.removeprefix("slurm-")
    assert slurm_job(slurm_cluster, slurm_id)["JobState"] == "CANCELLED"


async def test_committed_task_runs_under_slurm_with_its_gpus(make_core: MakeCore) -> None:
    """A committed task runs as a Slurm job, sees its GPUs, and reports its exit code."""
    harness = await make_core()
    slurm_id = await harness.run("runs", gpu_task(SHOW_ENV, gpus=2))
    report = await harness.until_final("runs")
    assert [r.state for r in harness.reports] == [RUNNING, jobs_pb2.JOB_STATE_FAILED]
    assert report.exit_code == 3
    assert report.reason == f"Slurm job {slurm_id} exited with 3 (FAILED)"
    assert sorted(report.devices) == [f"{NODE.name}:GPU:0", f"{NODE.name}:GPU:1"]
    assert list(report.nodes) == [NODE.name]
    assert "CUDA_VISIBLE_DEVICES=0,1" in report.output_tail
    assert f"FEDERATION_DEVICES={NODE.name}:GPU:0,{NODE.name}:GPU:1" in report.output_tail
    assert f"SLURM_JOB_ID={slurm_id}" in report.output_tail
    assert "FEDERATION_CHECKPOINT_DIR=-" in report.output_tail  # no checkpoint policy


async def test_gang_replicas_get_their_own_gpus(make_core: MakeCore) -> None:
    """Two replicas run as two Slurm tasks, each with its own replica number and GPU."""
    code = (
        "import os; print('replica', os.environ['FEDERATION_REPLICA'], "
        "os.environ['FEDERATION_DEVICES'])"
    )
    harness = await make_core()
    await harness.run("gang", gpu_task(code, gpus=1, replicas=2))
    report = await harness.until_final("gang")
    assert report.state == jobs_pb2.JOB_STATE_SUCCEEDED, report.reason
    lines = sorted(line for line in report.output_tail.splitlines() if line.startswith("replica"))
    assert [line.split()[1] for line in lines] == ["0", "1"]
    assert {line.split()[2] for line in lines} == {f"{NODE.name}:GPU:0", f"{NODE.name}:GPU:1"}


async def test_the_node_must_meet_what_the_task_requires(make_core: MakeCore) -> None:
    """A requirement Slurm's node does not meet is declined before Slurm is asked, naming the
    node; one it meets is held as usual."""
    harness = await make_core()
    arch = harness.core.nodes()[0].arch
    assert arch, "Slurm reports the node's arch"
    wrong = gpu_task("pass", gpus=1)
    wrong.requires["arch"] = "riscv64"
    answer = await harness.offer("wrong-arch", wrong)
    assert not answer.accepted
    assert answer.reason == f"no node qualifies: {NODE.name} needs arch riscv64, node is {arch}"
    right = gpu_task("pass", gpus=1)
    right.requires["arch"] = arch
    answer = await harness.offer("right-arch", right)
    assert answer.accepted, answer.reason
    await harness.core.release(answer.reservation_id)


async def test_a_part_of_a_gang_across_sites_is_declined(make_core: MakeCore) -> None:
    """The coordinator gives a gang's parts their peers' addresses before they start; Slurm
    picks the nodes only then: the part is declined, saying so, and nothing is held."""
    harness = await make_core()
    part = gpu_task("pass", gpus=1)
    part.spread.all_or_nothing = True
    answer = await harness.offer("gang-part", part)
    assert not answer.accepted
    assert answer.reason == gang_refusal("Slurm")
    assert "gang across sites" in answer.reason
    alone = await harness.offer("alone", gpu_task("pass", gpus=1))
    assert alone.accepted, alone.reason  # the decline held nothing
    await harness.core.release(alone.reservation_id)


async def test_a_task_with_outputs_or_staged_inputs_is_declined(make_core: MakeCore) -> None:
    """A Slurm site neither stages inputs nor stores outputs: such a task is declined, not
    run without its data, and nothing is held."""
    harness = await make_core()
    making = gpu_task("pass", gpus=1)
    making.outputs.add(name="data", path="out.bin")
    answer = await harness.offer("makes-data", making)
    assert (answer.accepted, answer.reason) == (False, SLURM_DATA_REFUSAL)
    alone = await harness.offer("alone", gpu_task("pass", gpus=1))
    assert alone.accepted, alone.reason  # the decline held nothing
    await harness.core.release(alone.reservation_id)


@pytest.mark.parametrize("assumed", [1.0, 2.5], ids=["as-estimated", "faster-than-it-has"])
async def test_the_answer_says_how_long_the_task_runs_there(
    make_core: MakeCore, assumed: float
) -> None:
    """Slurm's A100s run 60 s of reference work in 60 s: the answer says so whether the
    estimate assumed A100s or faster devices this site lacks (it still holds the job, and the
    coordinator weighs the longer run against other sites)."""
    harness = await make_core()
    spec = gpu_task("pass", gpus=1)
    spec.estimated_duration_s = 60
    offer = site_link_service_pb2.Offer(
        job_id=f"speed-{assumed:g}".replace(".", "-"), task="main", epoch=1, spec=spec, lease_s=30
    )
    offer.estimate.device_speed = assumed
    answer = await harness.core.offer(offer)
    assert answer.accepted, answer.reason
    assert answer.run_s == pytest.approx(60.0)
    await harness.core.release(answer.reservation_id)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (gpu_task("pass", gpus=3), "Requested node configuration is not available"),
        (gpu_task("pass", memory_mib=9000), "Memory required by task is not available"),
        (gpu_task("pass", timeout_s=7200), "Requested time limit is invalid"),
    ],
    ids=["gpus", "memory", "time"],
)
async def test_too_big_is_declined_with_slurms_reason(
    make_core: MakeCore, slurm_cluster: LocalSlurmCluster, spec: jobs_pb2.TaskSpec, words: str
) -> None:
    """What the cluster or its partition cannot give is declined in Slurm's words, nothing held."""
    harness = await make_core()
    answer = await harness.offer("big", spec)
    assert not answer.accepted
    assert answer.reason.startswith("Slurm: ")
    assert words in answer.reason
    listed = slurm_cluster.run("squeue", "-h", "-o", "%k")
    assert f"federation:{harness.site}:" not in listed


async def test_cancel_signals_first_and_reports_the_last_checkpoint(
    make_core: MakeCore, slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    """Cancel (the coordinator preempting the task) sends SIGTERM; the checkpoint the task
    completes in its grace is in the final report, though the next scan was a minute away."""
    ready, stopped = tmp_path / "ready", tmp_path / "stopped"
    code = (
        "import os, signal, sys, time\n"
        "def save(*_):\n"
        f"    open({str(stopped)!r}, 'w').close()\n"
        "    name = os.path.join(os.environ['FEDERATION_CHECKPOINT_DIR'], 'last')\n"
        "    open(name, 'w').write('42')\n"
        "    open(name + '.done', 'w').close()\n"
        "    print('checkpoint saved', flush=True); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, save)\n"
        f"open({str(ready)!r}, 'w').close()\n"
        "print('started', flush=True); time.sleep(60)\n"
    )
    spec = gpu_task(code)
    spec.checkpoint.interval_s = 60
    harness = await make_core()
    slurm_id = await harness.run("stopme", spec)
    # RUNNING comes from Slurm; wait until the task itself has its handler in place.
    await eventually(ready.exists, "ready")
    await harness.core.cancel("stopme", "main", 0, "preempted by a job of priority 900")
    report = harness.last("stopme")
    assert report is not None
    assert (report.state, report.reason) == (
        jobs_pb2.JOB_STATE_CANCELLED,
        "preempted by a job of priority 900",
    )
    assert stopped.exists()  # SIGTERM came first: the task's handler ran
    assert "checkpoint saved" in report.output_tail
    folder = tmp_path / "work/stopme/main/1/checkpoints"
    assert (report.checkpoint.path, report.checkpoint.bytes) == (str(folder / "last"), 2)
    assert slurm_job(slurm_cluster, slurm_id)["JobState"] in ("COMPLETED", "CANCELLED")


async def test_cancel_kills_a_task_that_ignores_the_signal(
    make_core: MakeCore, slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    """A task that ignores SIGTERM is scancelled after the grace time."""
    ready = tmp_path / "ready"
    code = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(ready)!r}, 'w').close(); time.sleep(60)"
    )
    harness = await make_core()
    slurm_id = await harness.run("stubborn", gpu_task(code))
    await eventually(ready.exists, "ready")
    await harness.core.cancel("stubborn", "main", 1, "stop now")
    report = harness.last("stubborn")
    assert report is not None
    assert report.state == jobs_pb2.JOB_STATE_CANCELLED
    assert slurm_job(slurm_cluster, slurm_id)["JobState"] == "CANCELLED"


async def test_a_cut_off_site_stops_the_jobs_that_ask_for_it(
    make_core: MakeCore, slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    """Cut off past a job's stop_after_s, the site scancels its Slurm job and reports it
    CANCELLED and interrupted, with why; a job that does not ask runs on."""
    ready = tmp_path / "ready"
    code = f"import time; open({str(ready)!r}, 'w').close(); time.sleep(60)"
    harness = await make_core()
    stops = await harness.run("stops", gpu_task(code), stop_after_s=2)
    keeps = await harness.run("keeps", gpu_task("import time; time.sleep(60)"))
    await eventually(ready.exists, "the job that stops running")
    await harness.core.stop_cut_off(2.6)
    report = harness.last("stops")
    assert report is not None
    assert (report.state, report.interrupted) == (jobs_pb2.JOB_STATE_CANCELLED, True)
    assert report.reason == "cut off from every coordinator for 3 s (disconnect.stop_after_s 2)"
    # Slurm says FAILED when the job died of the SIGTERM before the scancel came.
    assert slurm_job(slurm_cluster, stops)["JobState"] in ("CANCELLED", "FAILED")
    assert slurm_job(slurm_cluster, keeps)["JobState"] in ("PENDING", "RUNNING")
    assert [r.interrupted for r in harness.core.tasks() if r.job_id == "keeps"] == [False]


async def test_drained_node_leaves_the_view(
    make_core: MakeCore, slurm_cluster: LocalSlurmCluster
) -> None:
    """A node drained in Slurm disappears from the view and comes back when resumed."""
    harness = await make_core()
    slurm_cluster.run("scontrol", "update", f"NodeName={NODE.name}", "State=DRAIN", "Reason=fan")
    try:
        await harness.core.refresh()
        assert harness.core.nodes() == []
        declined = await harness.offer("drained", gpu_task("pass"))
        assert not declined.accepted
    finally:
        slurm_cluster.run("scontrol", "update", f"NodeName={NODE.name}", "State=RESUME")
    # Slurm marks a resumed node NOT_RESPONDING until slurmd answers its next ping.
    await eventually(lambda: [n.name for n in harness.core.nodes()] == [NODE.name], "back")


async def test_restarted_core_adopts_its_jobs(
    make_core: MakeCore, slurm_cluster: LocalSlurmCluster
) -> None:
    """A new core finds the running jobs of its site by their comment, and drops stale holds."""
    first = await make_core()
    await first.run("adopted", gpu_task("import time; time.sleep(60)"))
    await eventually(lambda: first.last("adopted") is not None, "running")
    await first.shutdown()  # the agent exits; Slurm keeps the job
    stale = slurm_cluster.run(
        "sbatch",
        "--parsable",
        "--hold",
        f"--comment=federation:{first.site}:stale:main:1",
        "--wrap=true",
    ).strip()
    second = await make_core(site=first.site)
    [report] = second.core.tasks()
    assert (report.job_id, report.state) == ("adopted", RUNNING)
    assert report.devices == [f"{NODE.name}:GPU:0"]
    assert slurm_job(slurm_cluster, stale)["JobState"] == "CANCELLED"
    await second.core.cancel("adopted", "main", 0, "adopted and cancelled")
    assert second.core.tasks()[0].state == jobs_pb2.JOB_STATE_CANCELLED


async def test_slurm_down_degrades_the_site(
    make_core: MakeCore, slurm_cluster: LocalSlurmCluster, tmp_path: Path
) -> None:
    """With no controller to talk to, the site is degraded with Slurm's error and declines."""
    conf = tmp_path / "down.conf"
    text = slurm_cluster.conf.read_text()
    text = re.sub(r"SlurmctldPort=\d+", f"SlurmctldPort={free_port()}", text)
    conf.write_text(text.replace("MessageTimeout=5", "MessageTimeout=1"))
    harness = await make_core(environ={**slurm_cluster.env, "SLURM_CONF": str(conf)})
    assert "Unable to contact slurm controller" in harness.core.health
    [node] = harness.core.nodes()
    assert node.name == DEGRADED_NODE
    assert not node.schedulable
    assert node.labels["health"] == "degraded"
    assert "Unable to contact slurm controller" in node.labels["health_reason"]
    answer = await harness.offer("nowhere", gpu_task("pass"))
    assert not answer.accepted
    assert answer.reason.startswith("site degraded: ")
    assert "Unable to contact slurm controller" in answer.reason


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        (SlurmSettings(partition="nope"), "Partition nope not found"),
        (SlurmSettings(conf=Path("/nonexistent/slurm.conf")), "does not exist"),
    ],
    ids=["partition", "conf"],
)
async def test_misconfigured_slurm_degrades_the_site(
    make_core: MakeCore, settings: SlurmSettings, words: str
) -> None:
    """A missing partition or slurm.conf degrades the site with the reason."""
    harness = await make_core(settings)
    assert words in harness.core.health
    assert words in harness.core.nodes()[0].labels["health_reason"]
