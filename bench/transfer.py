"""Stage-ins over a real shaped link: throughput, the link model's estimate, resumes.

A site's SeaweedFS runs in a network namespace behind a veth shaped with tc tbf (``--mbit``);
the host downloads an object from it by a signed URL with the agent's own ``download`` (as a
dependant's site does), three times: the first teaches the link model (``TransferLinks``, what
the coordinator learns from ``StageProgress``), the second is compared with the model's
estimate, the third is cut by taking the link down mid-way and must resume and arrive intact.
Then a federation: two sites, each agent and SeaweedFS in its own namespace at ``--mbit``, run
a two-task pipeline whose output of the same size goes from one site's store to the other; the
coordinator's traffic with the sites meanwhile is ``coordinator_bytes``. Last, a task that saved
a checkpoint of the same size at the first site is preempted there by urgent work and runs
again at the second from it, fetched over the link from the first site's store (the copy to a
second store is off, so the restore crosses the link): ``restore_s``, from the urgent job's
submission to the task running again, its checkpoint's digest checked.
Baselines from the same run: the same download from inside the namespace, over its own
loopback (what the store gives with no link in the way), and the estimate the unknown-link
default would have made. Needs root and iproute2.

    python bench/transfer.py [--mbit 200] [--mib 256] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import grpc
import structlog

from federation.agent.object_store import ObjectStoreSettings, SiteStore, Transfer, download
from federation.api.v1 import job_service_pb2, job_service_pb2_grpc, jobs_pb2
from federation.common.job_state import is_terminal
from federation.coordinator.data.transfers import TransferLinks
from federation.jobspec import job_spec_from_dict
from federation.local import LocalFederation, SiteSpec
from federation.placement.snapshot import UNKNOWN_BANDWIDTH_MBPS
from federation.security.identity import Identity, Role
from federation.security.pki import issue_client_files
from federation.security.tls import TlsFiles, channel_credentials
from federation.testing.netns import ShapedLinks, tcp_bytes, unavailable
from federation.testing.seaweedfs import LocalSeaweed

SITE = "cloud-b"


def _fetch_inside(namespace_cmd: list[str], url: str) -> float:
    """Seconds to read ``url`` from inside the namespace (the loopback baseline)."""
    code = (
        "import sys,time,urllib.request\n"
        "t=time.monotonic()\n"
        "with urllib.request.urlopen(sys.argv[1]) as r:\n"
        "    while r.read(1<<20): pass\n"
        "print(time.monotonic()-t)\n"
    )
    out = subprocess.run(
        [*namespace_cmd, sys.executable, "-c", code, url], check=True, capture_output=True
    )
    return float(out.stdout)


MAKE = """
import os, sys
with open("out.bin", "wb") as out:
    for _ in range(int(sys.argv[1])):
        out.write(os.urandom(1 << 20))
"""


def _pinned(name: str, namespace_cmd: list[str], ip: str, store: dict[str, object]) -> SiteSpec:
    """A site run in its namespace, with a GPU model of its own for tasks to pin themselves."""
    device = {"kind": "GPU", "vendor": "nvidia", "model": f"M-{name}", "count": 1}
    node = {"name": "n", "cpu_cores": 4, "memory_mib": 4096, "devices": [device]}
    settings = {"object_store": store, "probe_listen": f"{ip}:0", "service_address": ip}
    return SiteSpec(name, "datacenter", [node], settings=settings, prefix=tuple(namespace_cmd))


async def _pipeline(fed: LocalFederation, mib: int, sites: list[str]) -> jobs_pb2.Job:
    """Run make (first site) -> use (second site, its input staged in); the finished job."""

    def at(site: str) -> dict[str, object]:
        return {"cpu": 1, "accelerator": {"kind": 1, "count": 1, "models": [f"M-{site}"]}}

    tasks = [
        {
            "name": "make",
            "command": [sys.executable, "-c", MAKE, str(mib)],
            "resources": at(sites[0]),
            "outputs": [{"name": "data", "path": "out.bin"}],
        },
        {
            "name": "use",
            "command": [sys.executable, "-c", "import os; print(os.path.getsize('in.bin'))"],
            "resources": at(sites[1]),
            "depends_on": ["make"],
            "inputs": [{"dataset": "task:make.data", "path": "in.bin"}],
        },
    ]
    spec = job_spec_from_dict({"name": "transfer-bench", "tasks": tasks})
    async with grpc.aio.secure_channel(
        fed.address, channel_credentials(_tenant_tls(fed))
    ) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        job_id = (await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec))).job.id
        while True:  # a poll each second is a few hundred bytes, on the host's own loopback
            job = (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job
            if is_terminal(job.state):
                return job
            await asyncio.sleep(1)


SAVE = """
import hashlib, os, sys, time
markers, mib = sys.argv[1], int(sys.argv[2])
restore = os.environ.get("FEDERATION_RESTORE_FROM", "")
if restore:
    digest = hashlib.sha256()
    with open(restore, "rb") as saved:
        while block := saved.read(1 << 20):
            digest.update(block)
    open(os.path.join(markers, "restored"), "w").write(digest.hexdigest())
else:
    path = os.path.join(os.environ["FEDERATION_CHECKPOINT_DIR"], "step-1.bin")
    digest = hashlib.sha256()
    with open(path, "wb") as out:
        for _ in range(mib):
            block = os.urandom(1 << 20)
            digest.update(block)
            out.write(block)
    open(os.path.join(markers, "saved"), "w").write(digest.hexdigest())
    open(path + ".done", "w").close()
while True:
    time.sleep(1)
"""
"""Saves one checkpoint of ``mib`` MiB, or, restored, records the digest of the one it got."""

CLASSES = (
    "preemption_min_run_s = 0.0\n"
    '[priority_classes.urgent]\nvalue = 900\nmay_preempt = true\ntenants = ["bench"]\n'
    "[priority_classes.batch]\nvalue = -100\n"
)


def _tenant_tls(fed: LocalFederation) -> TlsFiles:
    files = issue_client_files(fed.pki, Identity(Role.TENANT, "bench"))
    return TlsFiles(ca=fed.pki.ca_cert, cert=files[0], key=files[1])


async def _restore(fed: LocalFederation, mib: int, sites: list[str], markers: Path) -> float:
    """Seconds from an urgent job's submission at the first site to the preempted task
    running again at the second, restored from its ``mib`` MiB checkpoint."""

    def at(*names: str) -> dict[str, object]:
        return {
            "cpu": 1,
            "accelerator": {"kind": 1, "count": 1, "models": [f"M-{n}" for n in names]},
        }

    def job(name: str, priority_class: str, command: list[str], *sites_: str) -> jobs_pb2.JobSpec:
        task: dict[str, object] = {"name": "t", "command": command, "resources": at(*sites_)}
        if name == "saver":
            task["checkpoint"] = {"interval_s": 0.5, "replicate": False}
        return job_spec_from_dict({"name": name, "priority_class": priority_class, "tasks": [task]})

    sleep = [sys.executable, "-c", "import time; time.sleep(3600)"]
    saver = job("saver", "batch", [sys.executable, "-c", SAVE, str(markers), str(mib)], *sites)
    async with grpc.aio.secure_channel(fed.address, channel_credentials(_tenant_tls(fed))) as ch:
        stub = job_service_pb2_grpc.JobServiceStub(ch)

        async def task_of(job_id: str) -> jobs_pb2.TaskStatus:
            reply = await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
            return reply.job.tasks[0]

        async def submit(spec: jobs_pb2.JobSpec) -> str:
            return (await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec))).job.id

        async def until(job_id: str, holds: Callable[[jobs_pb2.TaskStatus], bool]) -> None:
            deadline = time.monotonic() + 600
            while not holds(task := await task_of(job_id)):
                if time.monotonic() > deadline or is_terminal(task.state):
                    state = jobs_pb2.JobState.Name(task.state)
                    raise RuntimeError(f"{job_id}: {state} {task.reason}")
                await asyncio.sleep(0.1)

        # The second site is taken while the saver starts, so it starts at the first.
        blocker_id = await submit(job("blocker", "", sleep, sites[1]))
        await until(blocker_id, lambda t: t.state == jobs_pb2.JOB_STATE_RUNNING)
        job_id = await submit(saver)
        await until(job_id, lambda t: t.checkpoint.HasField("stored"))
        first = (await task_of(job_id)).epoch
        await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=blocker_id))
        await until(blocker_id, lambda t: t.state == jobs_pb2.JOB_STATE_CANCELLED)
        began = time.monotonic()
        urgent_id = await submit(job("urgent", "urgent", sleep, sites[0]))
        restored = markers / "restored"
        await until(
            job_id,
            lambda t: (
                t.state == jobs_pb2.JOB_STATE_RUNNING and t.epoch > first and restored.exists()
            ),
        )
        took = time.monotonic() - began
        task = await task_of(job_id)
        for done in (job_id, urgent_id):
            await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=done))
    if task.site != sites[1]:
        raise RuntimeError(f"the task ran again at {task.site}, not {sites[1]}")
    if (markers / "restored").read_text() != (markers / "saved").read_text():
        raise RuntimeError("the restored checkpoint's digest differs from the saved one's")
    return took


def coordinator_run(mbit: float, mib: int) -> dict[str, object]:
    """Bytes between the coordinator and the sites while a pipeline moves ``mib`` MiB; then
    the restore of a ``mib`` MiB checkpoint at the second site after a preemption."""
    sites = ["dc-b", "cloud-b"]
    with tempfile.TemporaryDirectory() as work, ShapedLinks(first_index=11) as links:
        root = Path(work)
        (root / "coordinator.toml").write_text(CLASSES)
        args = ["--config", str(root / "coordinator.toml")]
        fed = LocalFederation(root / "fed", [], host=links.host_ip, coordinator_args=args)
        stores: list[LocalSeaweed] = []
        try:
            for name in sites:
                ns = links.add(name, mbit)
                (root / name).mkdir()
                weed = LocalSeaweed.start(root / name, [name], host=ns.ip, wrap=ns.command)
                stores.append(weed)
                store = weed.site_store(name, root / name)
                fed.sites.append(_pinned(name, ns.command([]), ns.ip, store))
            asyncio.run(fed.start())
            ips = [ns.ip for ns in links.sites.values()]
            before = tcp_bytes(fed.port, ips), links.bridge_bytes()
            job = asyncio.run(_pipeline(fed, mib, sites))
            grpc_bytes = tcp_bytes(fed.port, ips) - before[0]
            host_bytes = links.bridge_bytes() - before[1]
            (root / "markers").mkdir()
            os.chmod(root / "markers", 0o777)  # the tasks' accounts write there
            restore_s = asyncio.run(_restore(fed, mib, sites, root / "markers"))
        finally:
            fed.stop()
            for weed in stores:
                weed.stop()
    if job.state != jobs_pb2.JOB_STATE_SUCCEEDED:
        raise RuntimeError(f"the pipeline failed: {[t.reason for t in job.tasks]}")
    return {
        "coordinator_bytes": grpc_bytes,
        "host_bytes": host_bytes,
        "data_bytes": mib << 20,
        "restore_s": restore_s,
    }


def run(mbit: float, mib: int) -> dict[str, object]:
    size = mib * 1024 * 1024
    with tempfile.TemporaryDirectory() as work, ShapedLinks() as links:
        root = Path(work)
        site = links.add(SITE, mbit)
        (root / "weed").mkdir()
        weed = LocalSeaweed.start(root / "weed", [SITE], host=site.ip, wrap=site.command)
        try:
            keys = weed.buckets[SITE]
            (root / "id").write_text(keys.access_key_id)
            (root / "secret").write_text(keys.secret_access_key)
            store = SiteStore(
                ObjectStoreSettings(
                    bucket=SITE,
                    endpoint=weed.endpoint,
                    access_key_id_file=root / "id",
                    secret_access_key_file=root / "secret",
                )
            )
            data = root / "object.bin"
            with data.open("wb") as out:
                for _ in range(mib):
                    out.write(os.urandom(1024 * 1024))
            stored = store.upload(data, "federation/t/j/make/1/out", root)
            url = store.sign_get(stored.key, "t", 3600)
            baseline_s = _fetch_inside(site.command([]), url)

            def fetch(name: str, **options: object) -> Transfer:
                dest = root / name
                got = download(url, dest, size, stored.sha256, folder=False, **options)  # type: ignore[arg-type]
                if hashlib.sha256(dest.read_bytes()).hexdigest() != stored.sha256:
                    lost.append(name)
                dest.unlink()
                return got

            lost: list[str] = []
            model = TransferLinks()
            first = fetch("first")
            model.observe(SITE, "here", first.bytes, first.active_s)
            estimate_s = size * 8 / (model.bandwidth()[(SITE, "here")] * 1e6)
            second = fetch("second")

            # The third is cut: the link goes down once a quarter is in, and up again once the
            # download has given its connection up (it stalls 2 s without a byte).
            cut = threading.Event()

            def progress(held: int, _seconds: float) -> None:
                if held > size // 4 and not cut.is_set():
                    cut.set()
                    site.down()

            def watch() -> None:
                cut.wait()
                time.sleep(4)  # past the 2 s stall: the connection is given up meanwhile
                site.up()

            watcher = threading.Thread(target=watch)
            watcher.start()
            third = fetch("third", stall_s=2.0, backoff_s=0.5, progress=progress)
            watcher.join()
        finally:
            weed.stop()
    shaped_bps = mbit * 1e6
    federation = coordinator_run(mbit, mib)
    return {
        "throughput_ratio": round(size * 8 / second.seconds / shaped_bps, 3),
        "estimate_error": round(abs(estimate_s - second.seconds) / second.seconds, 3),
        "coordinator_bytes": federation["coordinator_bytes"],
        "restore_s": round(float(cast(float, federation["restore_s"])), 2),
        "lost_objects": len(lost),
        "_baseline": {
            "loopback_ratio": round(size * 8 / baseline_s / shaped_bps, 3),
            "default_estimate_error": round(
                abs(size * 8 / (UNKNOWN_BANDWIDTH_MBPS * 1e6) - second.seconds) / second.seconds,
                3,
            ),
            "first_s": round(first.seconds, 2),
            "second_s": round(second.seconds, 2),
            "cut_resumes": third.resumes,
            "cut_bytes": third.bytes,
            "host_bytes": federation["host_bytes"],
            "data_bytes": federation["data_bytes"],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mbit", type=float, default=200.0, help="shaped rate, Mbit/s")
    parser.add_argument("--mib", type=int, default=256, help="object size, MiB")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    if (why := unavailable()) is not None:
        sys.exit(why)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    result = run(args.mbit, args.mib)
    baseline = result.pop("_baseline")
    if args.json:
        print(json.dumps(result))
        return
    assert isinstance(baseline, dict)
    rows = [
        ("throughput_ratio", result["throughput_ratio"], f"loopback {baseline['loopback_ratio']}"),
        (
            "estimate_error",
            result["estimate_error"],
            f"unknown-link default {baseline['default_estimate_error']}",
        ),
        (
            "coordinator_bytes",
            result["coordinator_bytes"],
            f"while {baseline['data_bytes']} B moved site to site; the host saw "
            f"{baseline['host_bytes']} B in all (link probes too)",
        ),
        (
            "restore_s",
            result["restore_s"],
            f"preempted -> running again at another site from a {args.mib} MiB checkpoint "
            f"over the link (one way at {args.mbit:g} Mbit/s: "
            f"{args.mib * 8 * 1.048576 / args.mbit:.1f} s)",
        ),
        (
            "lost_objects",
            result["lost_objects"],
            f"of 3 (one cut, resumed {baseline['cut_resumes']}x, {baseline['cut_bytes']} B)",
        ),
    ]
    print(f"{args.mib} MiB over a {args.mbit:g} Mbit/s link")
    for name, value, beside in rows:
        print(f"{name:<18} {value!s:>8}   {beside}")


if __name__ == "__main__":
    main()
