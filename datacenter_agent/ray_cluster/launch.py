"""A task's launch file: what its Ray job's launcher (``launcher.py``) starts, written in the
task's folder beside a copy of the launcher, and read again by an agent that adopts the job;
and the job's submission.

Blocking: call these through ``asyncio.to_thread``.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datacenter_agent.ray_cluster.task_data import replica_folder
from datacenter_agent.ray_cluster.tasks import Held
from federation.agent.config import RaySettings
from federation.common.keys import RunKey

LAUNCHER = Path(__file__).with_name("launcher.py")
FILE = "launch.json"
REPLICA_LOST = 75
"""The launcher's exit code when a replica's actor died under it (its node lost, say), rather
than its process ending: EX_TEMPFAIL."""


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
    launch = {
        "namespace": namespace,
        "group": group,
        "command": command,
        "replicas": replicas,
        "lost_code": REPLICA_LOST,
    }
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


def submit_job(
    jobs: Any,
    held: Held,
    sid: str,
    folder: Path,
    *,
    settings: RaySettings,
    site: str,
    env: Mapping[str, str],
    kill_grace_s: float,
) -> None:
    """Writes the launch file of ``held``'s task (its data's variables ``env`` given to every
    replica) and submits its Ray job as ``sid`` through ``jobs`` (Ray's Jobs API client); a
    retried commit finds the job it submitted."""
    spec, replicas = held.spec, len(held.bundles)
    launch = write_launch(
        folder,
        namespace=settings.namespace,
        group=held.name,
        command=list(spec.command),
        bundles=held.bundles,
        env=[
            {
                **spec.env,
                **replica_env(site, held.key, index, held.replica_devices, replicas),
                **env,
            }
            for index in range(replicas)
        ],
    )
    try:
        jobs.submit_job(
            entrypoint=f"{settings.python} {launch.launcher} {launch.path}",
            submission_id=sid,
            metadata={"federation_site": site, "federation_group": held.name},
            runtime_env={"env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": str(math.ceil(kill_grace_s))}},
            entrypoint_num_cpus=0,
        )
    except RuntimeError as err:
        if "already exists" not in str(err):  # a retried commit
            raise
