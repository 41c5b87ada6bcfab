"""What a site says of images: why it runs none, and the bytes a pull of a held one moves."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from federation.agent.accounts import task_accounts
from federation.agent.containers import Containers, ContainerSettings, pull_bytes, store_flags
from federation.agent.embedded_core import EmbeddedCore
from federation.api.v1 import resources_pb2


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
