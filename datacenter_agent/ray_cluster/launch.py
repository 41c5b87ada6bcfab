"""A task's launch file: what its Ray job's launcher (``launcher.py``) starts, written in the
task's folder beside a copy of the launcher, and read again by an agent that adopts the job.

Blocking: call these through ``asyncio.to_thread``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from datacenter_agent.ray_cluster.task_data import replica_folder
from federation.common.keys import RunKey

LAUNCHER = Path(__file__).with_name("launcher.py")
FILE = "launch.json"


@dataclass(frozen=True, slots=True)
class Launch:
    """Where a task's launcher and its launch file are."""

    launcher: Path
    path: Path


def replica_env(
    site: str, key: RunKey, replica: int, devices: Sequence[Sequence[str]], replicas: int
) -> dict[str, str]:
    """The federation's variables of one replica, as an embedded site's task sees them."""
    return {
        "FEDERATION_JOB_ID": key[0],
        "FEDERATION_TASK": key[1],
        "FEDERATION_EPOCH": str(key[2]),
        "FEDERATION_SITE": site,
        "FEDERATION_REPLICA": str(replica),
        "FEDERATION_REPLICAS": str(replicas),
        "FEDERATION_DEVICES": ",".join(devices[replica] if devices else []),
    }


def write_launch(
    folder: Path,
    *,
    namespace: str,
    group: str,
    command: list[str],
    bundles: Sequence[Mapping[str, float]],
    env: Sequence[Mapping[str, str]],
) -> Launch:
    """Writes the launch file of one replica per bundle (each in its ``replica-N`` folder,
    ``FEDERATION_WORK_DIR`` added to its ``env``) and copies the launcher beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    launcher = folder / "ray_launcher.py"
    shutil.copyfile(LAUNCHER, launcher)
    replicas = []
    for index, (bundle, variables) in enumerate(zip(bundles, env, strict=True)):
        wanted = dict(bundle)
        cwd = replica_folder(folder, index)
        cwd.mkdir(exist_ok=True)
        replicas.append(
            {
                "cpu": wanted.pop("CPU", 0.0),
                "memory": int(wanted.pop("memory", 0.0)),
                "resources": {r: n for r, n in wanted.items() if not r.startswith("node:")},
                "env": {**variables, "FEDERATION_WORK_DIR": str(cwd)},
                "cwd": str(cwd),
            }
        )
    launch = {"namespace": namespace, "group": group, "command": command, "replicas": replicas}
    path = folder / FILE
    path.write_text(json.dumps(launch))
    return Launch(launcher, path)


def launch_devices(folder: Path) -> list[str]:
    """The devices an adopted job's launcher was given, from its launch file."""
    try:
        launch = json.loads((folder / FILE).read_text())
    except (OSError, ValueError):
        return []
    return [
        d
        for r in launch["replicas"]
        for d in r["env"].get("FEDERATION_DEVICES", "").split(",")
        if d
    ]
