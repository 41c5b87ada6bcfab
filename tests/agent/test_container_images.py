"""What a site says of images: why it runs none, and the bytes a pull of a held one moves."""

from __future__ import annotations

import json
from pathlib import Path

from federation.agent.containers import Containers, ContainerSettings, pull_bytes, store_flags


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
