"""Tasks from OCI images: a real agent runs them with real Podman, from a real registry.

The image is built here from a static busybox and pushed to a registry on loopback that this
module starts; its access log shows every pull.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from deploy_tools import need_tool

from federation.agent.containers import store_flags
from federation.agent.service import free_port
from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.jobspec import load_job_specs
from federation.local import LocalFederation, SiteSpec
from federation.testing.registry import LocalRegistry, busybox_rootfs, import_image, podman

from .conftest import channel_as, jobs, spec, tenant_tls, until, wait_for_job

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: rootful Podman, task uids"),
    pytest.mark.xdist_group("e2e-containers"),
]

UIDS = (210_000, 210_099)
SITE = "boxes"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "jobs" / "container.yaml"


@dataclass
class Registry:
    address: str
    image: str
    """The test image, pushed, and not in the node's store when the module starts."""
    server: LocalRegistry

    def manifest_gets(self, repository: str) -> int:
        """How often the registry was asked for a manifest of ``repository`` (pulls)."""
        return self.server.manifest_gets(repository)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    need_tool("podman", "apt-get install podman runc catatonit")
    need_tool("docker-registry", "apt-get install docker-registry")
    need_tool("busybox", "apt-get install busybox-static")
    root = tmp_path_factory.mktemp("registry")
    address = f"127.0.0.1:{free_port()}"
    server = LocalRegistry.start(root, address)
    image = f"{address}/fedtest-{uuid.uuid4().hex[:8]}/busybox:1"
    try:
        import_image(busybox_rootfs(root), image)
        server.push(image)
        podman("rmi", image)  # the agent pulls it
        yield Registry(address, image, server)
    finally:
        subprocess.run(["podman", "rmi", "--ignore", image], capture_output=True, check=False)
        server.stop()


def _site(work: Path, registry: Registry, name: str = SITE, **settings: object) -> SiteSpec:
    return SiteSpec(
        name,
        "datacenter",
        nodes=[{"name": "n", "cpu_cores": 4, "memory_mib": 8192}],
        settings={
            "task_uid_range": f"{UIDS[0]}-{UIDS[1]}",
            "work_dir": str(work),
            "run_tasks_as_agent": False,
            "stop_tasks_on_exit": False,  # an agent restart leaves its tasks to the next
            "containers": {"insecure_registries": [registry.address]},
            **settings,
        },
    )


@pytest.fixture(scope="module")
def federation(
    tmp_path_factory: pytest.TempPathFactory, registry: Registry
) -> Iterator[LocalFederation]:
    root = tmp_path_factory.mktemp("containers")
    root.chmod(0o755)  # the work folder below must be reachable by the task uids
    fed = LocalFederation(root, [_site(root / "tasks", registry)])
    try:
        asyncio.run(fed.start())
        yield fed
    finally:
        fed.stop()


def _work(fed: LocalFederation) -> Path:
    return fed.root / "tasks"


def _containers_left(fed: LocalFederation) -> list[str]:
    label = f"label=federation.work_dir={_work(fed)}"
    return podman("ps", "--all", "--filter", label, "--format", "{{.Names}}").split()


async def _submit(fed: LocalFederation, tenant: str, task: dict[str, object], **job: object) -> str:
    async with channel_as(fed, tenant_tls(fed, tenant)) as channel:
        reply = await jobs(channel).SubmitJob(
            job_service_pb2.SubmitJobRequest(spec=spec("c", [{"name": "t", **task}], **job))
        )
        return reply.job.id


async def _run(fed: LocalFederation, tenant: str, task: dict[str, object]) -> jobs_pb2.Job:
    job_id = await _submit(fed, tenant, task)
    async with channel_as(fed, tenant_tls(fed, tenant)) as channel:
        return await wait_for_job(channel, job_id, timeout_s=120)


def _script(registry: Registry, script: str) -> dict[str, object]:
    return {"image": registry.image, "command": ["sh", "-c", script]}


async def test_a_container_runs_as_the_tenant_in_its_folder_and_is_pulled_once(
    federation: LocalFederation, registry: Registry
) -> None:
    """The first run pulls the image, runs as the tenant's uid in its work folder (which it
    writes to); a second run on the node starts from the node's copy, asking the registry
    nothing."""
    repository = registry.image.split("/", 1)[1].split(":")[0]
    assert registry.manifest_gets(repository) == 0
    task = _script(registry, 'id -u; id -g; pwd; echo "$FEDERATION_TASK" > made; cat made')
    first = await _run(federation, "tenant-a", task)
    assert first.state == jobs_pb2.JOB_STATE_SUCCEEDED, first.tasks[0].reason
    uid, gid, folder, said = first.tasks[0].output_tail.split()
    assert UIDS[0] <= int(uid) <= UIDS[1]
    assert int(gid) != 0
    assert said == "t"
    made = Path(folder) / "made"  # the same path inside and out
    assert Path(folder).is_relative_to(_work(federation))
    assert (made.stat().st_uid, made.read_text()) == (int(uid), "t\n")
    pulls = registry.manifest_gets(repository)
    assert pulls >= 1

    second = await _run(federation, "tenant-a", task)
    assert second.state == jobs_pb2.JOB_STATE_SUCCEEDED, second.tasks[0].reason
    assert second.tasks[0].output_tail.split()[0] == uid
    assert registry.manifest_gets(repository) == pulls
    assert _containers_left(federation) == []
    # The environment podman read is not kept once the replica has ended.
    assert list(_work(federation).glob("*/t/*.run/*/container.env")) == []


async def test_an_image_the_registry_does_not_have_fails_with_its_answer(
    federation: LocalFederation, registry: Registry
) -> None:
    image = f"{registry.address}/fedtest-missing/{uuid.uuid4().hex[:8]}:1"
    job = await _run(federation, "tenant-a", {"image": image, "command": ["id"]})
    assert job.state == jobs_pb2.JOB_STATE_FAILED
    reason = job.tasks[0].reason
    assert f"cannot pull image {image}" in reason
    assert "manifest unknown" in reason  # the registry's own words


async def test_a_site_that_refuses_containers_is_passed_over_saying_so(
    tmp_path: Path, registry: Registry
) -> None:
    """The site says in its view that it runs no images: placement rejects it for such a task
    with the site's own reason, and no offer reaches it."""
    root = tmp_path / "fed"
    root.mkdir(mode=0o755)
    site = _site(root / "tasks", registry, containers={"enabled": False})
    fed = LocalFederation(root, [site])
    reason = "this site does not run containers: [containers] enabled = false"
    explained: list[jobs_pb2.SiteExplanation] = []
    try:
        await fed.start()
        job_id = await _submit(fed, "tenant-a", _script(registry, "id -u"))
        async with channel_as(fed, tenant_tls(fed, "tenant-a")) as channel:

            async def rejected() -> bool:
                request = job_service_pb2.ExplainJobRequest(job_id=job_id)
                reply = await jobs(channel).ExplainJob(request)
                explained[:] = [s for t in reply.tasks for s in t.sites if s.site == SITE]
                return bool(explained) and not explained[0].feasible

            await until(rejected, "the site to be rejected for the image")
            reply = await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
    finally:
        fed.stop()
    assert reply.job.state == jobs_pb2.JOB_STATE_PENDING  # no site took it
    verdicts = [(v.stage, v.code, v.reason) for v in explained[0].rejections]
    assert verdicts == [("ImagePolicy", "IMAGE_REFUSED", f"{reason} (image {registry.image})")]
    assert "offer_declined" not in fed.log_path(SITE).read_text(errors="replace")
    assert list((root / "tasks").glob(f"{job_id}/*")) == []


@pytest.mark.parametrize("trap", ['"echo stopping; exit 7"', '""'], ids=["quits", "ignores"])
async def test_cancel_stops_the_container_within_the_grace(
    federation: LocalFederation, registry: Registry, trap: str
) -> None:
    """The command gets SIGTERM (and quits), or, ignoring it, is killed after the grace;
    either way no container is left."""
    script = f"trap {trap} TERM; echo up > up; while true; do sleep 0.1; done"
    job_id = await _submit(federation, "tenant-a", _script(registry, script))
    async with channel_as(federation, tenant_tls(federation, "tenant-a")) as channel:
        up = list(_work(federation).glob(f"{job_id}/t/*/0/up"))

        async def started() -> bool:
            up[:] = list(_work(federation).glob(f"{job_id}/t/*/0/up"))
            return bool(up)

        await until(started, "the container to start", timeout_s=120)
        await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id))
        job = await wait_for_job(channel, job_id)
    assert job.state == jobs_pb2.JOB_STATE_CANCELLED
    if trap != '""':
        assert "stopping" in job.tasks[0].output_tail
    assert _containers_left(federation) == []


async def test_tenants_containers_cannot_read_each_others_folders(
    federation: LocalFederation, registry: Registry
) -> None:
    mine = await _run(federation, "tenant-a", _script(registry, "echo secret > s; pwd"))
    assert mine.state == jobs_pb2.JOB_STATE_SUCCEEDED, mine.tasks[0].reason
    folder = mine.tasks[0].output_tail.strip()
    assert (Path(folder) / "s").read_text() == "secret\n"
    probe = f"cat {folder}/s && echo LEAKED; ls {folder} && echo LISTED; echo done"
    theirs = await _run(federation, "tenant-b", _script(registry, probe))
    assert theirs.state == jobs_pb2.JOB_STATE_SUCCEEDED, theirs.tasks[0].reason
    out = theirs.tasks[0].output_tail
    assert "done" in out
    for leak in ("LEAKED", "LISTED", "secret"):
        assert leak not in out


async def test_a_restarted_agent_adopts_a_running_container(
    federation: LocalFederation, registry: Registry
) -> None:
    script = "echo up > up; until [ -e go ]; do sleep 0.1; done; echo adopted-ok"
    job_id = await _submit(federation, "tenant-a", _script(registry, script))
    up: list[Path] = []

    async def started() -> bool:
        up[:] = list(_work(federation).glob(f"{job_id}/t/*/0/up"))
        return bool(up)

    await until(started, "the container to start", timeout_s=120)
    assert federation.terminate(SITE)
    await federation.start_site(federation.sites[0])
    await federation.wait_connected()
    (up[0].parent / "go").touch()
    async with channel_as(federation, tenant_tls(federation, "tenant-a")) as channel:
        job = await wait_for_job(channel, job_id)
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, job.tasks[0].reason
    assert job.tasks[0].output_tail.strip() == "adopted-ok"
    assert "task_adopted" in federation.log_path(SITE).read_text(errors="replace")
    assert _containers_left(federation) == []


async def test_a_second_job_with_the_image_goes_to_the_site_that_holds_it(
    tmp_path: Path, registry: Registry
) -> None:
    """Two sites alike but for their Podman stores. The first job, pinned to "b-holder",
    pulls the image there; its agent then publishes the image with the bytes a pull moves.
    The second job, free to go anywhere, is charged that pull at "a-far" only, and so goes to
    "b-holder", though "a-far" comes first by name and would win a tie."""
    root = tmp_path / "fed"
    root.mkdir(mode=0o755)
    insecure = [registry.address]
    sites = [
        _site(
            root / f"tasks-{name}",
            registry,
            name=name,
            containers={"insecure_registries": insecure, "storage": str(root / f"store-{name}")},
        )
        for name in ("a-far", "b-holder")
    ]
    fed = LocalFederation(root, sites)
    task = _script(registry, "echo ran")
    try:
        await fed.start()
        async with channel_as(fed, tenant_tls(fed, "tenant-a")) as channel:
            first = await _submit(fed, "tenant-a", task, constraints={"sites": ["b-holder"]})
            done = await wait_for_job(channel, first, timeout_s=120)
            assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.tasks[0].reason
            estimates: dict[str, jobs_pb2.Estimate] = {}

            async def held() -> bool:
                request = job_service_pb2.SubmitJobRequest(
                    spec=spec("c", [{"name": "t", **task}]), validate_only=True
                )
                reply = await jobs(channel).SubmitJob(request)
                sites = [s for t in reply.placement for s in t.sites]
                estimates.update({s.site: s.estimate for s in sites})
                return "b-holder" in estimates and estimates["b-holder"].image_held

            await until(held, "b-holder to publish the image it pulled")
            second = await _submit(fed, "tenant-a", task)
            ran = await wait_for_job(channel, second, timeout_s=120)
            reply = await jobs(channel).ExplainJob(job_service_pb2.ExplainJobRequest(job_id=second))
    finally:
        fed.stop()
        for name in ("a-far", "b-holder"):
            flags = store_flags(root / f"store-{name}")
            await asyncio.to_thread(podman, *flags, "rmi", "--all")
            shutil.rmtree(flags[1].removeprefix("--runroot="), ignore_errors=True)
    assert ran.state == jobs_pb2.JOB_STATE_SUCCEEDED, ran.tasks[0].reason
    assert ran.tasks[0].site == "b-holder"
    by_site = {s.site: s.estimate for t in reply.tasks for s in t.sites}
    holder, far = by_site["b-holder"], by_site["a-far"]
    assert (holder.image_held, holder.pull_s, holder.pull_bytes) == (True, 0.0, 0)
    assert not far.image_held
    # What a pull moves: the manifest, the config and the compressed layer, as served.
    assert far.pull_bytes == await asyncio.to_thread(_served_bytes, registry)
    assert far.pull_s > 0
    assert far.transfer_s >= far.pull_s
    assert far.total_s > holder.total_s


def _served_bytes(registry: Registry) -> int:
    """What the registry serves for a pull of the test image: its manifest, the config and
    the layers that manifest names."""
    name, _, tag = registry.image.split("/", 1)[1].rpartition(":")
    accept = ", ".join(
        (
            "application/vnd.oci.image.manifest.v1+json",
            "application/vnd.docker.distribution.manifest.v2+json",
        )
    )
    request = urllib.request.Request(
        f"http://{registry.address}/v2/{name}/manifests/{tag}", headers={"Accept": accept}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        body = answer.read()
    manifest = json.loads(body)
    return len(body) + sum(b["size"] for b in [manifest["config"], *manifest["layers"]])


async def test_the_container_example_runs_from_this_registry(
    federation: LocalFederation, registry: Registry
) -> None:
    """examples/jobs/container.yaml's task, its image the same busybox from this registry."""
    (example,) = load_job_specs(EXAMPLE)
    example.tasks[0].image = registry.image
    async with channel_as(federation, tenant_tls(federation, "tenant-a")) as channel:
        reply = await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=example))
        job = await wait_for_job(channel, reply.job.id, timeout_s=120)
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, job.tasks[0].reason
    said = job.tasks[0].output_tail.strip()
    assert said.startswith(f"hello from a container: uid {UIDS[0]}")
    folder = Path(said.rpartition("working in ")[2])  # the replica's: <job>/hello/<epoch>/0
    assert folder.is_relative_to(_work(federation) / job.id / "hello")


PULL_PASSWORD = "tenant-pull-pw-51c9"


async def test_a_private_image_runs_with_the_tenants_login_never_shown(
    tmp_path: Path, registry: Registry
) -> None:
    """A registry that asks for a login: without one the task fails with the registry's
    answer; with the tenant's it runs. GetJob shows the password redacted to the tenant and
    to an operator, and neither the job's events, the logs nor the task see it."""
    private_root = tmp_path / "private"
    private_root.mkdir()
    address = f"127.0.0.1:{free_port()}"
    server = LocalRegistry.start(private_root, address, logins={"bot": PULL_PASSWORD})
    image = f"{address}/private-{uuid.uuid4().hex[:8]}/busybox:1"
    root = tmp_path / "fed"
    root.mkdir(mode=0o755)
    site = _site(root / "tasks", registry, containers={"insecure_registries": [address]})
    fed = LocalFederation(root, [site])
    login = {"registry": address, "username": "bot", "password": PULL_PASSWORD}
    try:
        import_image(busybox_rootfs(private_root), image)
        server.push(image, login=("bot", PULL_PASSWORD))
        podman("rmi", image)
        await fed.start()
        task = {"image": image, "command": ["sh", "-c", "env; ls -a /"]}
        refused = await _run(fed, "tenant-a", task)
        assert refused.state == jobs_pb2.JOB_STATE_FAILED
        reason = refused.tasks[0].reason
        assert f"cannot pull image {image}" in reason
        assert "unauthorized" in reason or "authentication required" in reason

        ran = await _run(fed, "tenant-a", {**task, "image_pull_secrets": [login]})
        assert ran.state == jobs_pb2.JOB_STATE_SUCCEEDED, ran.tasks[0].reason
        request = job_service_pb2.GetJobRequest(job_id=ran.id, include_events=True)
        async with channel_as(fed, tenant_tls(fed, "tenant-a")) as channel:
            as_tenant = await jobs(channel).GetJob(request)
            listed = await jobs(channel).ListJobs(job_service_pb2.ListJobsRequest())
        async with fed.operator().channel() as channel:
            as_operator = await jobs(channel).GetJob(request)
    finally:
        fed.stop()
        await asyncio.to_thread(podman, "rmi", "--ignore", image)
        server.stop()
    for reply in (as_tenant, as_operator):
        (secret,) = reply.job.spec.tasks[0].image_pull_secrets
        assert (secret.registry, secret.username, secret.password) == (
            address,
            "bot",
            "<redacted>",
        )
        assert PULL_PASSWORD not in str(reply)
    assert PULL_PASSWORD not in str(listed)
    assert PULL_PASSWORD not in ran.tasks[0].output_tail  # the task's env and its root
    for log in (root / "logs").iterdir():
        assert PULL_PASSWORD not in log.read_text(errors="replace"), log.name
    assert list(root.rglob("pull-*.json")) == []  # each pull's login file is gone
