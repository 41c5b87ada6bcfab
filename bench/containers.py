"""Tasks from OCI images: what a container adds to a start, how well a pull is foreseen, and
how fast a task's log streams.

- ``start_overhead_s``: a real coordinator and agent (mTLS, loopback) run the same task, ``cat
  /proc/uptime``, now as a bare process and now in an image already in the agent's Podman
  store, in turns; each start is the kernel's uptime the task reads less the uptime just before
  its submit (one clock, inside the container or not), and the figure is the median container
  start less the median bare one, the baseline, measured in the same run.
- ``pull_estimate_error``: a registry in one network namespace, a puller in another, the
  puller's link shaped with tc (``--mbit``, the registry's 10x so the puller's is the narrow
  one). The puller measures its link with the agents' own probe (what a site publishes as its
  link to the coordinator), pulls the image once into one store, and reads it back as an agent
  publishes it (``Containers.images``: the bytes a pull moves); then it pulls into fresh
  stores, each timed, against placement's estimate (``estimates.pull_seconds`` of those bytes
  over the measured link). The figure is the median |estimated - measured| / measured; beside
  it, the error of the estimate the unknown-link default would make.
- ``log_lines_per_s``: ``bench/logs.py``'s figure (a task's lines read through the
  coordinator with ``Client.logs``), beside its local read.

Needs root, podman, docker-registry, busybox-static and iproute2.

    python bench/containers.py [--mbit 40] [--filler-mib 16] [--repeat 5] [--lines 100000] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import structlog
from logs import measure as measure_logs

from federation.agent.containers import Containers, ContainerSettings, store_flags
from federation.agent.links import DEFAULT_PAYLOAD_BYTES
from federation.client import Client
from federation.local import LocalFederation, SiteSpec
from federation.placement.estimates import pull_seconds
from federation.placement.snapshot import UNKNOWN_BANDWIDTH_MBPS, UNKNOWN_RTT_MS
from federation.testing import netns
from federation.testing import registry as oci
from federation.testing.netns import ShapedLinks

ROOT = Path(__file__).resolve().parents[1]
UIDS = "211000-211099"
LOCAL_IMAGE = "localhost/fedbench/busybox:1"
PROBE_SERVER = """
import asyncio, sys
from federation.common.probe import ProbeServer
async def serve():
    await ProbeServer(sys.argv[1]).start()
    await asyncio.Event().wait()
asyncio.run(serve())
"""
PROBE = """
import asyncio, json, sys
from federation.common.probe import measure_link
m = asyncio.run(measure_link(sys.argv[1], payload_bytes=int(sys.argv[2]), timeout_s=120))
print(json.dumps({"mbps": m.bandwidth_mbps, "rtt_ms": m.rtt_ms}))
"""


def uptime() -> float:
    return float(Path("/proc/uptime").read_text().split()[0])


async def start_overhead(repeat: int) -> dict[str, float]:
    """Median seconds from submit to the command's first act, bare and in a cached image."""
    with tempfile.TemporaryDirectory(prefix="bench-containers-") as work:
        root = Path(work)
        os.chmod(root, 0o755)  # the task uids reach their work folders below
        store = root / "store"
        flags = store_flags(store)
        await asyncio.to_thread(oci.import_image, oci.busybox_rootfs(root), LOCAL_IMAGE, flags)
        node = {"name": "n", "cpu_cores": 4, "memory_mib": 8192}
        settings = {
            "task_uid_range": UIDS,
            "work_dir": str(root / "tasks"),
            "run_tasks_as_agent": False,
            "containers": {"storage": str(store)},
        }
        site = SiteSpec("boxes", "datacenter", [node], settings=settings)
        fed = LocalFederation(root / "fed", [site])
        starts: dict[str, list[float]] = {"bare": [], "container": []}
        try:
            await fed.start()
            async with Client(fed.address, fed.operator().tls) as client:
                for turn in range(repeat + 1):  # the first of each warms up
                    for kind in ("bare", "container"):
                        task: dict[str, object] = {"name": "t", "command": ["cat", "/proc/uptime"]}
                        if kind == "container":
                            task["image"] = LOCAL_IMAGE
                        before = uptime()
                        job = await client.submit({"name": f"start-{kind}", "tasks": [task]})
                        await client.wait([job.id])
                        done = await client.get(job.id)
                        if not done.tasks[0].output_tail.strip():
                            raise RuntimeError(f"{kind} task: {done.tasks[0].reason}")
                        if turn:
                            started = float(done.tasks[0].output_tail.split()[0])
                            starts[kind].append(started - before)
        finally:
            fed.stop()
            await asyncio.to_thread(oci.podman, *flags, "rmi", "--all", "--force")
            shutil.rmtree(flags[1].removeprefix("--runroot="), ignore_errors=True)
    bare, boxed = statistics.median(starts["bare"]), statistics.median(starts["container"])
    return {"start_overhead_s": boxed - bare, "bare_start_s": bare, "container_start_s": boxed}


def _spawn_probe_server(space: netns.Namespace, endpoint: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    space.spawn([sys.executable, "-c", PROBE_SERVER, endpoint], env=env)


def _measure_link(space: netns.Namespace, endpoint: str) -> tuple[float, float]:
    """Mbit/s and RTT the agents' probe measures from inside ``space`` (the server may still
    be starting: tried for a while)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = space.command([sys.executable, "-c", PROBE, endpoint, str(DEFAULT_PAYLOAD_BYTES)])
    deadline = time.monotonic() + 30
    while True:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=180)
        if done.returncode == 0:
            found = json.loads(done.stdout)
            return float(found["mbps"]), float(found["rtt_ms"])
        if time.monotonic() > deadline:
            raise RuntimeError(f"the link probe failed: {done.stderr[-2000:]}")
        time.sleep(0.2)


def _pull(space: netns.Namespace, store: Path, image: str) -> float:
    """Seconds ``podman pull`` takes inside ``space`` into ``store``."""
    argv = ["podman", *store_flags(store), "pull", "--quiet", "--tls-verify=false", image]
    started = time.monotonic()
    done = subprocess.run(space.command(argv), capture_output=True, text=True, timeout=900)
    seconds = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(f"pull into {store}: {done.stderr.strip()}")
    return seconds


async def _published_pull_bytes(store: Path, image: str, work: Path) -> int:
    """The bytes a pull of ``image`` moves, as an agent on ``store`` publishes them."""
    containers = Containers(ContainerSettings(storage=str(store)), work)
    for held in await containers.images():
        if image in held.references:
            return int(held.pull_bytes)
    raise RuntimeError(f"{image} is not in {store}")


def pull_estimate(mbit: float, filler_mib: int, repeat: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-pulls-") as work, ShapedLinks(21) as links:
        root = Path(work)
        registry_ns = links.add("registry", mbit * 10)
        puller = links.add("puller", mbit)
        (root / "registry").mkdir()
        server = oci.LocalRegistry.start(
            root / "registry", f"{registry_ns.ip}:5000", wrap=registry_ns.command
        )
        stores = [root / f"store-{i}" for i in range(repeat + 2)]
        try:
            image = f"{registry_ns.ip}:5000/fedbench/filler:1"
            maker = stores[-1]
            oci.import_image(
                oci.busybox_rootfs(root, filler_mib=filler_mib), image, store_flags(maker)
            )
            server.push(image, store_flags(maker))
            probe = f"{registry_ns.ip}:7400"
            _spawn_probe_server(registry_ns, probe)
            mbps, rtt_ms = _measure_link(puller, probe)
            first = _pull(puller, stores[0], image)
            size = asyncio.run(_published_pull_bytes(stores[0], image, root))
            estimate = float(pull_seconds(size, np.array([mbps]), np.array([rtt_ms]))[0])
            default = float(
                pull_seconds(size, np.array([UNKNOWN_BANDWIDTH_MBPS]), np.array([UNKNOWN_RTT_MS]))[
                    0
                ]
            )
            measured = [_pull(puller, store, image) for store in stores[1:-1]]
        finally:
            for store in stores:
                flags = store_flags(store)
                if store.exists():
                    subprocess.run(
                        ["podman", *flags, "rmi", "--all", "--force"], capture_output=True
                    )
                shutil.rmtree(flags[1].removeprefix("--runroot="), ignore_errors=True)
            server.stop()
    errors = [abs(estimate - m) / m for m in measured]
    return {
        "pull_estimate_error": statistics.median(errors),
        "default_estimate_error": statistics.median(abs(default - m) / m for m in measured),
        "pull_bytes": float(size),
        "measured_mbps": mbps,
        "measured_rtt_ms": rtt_ms,
        "estimated_pull_s": estimate,
        "measured_pull_s": statistics.median(measured),
        "first_pull_s": first,
    }


def run(mbit: float, filler_mib: int, repeat: int, lines: int) -> dict[str, object]:
    start = asyncio.run(start_overhead(repeat))
    pulls = pull_estimate(mbit, filler_mib, max(1, repeat // 2))
    logs = asyncio.run(measure_logs(lines, 3))
    return {
        "start_overhead_s": round(start["start_overhead_s"], 3),
        "pull_estimate_error": round(pulls["pull_estimate_error"], 3),
        "log_lines_per_s": round(logs["log_lines_per_s"]),
        "_baseline": {
            "bare_start_s": round(start["bare_start_s"], 3),
            "container_start_s": round(start["container_start_s"], 3),
            "default_estimate_error": round(pulls["default_estimate_error"], 3),
            "pull_bytes": int(pulls["pull_bytes"]),
            "measured_mbps": round(pulls["measured_mbps"], 1),
            "measured_rtt_ms": round(pulls["measured_rtt_ms"], 2),
            "estimated_pull_s": round(pulls["estimated_pull_s"], 2),
            "measured_pull_s": round(pulls["measured_pull_s"], 2),
            "local_lines_per_s": round(logs["local_lines_per_s"]),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbit", type=float, default=40.0, help="the puller's link, Mbit/s")
    parser.add_argument("--filler-mib", type=int, default=16, help="random bytes in the image")
    parser.add_argument("--repeat", type=int, default=5, help="starts of each kind timed")
    parser.add_argument("--lines", type=int, default=100_000, help="log lines streamed")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    if (why := netns.unavailable() or oci.unavailable()) is not None:
        sys.exit(why)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    result = run(args.mbit, args.filler_mib, args.repeat, args.lines)
    baseline = result.pop("_baseline")
    if args.json:
        print(json.dumps(result))
        return
    assert isinstance(baseline, dict)
    rows = [
        (
            "start_overhead_s",
            result["start_overhead_s"],
            f"container {baseline['container_start_s']} s - bare {baseline['bare_start_s']} s "
            "(submit to first act, medians)",
        ),
        (
            "pull_estimate_error",
            result["pull_estimate_error"],
            f"estimated {baseline['estimated_pull_s']} s, pulled in {baseline['measured_pull_s']}"
            f" s ({baseline['pull_bytes']} B, {baseline['measured_mbps']} Mbit/s, "
            f"{baseline['measured_rtt_ms']} ms measured); unknown-link default "
            f"{baseline['default_estimate_error']}",
        ),
        (
            "log_lines_per_s",
            result["log_lines_per_s"],
            f"read locally {baseline['local_lines_per_s']}",
        ),
    ]
    print(f"image pulls over a {args.mbit:g} Mbit/s link, {args.repeat} starts of each kind")
    for name, value, beside in rows:
        print(f"{name:<20} {value!s:>9}   {beside}")


if __name__ == "__main__":
    main()
