"""Task specs and waits shared by the Slurm tests."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from federation.api.v1 import jobs_pb2, resources_pb2

WAIT_S = 30.0
T = TypeVar("T")


def gpu_task(
    code: str,
    *,
    gpus: int = 1,
    memory_mib: int = 256,
    replicas: int = 0,
    timeout_s: float = 0,
) -> jobs_pb2.TaskSpec:
    """A task running ``python -c code`` with ``gpus`` A100s and 1 CPU per replica."""
    return jobs_pb2.TaskSpec(
        name="main",
        command=[sys.executable, "-c", code],
        replicas=replicas,
        timeout_s=timeout_s,
        resources=jobs_pb2.ResourceRequest(
            cpu=1,
            memory_mib=memory_mib,
            accelerator=jobs_pb2.AcceleratorRequest(
                kind=resources_pb2.DEVICE_KIND_GPU, count=gpus, models=["A100-80GB"]
            ),
        ),
    )


# Counts steps from the restored one on, completing a checkpoint per step, until the file
# "go" exists. Markers (TAG = epoch-restarts): start-TAG holds FEDERATION_RESTORE_FROM,
# stopped-TAG appears when SIGTERM comes, and half a second later the checkpoint final-TAG.
CHECKPOINTING = """
import os, signal, sys, time
def mark(folder, name, text):  # whole: a test reads a marker the moment it appears
    temporary = os.path.join(os.path.dirname(folder), "." + name)
    open(temporary, "w").write(text)
    os.rename(temporary, os.path.join(folder, name))
markers = os.environ["MARKERS"]
tag = os.environ["FEDERATION_EPOCH"] + "-" + os.environ.get("SLURM_RESTART_COUNT", "0")
folder = os.environ["FEDERATION_CHECKPOINT_DIR"]
restore = os.environ.get("FEDERATION_RESTORE_FROM", "")
step = int(open(restore).read()) if restore else 0
def save(name):
    path = os.path.join(folder, name)
    open(path, "w").write(str(step))
    open(path + ".done", "w").close()
def stop(*_):
    open(os.path.join(markers, "stopped-" + tag), "w").close()
    time.sleep(0.5)  # a last checkpoint takes a while to write
    save("final-" + tag)
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
mark(markers, "start-" + tag, restore)
while not os.path.exists(os.path.join(markers, "go")):
    step += 1
    save("step-%04d" % step)
    time.sleep(0.2)
print("done at step", step)
"""


def checkpointing(markers: Path, gpus: int = 1) -> jobs_pb2.TaskSpec:
    """A task running CHECKPOINTING, its markers in ``markers``, looked at every 0.2 s."""
    markers.mkdir(exist_ok=True)
    spec = gpu_task(CHECKPOINTING, gpus=gpus)
    spec.env["MARKERS"] = str(markers)
    spec.checkpoint.interval_s = 0.2
    return spec


async def eventually(condition: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Polls ``condition`` (a real state, read again each time) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout_s:g}s")
        await asyncio.sleep(0.1)


async def until(read: Callable[[], Awaitable[T]], done: Callable[[T], bool], what: str) -> T:
    """Reads a real state again and again until ``done`` holds for it; returns it."""
    deadline = time.monotonic() + WAIT_S
    while True:
        value = await read()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {WAIT_S:g}s; last: {value}")
        await asyncio.sleep(0.1)
