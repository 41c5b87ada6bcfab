"""Tasks from OCI images on a Slurm site: the batch script runs them with the node's Podman.

Against the session's real Slurm and real rootful Podman, pulling from a registry this module
starts on loopback (the image: a static busybox). The first tests need neither.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from datacenter_agent.slurm.containers import (
    CONTAINER_ENV,
    PULL_AUTH,
    WORK_FOLDER,
    ContainerJob,
    container_script,
)
from datacenter_agent.slurm.job import job_dir
from federation.agent.accounts import Account, TaskAccounts, task_accounts
from federation.agent.containers import (
    GPU_DEVICES_SHELL,
    ContainerSettings,
    container_name,
    gpu_device_args,
)
from federation.agent.service import free_port
from federation.api.v1 import jobs_pb2
from federation.testing.registry import (
    LocalRegistry,
    busybox_rootfs,
    import_image,
    podman,
    unavailable,
)

from .cores import RUNNING, MakeCore
from .tasks import eventually

pytestmark = pytest.mark.xdist_group("slurm")

UIDS = (213_000, 213_009)
GRACE_S = 1.0
"""The test cores' kill_grace_s."""
KILL_WAIT_S = 2.0
"""The test cluster's KillWait: from scancel to SIGKILL."""
TENANT = "tenant-a"


def _spec(image: str, script: str, **env: str) -> jobs_pb2.TaskSpec:
    return jobs_pb2.TaskSpec(
        name="main",
        image=image,
        command=["sh", "-c", script],
        env=env,
        resources=jobs_pb2.ResourceRequest(cpu=1, memory_mib=256),
    )


def test_the_script_parses_and_keeps_the_tasks_variables_out(tmp_path: Path) -> None:
    """The batch script is valid sh, runs podman with the tenant's uid, and the task's
    variables (a secret, say) are not in its text: they go to container.env."""
    key = ("j1", "main", 1)
    job = ContainerJob(ContainerSettings(), Account("t", 213_000, 213_000), tmp_path, {})
    spec = _spec("r.example.org/a/b:1", "echo hi", TOKEN="s3cr3t-value")
    script = container_script(spec, key, site="s", folder=job_dir(tmp_path, key), job=job)
    subprocess.run(["sh", "-n", "-c", script], check=True)
    assert "--user=213000:213000" in script
    assert f"--name={container_name(tmp_path, key, 0)}" in script
    assert "s3cr3t-value" not in script
    assert f"--env-file={job_dir(tmp_path, key) / CONTAINER_ENV}" in script


def test_the_script_pulls_with_the_login_file_never_its_text(tmp_path: Path) -> None:
    """A task's registry login reaches the node's pull as a file of the agent's
    (``--authfile``), never in the script's text; a login for another registry is not used."""
    key = ("j1", "main", 1)
    job = ContainerJob(ContainerSettings(), Account("t", 213_000, 213_000), tmp_path, {})
    spec = _spec("r.example.org/a/b:1", "echo hi")
    login = jobs_pb2.ImagePullSecret(registry="r.example.org", username="bot", password="pw-9")
    spec.image_pull_secrets.append(login)
    script = container_script(spec, key, site="s", folder=job_dir(tmp_path, key), job=job)
    subprocess.run(["sh", "-n", "-c", script], check=True)
    assert f"--authfile={job_dir(tmp_path, key) / PULL_AUTH}" in script
    assert "pw-9" not in script
    assert "bot" not in script
    spec.image_pull_secrets[0].registry = "other.example.org"
    script = container_script(spec, key, site="s", folder=job_dir(tmp_path, key), job=job)
    assert "--authfile" not in script


def test_gpus_on_a_node_get_the_options_the_embedded_core_gives() -> None:
    """The script's device options for Slurm's GPU indices are those the embedded core
    gives the same GPUs on the same host (CDI names or /dev nodes)."""
    shown = subprocess.run(
        ["sh", "-c", f'gpus=0,2; set --; {GPU_DEVICES_SHELL}; printf "%s\\n" "$@"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert shown == gpu_device_args([0, 2])
    none = subprocess.run(
        ["sh", "-c", f'gpus=""; set --; {GPU_DEVICES_SHELL}; echo "$#"'],
        capture_output=True,
        text=True,
        check=True,
    )
    assert none.stdout.strip() == "0"


@dataclass
class Registry:
    server: LocalRegistry
    address: str
    image: str


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry on loopback holding a busybox image that the node's store lacks."""
    if why := unavailable():
        pytest.skip(f"containers cannot run here: {why}")
    root = tmp_path_factory.mktemp("registry")
    address = f"127.0.0.1:{free_port()}"
    server = LocalRegistry.start(root, address)
    image = f"{address}/fedslurm-{uuid.uuid4().hex[:8]}/busybox:1"
    try:
        import_image(busybox_rootfs(root), image)
        server.push(image)
        podman("rmi", image)  # the job pulls it
        yield Registry(server, address, image)
    finally:
        subprocess.run(["podman", "rmi", "--ignore", image], capture_output=True, check=False)
        server.stop()


@pytest.fixture
def accounts(tmp_path: Path) -> TaskAccounts:
    (tmp_path / "state").mkdir()
    return task_accounts(
        accounts={},
        uid_range=f"{UIDS[0]}-{UIDS[1]}",
        shared_user="",
        as_agent=True,
        state_dir=tmp_path / "state",
        work_dir=tmp_path / "work",
    )


def _settings(registry: Registry) -> ContainerSettings:
    return ContainerSettings(insecure_registries=[registry.address])


def _containers_left(work: Path) -> list[str]:
    label = f"label=federation.work_dir={work}"
    return podman("ps", "--all", "--filter", label, "--format", "{{.Names}}").split()


async def test_a_site_without_tenant_accounts_runs_no_image(
    make_core: MakeCore, registry: Registry, accounts: TaskAccounts
) -> None:
    """Containers take the tenant's account: without accounts the site says so in its view
    and declines the offer; with them it runs images from the registries its settings name."""
    bare = await make_core(containers=_settings(registry))
    refusal, _ = bare.core.image_policy()
    assert refusal.startswith("this site cannot run containers: its tasks run as the agent's")
    answer = await bare.offer("no-accounts", _spec(registry.image, "id"), tenant=TENANT)
    assert not answer.accepted
    assert answer.reason == f"{refusal} (image {registry.image})"

    settings = ContainerSettings(registries=[registry.address])
    ready = await make_core(containers=settings, accounts=accounts)
    assert ready.core.image_policy() == ("", [registry.address])
    other = "r.example.org/a/b:1"
    answer = await ready.offer("elsewhere", _spec(other, "id"), tenant=TENANT)
    assert answer.reason == (
        f"this site runs images from {registry.address} only, not from r.example.org "
        f"(image {other})"
    )


async def test_a_container_runs_as_the_tenant_in_its_folder_pulled_once_per_node(
    make_core: MakeCore, registry: Registry, accounts: TaskAccounts, tmp_path: Path
) -> None:
    """The job pulls the image from the registry, runs it as the tenant's uid (not root) in
    its folder, which it writes to at the same path as outside; a second job on the node
    starts from the node's copy, asking the registry nothing."""
    harness = await make_core(containers=_settings(registry), accounts=accounts)
    repository = registry.image.split("/", 1)[1].split(":")[0]
    script = 'id -u; id -g; pwd; echo "$FEDERATION_TASK:$TOKEN" > made; cat made'
    spec = _spec(registry.image, script, TOKEN="t0k3n")
    await harness.run("boxed", spec, tenant=TENANT)
    first = await harness.until_final("boxed")
    assert first.state == jobs_pb2.JOB_STATE_SUCCEEDED, (first.reason, first.output_tail)
    uid, gid, folder, said = first.output_tail.split()
    assert UIDS[0] <= int(uid) <= UIDS[1]
    assert int(gid) != 0
    assert said == "main:t0k3n"
    work = tmp_path / "work"
    assert Path(folder) == job_dir(work, ("boxed", "main", 1)) / WORK_FOLDER
    made = Path(folder) / "made"
    assert (made.stat().st_uid, made.read_text()) == (int(uid), "main:t0k3n\n")
    pulls = registry.server.manifest_gets(repository)
    assert pulls >= 1
    # The environment file is gone once the job has ended; the script never held the token.
    assert not (job_dir(work, ("boxed", "main", 1)) / CONTAINER_ENV).exists()
    assert "t0k3n" not in (job_dir(work, ("boxed", "main", 1)) / "job.sh").read_text()

    await harness.run("again", _spec(registry.image, "id -u; exit 3"), tenant=TENANT)
    second = await harness.until_final("again")
    assert second.state == jobs_pb2.JOB_STATE_FAILED
    assert (second.exit_code, second.output_tail.strip()) == (3, uid)
    assert registry.server.manifest_gets(repository) == pulls
    assert _containers_left(work) == []


async def test_an_image_the_registry_does_not_have_fails_with_its_answer(
    make_core: MakeCore, registry: Registry, accounts: TaskAccounts
) -> None:
    harness = await make_core(containers=_settings(registry), accounts=accounts)
    image = f"{registry.address}/fedslurm-missing/{uuid.uuid4().hex[:8]}:1"
    await harness.run("missing", _spec(image, "id"), tenant=TENANT)
    report = await harness.until_final("missing")
    assert report.state == jobs_pb2.JOB_STATE_FAILED
    assert report.reason.startswith(f"cannot pull image {image}: ")
    assert "manifest unknown" in report.reason  # the registry's own words


SLURM_PULL_PASSWORD = "slurm-pull-pw-0c2e"


async def test_a_private_image_is_pulled_on_the_node_with_the_tasks_login(
    make_core: MakeCore, accounts: TaskAccounts, tmp_path: Path
) -> None:
    """A registry that asks for a login: the job without one fails with its answer; with the
    task's login it runs; the login file is gone when the job has ended and the script never
    held the password."""
    if why := unavailable():
        pytest.skip(f"containers cannot run here: {why}")
    root = tmp_path / "private"
    root.mkdir()
    address = f"127.0.0.1:{free_port()}"
    server = LocalRegistry.start(root, address, logins={"bot": SLURM_PULL_PASSWORD})
    image = f"{address}/fedslurm-private-{uuid.uuid4().hex[:8]}/busybox:1"
    work = tmp_path / "work"
    try:
        await asyncio.to_thread(import_image, busybox_rootfs(root), image)
        await asyncio.to_thread(server.push, image, (), ("bot", SLURM_PULL_PASSWORD))
        await asyncio.to_thread(podman, "rmi", image)
        settings = ContainerSettings(insecure_registries=[address])
        harness = await make_core(containers=settings, accounts=accounts)
        await harness.run("nologin", _spec(image, "id -u"), tenant=TENANT)
        refused = await harness.until_final("nologin")
        assert refused.state == jobs_pb2.JOB_STATE_FAILED
        assert refused.reason.startswith(f"cannot pull image {image}: ")
        assert "unauthorized" in refused.reason or "authentication required" in refused.reason

        spec = _spec(image, "env; id -u")
        spec.image_pull_secrets.append(
            jobs_pb2.ImagePullSecret(registry=address, username="bot", password=SLURM_PULL_PASSWORD)
        )
        await harness.run("login", spec, tenant=TENANT)
        ran = await harness.until_final("login")
        assert ran.state == jobs_pb2.JOB_STATE_SUCCEEDED, (ran.reason, ran.output_tail)
        assert SLURM_PULL_PASSWORD not in ran.output_tail
        folder = job_dir(work, ("login", "main", 1))
        assert SLURM_PULL_PASSWORD not in (folder / "job.sh").read_text()
        assert not (folder / PULL_AUTH).exists()
    finally:
        await asyncio.to_thread(podman, "rmi", "--ignore", image)
        server.stop()


@pytest.mark.parametrize("trap", ['"echo stopping; exit 7"', '""'], ids=["quits", "ignores"])
async def test_cancel_stops_the_container_within_the_grace(
    make_core: MakeCore, registry: Registry, accounts: TaskAccounts, tmp_path: Path, trap: str
) -> None:
    """Cancel's SIGTERM reaches the command in the container, whose handler runs (and it
    quits), or, ignored, the container is killed once the grace is over (the core's
    scancel); either way no container is left."""
    harness = await make_core(containers=_settings(registry), accounts=accounts)
    script = f"trap {trap} TERM; echo up > up; while true; do sleep 0.1; done"
    await harness.run("stopped", _spec(registry.image, script), tenant=TENANT)
    up = job_dir(tmp_path / "work", ("stopped", "main", 1)) / WORK_FOLDER / "up"
    await eventually(up.exists, "the container to start", timeout_s=120)

    def reported_running() -> bool:  # the core reads Slurm's state a moment after the start
        report = harness.last("stopped")
        return report is not None and report.state == RUNNING

    await eventually(reported_running, "the task reported running")
    began = time.monotonic()
    await harness.core.cancel("stopped", "main", 0, "cancelled by the test")
    report = await harness.until_final("stopped")
    took = time.monotonic() - began
    assert report.state == jobs_pb2.JOB_STATE_CANCELLED
    assert report.reason == "cancelled by the test"
    if trap != '""':
        assert "stopping" in report.output_tail
        assert report.exit_code == 7
        assert took < GRACE_S  # it quit on SIGTERM: no scancel was needed
    else:
        assert took < GRACE_S + KILL_WAIT_S + 5  # the grace, then Slurm's KillWait at most
    assert _containers_left(tmp_path / "work") == []


async def test_a_restarted_agent_adopts_a_container_and_its_checkpoints(
    make_core: MakeCore, registry: Registry, accounts: TaskAccounts, tmp_path: Path
) -> None:
    """The container writes to its checkpoint folder (the tenant's, mounted at its path); a
    restarted agent finds the job, reports the checkpoint the container completes, and its
    end."""
    settings = _settings(registry)
    first = await make_core(containers=settings, accounts=accounts)
    script = (
        "echo up > up; until [ -e go ]; do sleep 0.1; done; "
        'echo 5 > "$FEDERATION_CHECKPOINT_DIR/s5"; touch "$FEDERATION_CHECKPOINT_DIR/s5.done"; '
        "echo adopted-ok"
    )
    spec = _spec(registry.image, script)
    spec.checkpoint.interval_s = 0.2
    await first.run("adopted", spec, tenant=TENANT)
    folder = job_dir(tmp_path / "work", ("adopted", "main", 1))
    await eventually((folder / WORK_FOLDER / "up").exists, "the container to start", 120)
    await first.shutdown()  # the agent exits; Slurm keeps the job, Podman the container
    second = await make_core(containers=settings, accounts=accounts, site=first.site)
    [running] = second.core.tasks()
    assert (running.job_id, running.state) == ("adopted", RUNNING)
    (folder / WORK_FOLDER / "go").touch()
    report = await second.until_final("adopted")
    assert report.state == jobs_pb2.JOB_STATE_SUCCEEDED, (report.reason, report.output_tail)
    assert report.output_tail.strip() == "adopted-ok"
    assert report.checkpoint.path == str(folder / "checkpoints" / "s5")
    assert (folder / "checkpoints").stat().st_uid in range(UIDS[0], UIDS[1] + 1)
    assert _containers_left(tmp_path / "work") == []
