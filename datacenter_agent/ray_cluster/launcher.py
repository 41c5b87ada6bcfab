"""The entrypoint of a federation task's Ray job: one actor per replica, in the task's group.

The Ray core copies this file into the task's folder and submits ``python ray_launcher.py
launch.json`` as a 0-CPU job. It imports only Ray, so the cluster needs nothing of the
federation. Each replica is an actor placed in its bundle of the task's placement group (which
holds the capacity the offer reserved) that runs the task's command as a process. A job-level
resource request naming a bundle's resource crashed the raylet when this was written; actors
scheduled into the bundles do not.

Ray stops a job with SIGTERM to this process; it is passed on to every replica's process,
whose own handler may save a checkpoint, and this launcher exits once they have ended. Its exit
code is the first failing replica's, or the launch file's ``lost_code`` when a replica's actor
died under it (its node lost, say): the agent then waits for Ray's word on the node before it
calls the task failed.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

ray: Any = importlib.import_module("ray")  # untyped here: the cluster's Ray, any version
strategies: Any = importlib.import_module("ray.util.scheduling_strategies")

TAIL_CHARS = 4000
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """A replica's process dies with its actor, which Ray kills when the job is killed."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class Replica:
    """Runs one replica's process; ``terminate`` may be called while ``run`` waits."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[str] | None = None
        self.stopped = threading.Event()

    def run(self, command: list[str], env: dict[str, str], cwd: str) -> tuple[int, str]:
        if self.stopped.is_set():
            return 143, ""
        self.process = subprocess.Popen(
            command,
            env={**os.environ, **env},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=_die_with_parent,  # only prctl: safe between fork and exec
        )
        output, _ = self.process.communicate()
        return self.process.returncode, output[-TAIL_CHARS:]

    def terminate(self) -> None:
        self.stopped.set()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)


def main(path: str) -> int:
    with open(path, encoding="utf-8") as file:
        launch: dict[str, Any] = json.load(file)
    ray.init(address="auto", namespace=launch["namespace"], log_to_driver=False)
    group = ray.util.get_placement_group(launch["group"])
    remote = ray.remote(max_concurrency=2)(Replica)
    actors = []
    for index, replica in enumerate(launch["replicas"]):
        options: dict[str, Any] = {
            "num_cpus": replica["cpu"],
            "resources": replica["resources"],
            "scheduling_strategy": strategies.PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=index
            ),
        }
        if replica["memory"]:
            options["memory"] = replica["memory"]
        actors.append(remote.options(**options).remote())

    def stop(signum: int, _frame: object) -> None:
        threading.Thread(target=lambda: ray.get([a.terminate.remote() for a in actors])).start()

    signal.signal(signal.SIGTERM, stop)
    runs = [
        actor.run.remote(launch["command"], replica["env"], replica["cwd"])
        for actor, replica in zip(actors, launch["replicas"], strict=True)
    ]
    pending = list(runs)
    while pending:  # short waits: Python runs the SIGTERM handler only between them
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
    code, lost = 0, False
    for index, run in enumerate(runs):
        try:
            exit_code, output = ray.get(run)
        except ray.exceptions.RayActorError as err:  # its node died, or its worker did
            exit_code, output, lost = 1, f"replica {index} lost: {type(err).__name__}", True
        for line in output.splitlines():
            print(f"[replica {index}] {line}" if len(runs) > 1 else line)
        if exit_code != 0 and code == 0:
            code = exit_code if exit_code > 0 else 128 - exit_code
    sys.stdout.flush()
    return int(launch.get("lost_code", 1)) if lost else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
