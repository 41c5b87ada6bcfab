"""The Ray core stages inputs, keeps checkpoints and outputs, against a real Ray head: inputs
served by a real HTTP server on loopback (the URL a holding site would sign), checkpoints in
the task's folder, which the agent and the Ray node share."""

from __future__ import annotations

import hashlib
import http.server
import itertools
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from datacenter_agent.ray_cluster.core import RayCore
from federation.agent.task_data import TaskData
from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.testing.ray_head import LocalRayHead

from .test_ray_core import FINAL, GRACE_S, gang, last, until

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(180)]

DATA = b"frames " * 50_000
DIGEST = hashlib.sha256(DATA).hexdigest()
READ = (
    "import hashlib, os, pathlib; "
    "data = pathlib.Path('in/frames.bin').read_bytes(); "
    "print('replica', os.environ['FEDERATION_REPLICA'], hashlib.sha256(data).hexdigest())"
)
sites = itertools.count(1)

Reports = list[site_link_service_pb2.TaskReport]
Progress = list[tuple[int, site_link_service_pb2.StageProgress]]
"""Each stage-in report, with how many task reports the core had made before it."""
MakeCore = Callable[[], Awaitable[tuple[RayCore, Reports, Progress]]]


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """An HTTP server on loopback that serves DATA at /frames."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # the standard library names it so
            self.send_response(200)
            self.send_header("Content-Length", str(len(DATA)))
            self.end_headers()
            self.wfile.write(DATA)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/frames"
    server.shutdown()
    server.server_close()


@pytest.fixture
async def make_core(ray_head: LocalRayHead, tmp_path: Path) -> AsyncIterator[MakeCore]:
    site = f"raydata{next(sites)}"
    cores: list[RayCore] = []

    async def make() -> tuple[RayCore, Reports, Progress]:
        reports: Reports = []
        progress: Progress = []
        data = TaskData(None, site, scratch=tmp_path / "scratch")
        data.on_progress = lambda told: progress.append((len(reports), told))
        core = RayCore(
            ray_head.settings(),
            site=site,
            work_dir=tmp_path / "work",
            on_status=reports.append,
            on_change=lambda: None,
            kill_grace_s=GRACE_S,
            data=data,
        )
        await core.start()
        cores.append(core)
        return core, reports, progress

    yield make
    for core in cores[-1:]:  # the newest core follows every job of the site
        for report in core.tasks():
            if report.state not in FINAL:
                await core.cancel(report.job_id, report.task, 0, "test over")
    for core in cores:
        await core.close()


def staged(url: str, *, sha256: str = DIGEST) -> site_link_service_pb2.StagedInput:
    return site_link_service_pb2.StagedInput(
        dataset="task:prep.frames",
        path="in/frames.bin",
        bytes=len(DATA),
        sha256=sha256,
        url=url,
        site="elsewhere",
    )


async def run(
    core: RayCore,
    job_id: str,
    spec: jobs_pb2.TaskSpec,
    *,
    epoch: int = 1,
    inputs: tuple[site_link_service_pb2.StagedInput, ...] = (),
    restore: jobs_pb2.CheckpointRecord | None = None,
) -> None:
    """Offers the task to the core and commits it."""
    offer = site_link_service_pb2.Offer(
        job_id=job_id, task="main", epoch=epoch, spec=spec, lease_s=30, restore=restore
    )
    answer = await core.offer(offer)
    assert answer.accepted, answer.reason
    commit = site_link_service_pb2.Commit(
        reservation_id=answer.reservation_id, job_id=job_id, task="main", epoch=epoch
    )
    commit.inputs.extend(inputs)
    started = await core.commit(commit)
    assert started.started, started.reason


async def ended(reports: Reports, job_id: str, epoch: int = 1) -> site_link_service_pb2.TaskReport:
    def done() -> bool:
        report = last(reports, job_id)
        return report is not None and report.epoch == epoch and report.state in FINAL

    await until(done, f"{job_id} ended", timeout_s=60)
    report = last(reports, job_id)
    assert report is not None
    return report


def free_a100s(core: RayCore) -> int:
    return sum(not d.allocated for n in core.nodes() for d in n.devices if d.model == "A100-80GB")


async def test_an_input_is_in_every_replicas_folder_before_it_starts(
    make_core: MakeCore, served: str
) -> None:
    """Both replicas read the staged file at their start: the bytes served, in each folder;
    the coordinator hears the stage-in done before the task runs."""
    core, reports, progress = await make_core()
    await run(core, "j-in", gang([sys.executable, "-c", READ]), inputs=(staged(served),))
    report = await ended(reports, "j-in")
    assert report.state == jobs_pb2.JOB_STATE_SUCCEEDED, report
    assert f"[replica 0] replica 0 {DIGEST}" in report.output_tail
    assert f"[replica 1] replica 1 {DIGEST}" in report.output_tail
    [(reported, done)] = [(n, p) for n, p in progress if p.done]
    assert (done.job_id, done.dataset, done.bytes_moved) == ("j-in", "task:prep.frames", len(DATA))
    assert reported == 0  # in place before the task was reported running
    assert reports[0].state == jobs_pb2.JOB_STATE_RUNNING


async def test_an_input_whose_digest_does_not_match_fails_the_task_before_it_runs(
    make_core: MakeCore, served: str
) -> None:
    core, reports, _ = await make_core()
    wrong = staged(served, sha256="0" * 64)
    await run(core, "j-bad", gang([sys.executable, "-c", READ]), inputs=(wrong,))
    report = await ended(reports, "j-bad")
    assert report.state == jobs_pb2.JOB_STATE_FAILED
    assert report.reason.startswith("input task:prep.frames: digest mismatch: sha256 "), report
    assert DIGEST[:16] in report.reason
    assert not report.output_tail  # it never ran
    assert [r.state for r in reports if r.job_id == "j-bad"] == [jobs_pb2.JOB_STATE_FAILED]
    await until(lambda: free_a100s(core) == 2, "its group removed")


async def test_a_task_cancelled_while_its_inputs_stage_never_runs(
    make_core: MakeCore, tmp_path: Path
) -> None:
    """A URL whose server never answers: the task stays DELEGATED, a cancel ends it CANCELLED
    and frees its devices."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        core, reports, _ = await make_core()
        silent = staged(f"http://127.0.0.1:{listener.getsockname()[1]}/frames")
        await run(core, "j-stuck", gang(["true"], replicas=1), inputs=(silent,))
        [delegated] = core.tasks()
        assert delegated.state == jobs_pb2.JOB_STATE_DELEGATED
        assert free_a100s(core) == 1
        await core.cancel("j-stuck", "main", 0, "cancelled by the tenant")
        report = await ended(reports, "j-stuck")
        assert (report.state, report.reason) == (
            jobs_pb2.JOB_STATE_CANCELLED,
            "cancelled by the tenant",
        )
        await until(lambda: free_a100s(core) == 2, "its group removed")
    finally:
        listener.close()


async def test_outputs_of_a_site_without_a_store_stay_in_the_tasks_folder(
    make_core: MakeCore,
) -> None:
    core, reports, _ = await make_core()
    write = "import pathlib; pathlib.Path('model.bin').write_bytes(b'w' * 1234)"
    spec = gang([sys.executable, "-c", write], replicas=1)
    spec.outputs.add(name="model", path="model.bin")
    await run(core, "j-out", spec)
    report = await ended(reports, "j-out")
    assert report.state == jobs_pb2.JOB_STATE_SUCCEEDED, report
    assert report.reason.startswith("outputs model kept at site raydata"), report.reason
    [artifact] = report.artifacts
    assert (artifact.name, artifact.bytes) == ("model", 1234)


async def test_a_missing_output_fails_the_task(make_core: MakeCore) -> None:
    core, reports, _ = await make_core()
    spec = gang(["true"], replicas=1)
    spec.outputs.add(name="model", path="model.bin")
    await run(core, "j-forgot", spec)
    report = await ended(reports, "j-forgot")
    assert report.state == jobs_pb2.JOB_STATE_FAILED
    assert report.reason == "output model (model.bin): the task did not write it"


CHECKPOINTING = """
import os, pathlib, signal, sys, time
saved = pathlib.Path(os.environ["FEDERATION_CHECKPOINT_DIR"])
restore = os.environ.get("FEDERATION_RESTORE_FROM")
start = int(pathlib.Path(restore, "step").read_text()) if restore else 0
print("from step", start, flush=True)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
for step in range(start + 1, start + 1000):
    folder = saved / f"step-{step}"
    folder.mkdir()
    (folder / "step").write_text(str(step))
    (saved / f"step-{step}.done").touch()
    if step >= 3 and start == 0:
        while True:
            time.sleep(0.1)  # until stopped
    if start and step >= start + 2:
        break
    time.sleep(0.2)
print("done at step", step)
"""


def checkpointed() -> jobs_pb2.TaskSpec:
    spec = gang([sys.executable, "-c", CHECKPOINTING], replicas=1)
    spec.checkpoint.CopyFrom(jobs_pb2.Checkpoint(dir="ckpt", interval_s=0.2))
    return spec


async def checkpoint_reported(reports: Reports, job_id: str, name: str) -> None:
    """Waits until job ``job_id``'s newest report names checkpoint ``name``."""

    def reported() -> bool:
        report = last(reports, job_id)
        return report is not None and report.checkpoint.path.endswith(name)

    await until(reported, f"checkpoint {name} reported", timeout_s=60)


async def test_a_stopped_task_restarts_from_its_checkpoint(
    make_core: MakeCore, tmp_path: Path
) -> None:
    """Epoch 1 saves three checkpoints in its folder (reported) and is stopped; epoch 2,
    offered the newest, finds it through FEDERATION_RESTORE_FROM and goes on from there."""
    core, reports, _ = await make_core()
    await run(core, "j-ckpt", checkpointed())

    await checkpoint_reported(reports, "j-ckpt", "step-3")
    report = last(reports, "j-ckpt")
    assert report is not None
    assert report.state == jobs_pb2.JOB_STATE_RUNNING
    assert Path(report.checkpoint.path).parent == tmp_path / "work/j-ckpt/main/1/ckpt"
    await core.cancel("j-ckpt", "main", 1, "moved")
    stopped = await ended(reports, "j-ckpt")
    assert stopped.state == jobs_pb2.JOB_STATE_CANCELLED
    assert stopped.checkpoint.path.endswith("step-3"), stopped.checkpoint
    assert stopped.checkpoint.progress_s > 0
    core.forget("j-ckpt", "main", 1)
    await run(core, "j-ckpt", checkpointed(), epoch=2, restore=stopped.checkpoint)
    again = await ended(reports, "j-ckpt", epoch=2)
    assert again.state == jobs_pb2.JOB_STATE_SUCCEEDED, again
    assert "from step 3" in again.output_tail
    assert "done at step 5" in again.output_tail
    assert again.checkpoint.path == str(tmp_path / "work/j-ckpt/main/2/ckpt/step-5")
    assert again.checkpoint.progress_s > stopped.checkpoint.progress_s


ADOPTED = """
import os, pathlib, sys, time
saved = pathlib.Path(os.environ["FEDERATION_CHECKPOINT_DIR"])
def save(step):
    (saved / f"step-{step}").write_text(str(step))
    (saved / f"step-{step}.done").touch()
save(1)
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
save(2)
pathlib.Path("model.bin").write_bytes(b"m" * 321)
print("done")
"""


async def test_a_restarted_agent_watches_an_adopted_tasks_checkpoints_and_keeps_its_outputs(
    make_core: MakeCore, tmp_path: Path
) -> None:
    """The agent that committed a task stops after its first checkpoint; the next one adopts
    its job from the record in its folder: it reports the checkpoint the job completes after,
    counted from the job's start, and keeps the task's output once it succeeds."""
    core, reports, _ = await make_core()
    gate = tmp_path / "go"
    spec = gang([sys.executable, "-c", ADOPTED, str(gate)], replicas=1)
    spec.checkpoint.CopyFrom(jobs_pb2.Checkpoint(dir="ckpt", interval_s=0.2))
    spec.outputs.add(name="model", path="model.bin")
    await run(core, "j-adopt", spec)

    await checkpoint_reported(reports, "j-adopt", "step-1")
    before = last(reports, "j-adopt")
    assert before is not None
    record = tmp_path / "work/j-adopt/main/1/task-record.json"
    assert record.stat().st_mode & 0o777 == 0o600
    await core.close()  # as an agent that stops: the job stays with Ray

    again, later, _ = await make_core()
    [adopted] = again.tasks()
    assert adopted.nodes == before.nodes  # its node named again: a lost one would stop it
    await until(lambda: last(later, "j-adopt") is not None, "reported")
    gate.touch()
    report = await ended(later, "j-adopt")
    assert report.state == jobs_pb2.JOB_STATE_SUCCEEDED, report
    assert report.checkpoint.path == str(tmp_path / "work/j-adopt/main/1/ckpt/step-2")
    assert report.checkpoint.progress_s > before.checkpoint.progress_s
    assert report.reason.startswith("outputs model kept at site raydata"), report.reason
    [artifact] = report.artifacts
    assert (artifact.name, artifact.bytes) == ("model", 321)


async def test_a_task_that_names_an_image_is_declined(make_core: MakeCore) -> None:
    core, _, _ = await make_core()
    spec = gang(["true"], replicas=1)
    spec.image = "docker.io/library/busybox:1.36"
    answer = await core.offer(
        site_link_service_pb2.Offer(job_id="j-img", task="main", epoch=1, spec=spec, lease_s=5)
    )
    assert not answer.accepted
    assert answer.reason == (
        "this Ray site does not run images: its tasks run as processes on Ray's nodes"
    )
    assert free_a100s(core) == 2
