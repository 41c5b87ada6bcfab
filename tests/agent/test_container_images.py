"""What a site says of images: why it runs none, and the bytes a pull of a held one moves."""

from __future__ import annotations

import base64
import json
import os
import shutil
import stat
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from federation.agent.accounts import task_accounts
from federation.agent.containers import (
    Containers,
    ContainerSettings,
    login_for,
    pull_args,
    pull_bytes,
    store_flags,
    write_auth_file,
)
from federation.agent.embedded_core import EmbeddedCore
from federation.agent.process import ReplicaStartError
from federation.agent.service import free_port
from federation.api.v1 import jobs_pb2, resources_pb2
from federation.testing.registry import (
    LocalRegistry,
    busybox_rootfs,
    import_image,
    podman,
    unavailable,
)


def test_pull_bytes_are_the_manifest_its_config_and_its_layers(tmp_path: Path) -> None:
    manifest = {
        "schemaVersion": 2,
        "config": {"digest": "sha256:" + "a" * 64, "size": 409},
        "layers": [{"size": 1_083_774}, {"size": 10}],
    }
    path = tmp_path / "manifest"
    path.write_text(json.dumps(manifest))
    assert pull_bytes(path) == len(path.read_bytes()) + 409 + 1_083_774 + 10


def test_no_manifest_or_a_list_of_manifests_gives_no_pull_bytes(tmp_path: Path) -> None:
    assert pull_bytes(tmp_path / "absent") == 0
    listed = tmp_path / "list"
    listed.write_text(json.dumps({"schemaVersion": 2, "manifests": [{"size": 5}]}))
    assert pull_bytes(listed) == 0
    (tmp_path / "bad").write_text("{")
    assert pull_bytes(tmp_path / "bad") == 0


def test_a_site_says_why_it_runs_no_image(tmp_path: Path) -> None:
    off = Containers(ContainerSettings(enabled=False), tmp_path)
    assert off.site_refusal() == "this site does not run containers: [containers] enabled = false"
    assert off.refusal("r.io/a:1") == f"{off.site_refusal()} (image r.io/a:1)"
    missing = Containers(ContainerSettings(podman="no-such-podman-here"), tmp_path)
    assert missing.site_refusal() == (
        "this site cannot run containers: no-such-podman-here is not installed"
    )


async def test_a_site_that_runs_no_image_lists_none(tmp_path: Path) -> None:
    assert await Containers(ContainerSettings(enabled=False), tmp_path).images() == []


def test_an_own_store_keeps_its_run_state_under_fifty_characters(tmp_path: Path) -> None:
    root, run = store_flags(tmp_path / ("deep" * 20))
    assert root == f"--root={tmp_path / ('deep' * 20)}"
    assert run.startswith("--runroot=/run/fedpod-")
    assert len(run.removeprefix("--runroot=")) <= 50
    assert store_flags(tmp_path / "x") != store_flags(tmp_path / "y")


def test_a_core_whose_tasks_run_as_the_agent_runs_no_image(
    tmp_path: Path, make_core: Callable[..., EmbeddedCore]
) -> None:
    """Containers take the tenant's account: a site without tenant accounts says so, and a
    site that has them runs images from the registries its settings name."""
    bare = make_core([resources_pb2.Node(name="n")])
    refusal, _ = bare.image_policy()
    can_run = os.geteuid() == 0 and shutil.which("podman") is not None
    if can_run:  # else the site says first that it lacks Podman or root
        assert refusal.startswith("this site cannot run containers: its tasks run as the agent's")
    assert refusal.startswith("this site cannot run containers: ")
    accounts = task_accounts(
        accounts={},
        uid_range="212000-212009",
        shared_user="",
        as_agent=False,
        state_dir=tmp_path / "state",
        work_dir=tmp_path / "work",
    )
    settings = ContainerSettings(registries=["r.example.org"])
    ready = make_core([resources_pb2.Node(name="n")], accounts=accounts, containers=settings)
    expected = "" if can_run else ready.image_policy()[0]
    assert ready.image_policy() == (expected, ["r.example.org"])


def test_a_login_file_is_the_agents_alone_and_holds_the_registrys_login(tmp_path: Path) -> None:
    login = jobs_pb2.ImagePullSecret(registry="r.example.org:5000", username="bot", password="p")
    path = tmp_path / "auth.json"
    write_auth_file(path, [login])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    auth = json.loads(path.read_text())["auths"]["r.example.org:5000"]["auth"]
    assert base64.b64decode(auth) == b"bot:p"
    assert login_for("r.example.org:5000/a/b:1", [login]) == login
    assert login_for("other.example.org/a/b:1", [login]) is None
    settings = ContainerSettings()
    assert pull_args(settings, "r.example.org/a:1", path) == [
        "pull",
        "--quiet",
        f"--authfile={path}",
        "r.example.org/a:1",
    ]


PASSWORD = "tenant-pw-7f3a"


@pytest.fixture
def private_registry(tmp_path: Path) -> Iterator[tuple[LocalRegistry, str, list[str]]]:
    """A registry that asks for a login, holding an image; and an empty store of our own."""
    if why := unavailable():
        pytest.skip(f"containers cannot run here: {why}")
    root = tmp_path / "registry"
    root.mkdir()
    address = f"127.0.0.1:{free_port()}"
    server = LocalRegistry.start(root, address, logins={"bot": PASSWORD})
    image = f"{address}/private-{uuid.uuid4().hex[:8]}/busybox:1"
    store = store_flags(tmp_path / "store")
    try:
        import_image(busybox_rootfs(root), image, store)
        server.push(image, store, login=("bot", PASSWORD))
        podman(*store, "rmi", image)
        yield server, image, store
    finally:
        subprocess.run(["podman", *store, "rmi", "--ignore", image], capture_output=True)
        server.stop()


async def test_a_private_image_is_pulled_with_the_tasks_login_alone(
    tmp_path: Path,
    private_registry: tuple[LocalRegistry, str, list[str]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without a login the pull fails with the registry's answer; with the task's login it
    succeeds; the login file is gone after each pull, and nothing logged holds the password."""
    server, image, _ = private_registry
    settings = ContainerSettings(
        insecure_registries=[server.address], storage=str(tmp_path / "store")
    )
    auth_dir = tmp_path / "state" / "pull-auth"
    containers = Containers(settings, tmp_path / "work", auth_dir=auth_dir)
    with pytest.raises(ReplicaStartError) as refused:
        await containers.pull(image)
    assert f"cannot pull image {image}" in str(refused.value)
    assert "unauthorized" in str(refused.value) or "authentication required" in str(refused.value)
    wrong = jobs_pb2.ImagePullSecret(registry=server.address, username="bot", password="nope")
    with pytest.raises(ReplicaStartError):
        await containers.pull(image, [wrong])
    assert list(auth_dir.iterdir()) == []
    login = jobs_pb2.ImagePullSecret(registry=server.address, username="bot", password=PASSWORD)
    assert await containers.pull(image, [login]) is True
    assert stat.S_IMODE(auth_dir.stat().st_mode) == 0o700
    assert list(auth_dir.iterdir()) == []
    assert await containers.pull(image) is False  # in the node's store now: no pull
    captured = capsys.readouterr()
    assert PASSWORD not in captured.out + captured.err
