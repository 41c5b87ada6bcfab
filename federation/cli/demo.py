"""``fedctl demo``: a real federation on loopback running a mix of real jobs.

A coordinator and three site agents (edge with declared NPUs, datacenter with declared GPUs
plus this machine, cloud with declared H100s and a price) run as separate processes over
mutual TLS. The jobs are real processes; where each lands depends on what it asks for.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

from rich.table import Table

from federation.api.v1 import job_service_pb2, job_service_pb2_grpc, jobs_pb2
from federation.cli.connection import CliError
from federation.cli.demo_data import features_moved, start_stores, with_data
from federation.cli.explain import explanation_table
from federation.cli.output import output_of, show
from federation.cli.remote import cmd_status
from federation.cli.render import console, event_line, text
from federation.common.job_state import is_terminal
from federation.jobspec import job_spec_from_dict, state_name
from federation.local import LocalFederation, SiteSpec
from federation.testing.slurm_cluster import (
    LocalNode,
    LocalSlurmCluster,
    SlurmClusterError,
    missing_binaries,
)
from federation.watch import events_of

NPU = {
    "kind": "NPU",
    "vendor": "huawei",
    "model": "Ascend-910B",
    "memory_mib": 65536,
    "tflops_fp16": 320,
    "power_tdp_watts": 310,
    "attributes": {"cann": "8.0.0"},
}
A100 = {
    "kind": "GPU",
    "vendor": "nvidia",
    "model": "A100-80GB",
    "memory_mib": 81920,
    "tflops_fp16": 312,
    "power_tdp_watts": 400,
    "attributes": {"cuda": "12.4"},
}
H100 = {
    "kind": "GPU",
    "vendor": "nvidia",
    "model": "H100-80GB",
    "memory_mib": 81920,
    "tflops_fp16": 989,
    "power_tdp_watts": 700,
    "attributes": {"cuda": "12.4"},
}

DEMO_SITES = [
    SiteSpec(
        "edge-shanghai",
        "edge",
        region="cn-east",
        nodes=[
            {
                "name": "edge-box-1",
                "arch": "aarch64",
                "cpu_cores": 16,
                "memory_mib": 32768,
                "labels": {"cann": "8.0.0"},
                "devices": [{**NPU, "count": 2, "interconnect_group": "hccs-0"}],
            },
        ],
        # The camera data lives here; the uplink to Frankfurt is fair, to the US thin.
        settings={
            "datasets": {"camera-frames": 200 * 10**9},
            "links": [
                {"peer": "dc-frankfurt", "bandwidth_mbps": 1000.0, "rtt_ms": 180.0},
                {"peer": "cloud-us-east", "bandwidth_mbps": 50.0, "rtt_ms": 220.0},
            ],
        },
    ),
    SiteSpec(
        "dc-frankfurt",
        "datacenter",
        region="eu-central",
        discover_host=True,
        nodes=[
            {
                "name": f"dgx-{i}",
                "arch": "x86_64",
                "cpu_cores": 128,
                "memory_mib": 1048576,
                "labels": {"cuda": "12.4", "driver": "550.54"},
                "devices": [{**A100, "count": 4, "interconnect_group": f"nvlink-{i}"}],
            }
            for i in (1, 2)
        ],
    ),
    SiteSpec(
        "cloud-us-east",
        "cloud",
        region="us-east-1",
        price_per_device_hour=2.9,
        nodes=[
            {
                "name": "p5-1",
                "arch": "x86_64",
                "cpu_cores": 192,
                "memory_mib": 2097152,
                "labels": {"cuda": "12.4", "driver": "550.90"},
                "devices": [{**H100, "count": 8, "interconnect_group": "nvswitch-0"}],
            },
        ],
    ),
]

SLURM_NODE = LocalNode(name="dgx-1", cpus=128, memory_mib=1048576, gpus={"a100": 8})
"""The node of ``fedctl demo --slurm``'s Slurm: this machine, declared as a DGX."""

SHOW_DEVICES = (
    "import os, time; "
    "print('devices:', os.environ.get('FEDERATION_DEVICES', '-'), "
    "'CUDA_VISIBLE_DEVICES=' + os.environ.get('CUDA_VISIBLE_DEVICES', ''), "
    "'ASCEND_RT_VISIBLE_DEVICES=' + os.environ.get('ASCEND_RT_VISIBLE_DEVICES', '')); "
    "time.sleep({seconds})"
)


def _task(
    name: str,
    seconds: float,
    resources: dict[str, object],
    *,
    exit_code: int = 0,
    replicas: int = 1,
) -> dict[str, object]:
    code = SHOW_DEVICES.format(seconds=seconds)
    if exit_code:
        code += f"; print('step failed: bad input shard'); raise SystemExit({exit_code})"
    return {
        "name": name,
        "command": [sys.executable, "-c", code],
        "replicas": replicas,
        "resources": resources,
    }


def demo_jobs() -> list[jobs_pb2.JobSpec]:
    docs: list[dict[str, object]] = [
        {
            "name": "npu-inference",
            "tasks": [
                _task(
                    "serve",
                    1.5,
                    {"cpu": 2, "memory_mib": 4096, "accelerator": {"kind": "NPU", "count": 1}},
                )
            ],
        },
        {
            "name": "edge-etl",
            "constraints": {"domains": ["edge"]},
            "tasks": [_task("extract", 1.0, {"cpu": 1, "memory_mib": 1024})],
        },
        {
            "name": "a100-train",
            "tasks": [
                _task(
                    "train",
                    2.0,
                    {
                        "cpu": 16,
                        "memory_mib": 65536,
                        "accelerator": {"kind": "GPU", "count": 4, "models": ["A100-80GB"]},
                    },
                )
            ],
        },
        {
            "name": "h100-finetune",
            "tasks": [
                _task(
                    "finetune",
                    2.0,
                    {
                        "cpu": 32,
                        "memory_mib": 131072,
                        "accelerator": {"kind": "GPU", "count": 2, "models": ["H100-80GB"]},
                    },
                )
            ],
        },
        {
            "name": "gang-2x2-gpu",
            "tasks": [
                _task(
                    "worker",
                    1.5,
                    {"cpu": 8, "memory_mib": 16384, "accelerator": {"kind": "GPU", "count": 2}},
                    replicas=2,
                )
            ],
        },
        {
            "name": "flaky-step",
            "constraints": {"domains": ["datacenter"]},
            "tasks": [_task("step", 0.5, {"cpu": 1, "memory_mib": 512}, exit_code=3)],
        },
        {
            # Preprocess next to the data on an edge NPU, then train where the 20 GB of
            # features get to fast GPUs soonest: the link matrix decides between sites.
            "name": "camera-pipeline",
            "tasks": [
                {
                    **_task(
                        "preprocess",
                        1.0,
                        {"cpu": 2, "memory_mib": 4096, "accelerator": {"kind": "NPU", "count": 1}},
                    ),
                    "inputs": [{"dataset": "camera-frames"}],
                    "output_bytes": 20 * 10**9,
                    "estimated_duration_s": 600,
                },
                {
                    **_task(
                        "train",
                        1.5,
                        {
                            "cpu": 16,
                            "memory_mib": 65536,
                            "accelerator": {"kind": "GPU", "count": 2},
                        },
                    ),
                    "depends_on": ["preprocess"],
                    "requires": {"cuda": ">=12.1"},
                    "estimated_duration_s": 3600,
                },
            ],
        },
        {
            "name": "too-big",
            "tasks": [
                _task(
                    "train",
                    1.0,
                    {"cpu": 8, "memory_mib": 8192, "accelerator": {"kind": "GPU", "count": 16}},
                )
            ],
        },
    ]
    return [job_spec_from_dict(doc, source=str(doc["name"])) for doc in docs]


def slurm_site(conf: Path, partition: str) -> SiteSpec:
    """dc-frankfurt as a Slurm site: its A100s are a local Slurm's, which runs its jobs."""
    a100 = {key: A100[key] for key in ("model", "vendor", "memory_mib", "attributes")}
    slurm = {"partition": partition, "conf": conf, "poll_interval_s": 0.5, "gres": {"a100": a100}}
    return SiteSpec(
        "dc-frankfurt",
        "datacenter",
        region="eu-central",
        settings={"scheduler": "slurm", "slurm": slurm},
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser("demo", help="run a local federation and a mix of real jobs")
    demo.add_argument("--dir", type=Path, help="work folder (default: a temporary one)")
    demo.add_argument("--keep", action="store_true", help="keep the work folder afterwards")
    demo.add_argument(
        "--slurm",
        action="store_true",
        help="run the datacenter site on a real local Slurm (needs slurm-wlm, munge and root)",
    )
    demo.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    if output_of(args).is_data:
        raise CliError(
            "fedctl demo shows a run to people and has no JSON or YAML. To fix: leave out "
            "-o/--json, or run the other commands with -o json against a federation"
        )
    root = args.dir or Path(tempfile.mkdtemp(prefix="federation-demo-"))
    slurm = None
    stores = None
    sites = DEMO_SITES
    try:
        if args.slurm:
            slurm = start_slurm(root / "slurm")
            sites = [
                slurm_site(slurm.conf, slurm.partition) if site.domain == "datacenter" else site
                for site in DEMO_SITES
            ]
        stores, sites = start_stores(root / "stores", sites)
        fed = LocalFederation(root, sites)
        try:
            return asyncio.run(run_demo(fed, data=stores is not None))
        finally:
            fed.stop()
    finally:
        if stores is not None:
            stores.stop()
        if slurm is not None:
            slurm.stop()
        if args.keep or args.dir:
            console.print(text(f"work folder kept: {root} (logs in {root / 'logs'})", "dim"))
        else:
            shutil.rmtree(root, ignore_errors=True)


def start_slurm(root: Path) -> LocalSlurmCluster:
    """A one-node Slurm (8 A100s declared as GRES) for the datacenter site.

    Raises:
        CliError: Slurm is not installed, this is not root, or the cluster did not start.
    """
    if missing := missing_binaries():
        raise CliError(
            f"--slurm needs Slurm and munge ({', '.join(missing)} not found). "
            "To fix: apt-get install slurm-wlm munge"
        )
    if os.geteuid() != 0:
        raise CliError("--slurm needs root: slurmd starts jobs as their users")
    root.mkdir(parents=True, exist_ok=True)
    cluster = LocalSlurmCluster(root, node=SLURM_NODE)
    console.print(text(f"starting a local Slurm (munged, slurmctld, slurmd) in {root}..."))
    try:
        cluster.start()
    except SlurmClusterError as err:
        cluster.stop()
        raise CliError(str(err)) from None
    return cluster


async def run_demo(fed: LocalFederation, *, data: bool = False) -> int:
    """Run the demo's jobs; ``data``: the sites have object stores, and the camera pipeline
    moves real features from the edge to where it trains."""
    console.rule("Federation demo")
    console.print("starting a coordinator and 3 site agents as separate processes (mTLS)...")
    if data:
        console.print("each site has its own bucket in a SeaweedFS on loopback (weed)")
    await fed.start()
    await cmd_status(argparse.Namespace(json=False), fed.operator())
    specs = demo_jobs()
    if data:
        with_data(next(spec for spec in specs if spec.name == "camera-pipeline"))
    async with fed.operator().channel() as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        submitted = (await stub.SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=specs))).jobs
        ids = {job.id: job.spec.name for job in submitted}
        # include_current: the stream starts with each job's state now, so nothing is missed.
        watch = stub.WatchJobs(
            job_service_pb2.WatchJobsRequest(job_ids=list(ids), include_current=True)
        )
        console.print(f"submitted {len(ids)} jobs; events as they happen:")
        big = next(job.id for job in submitted if job.spec.name == "too-big")
        done: set[str] = set()
        cancel_sent = False
        async for event in events_of(watch):
            if event.job_id not in ids:
                continue
            show(text("  " + event_line(event)))
            if is_terminal(event.job_state):
                done.add(event.job_id)
            if not cancel_sent and done >= set(ids) - {big}:
                cancel_sent = True
                console.print(
                    "every job that fits has ended; cancelling too-big, which fits nowhere"
                )
                await stub.CancelJob(
                    job_service_pb2.CancelJobRequest(
                        job_id=big, reason="demo over: no site has 16 GPUs on one node"
                    )
                )
            if done == set(ids):
                break
        watch.cancel()
        final = [(await stub.GetJob(job_service_pb2.GetJobRequest(job_id=i))).job for i in ids]
        pipeline = next(i for i, name in ids.items() if name == "camera-pipeline")
        why = await stub.ExplainJob(job_service_pb2.ExplainJobRequest(job_id=pipeline))
    show(results_table(final))
    console.print("why camera-pipeline's train task went where it did (as the federation is now):")
    show(*(explanation_table(task) for task in why.tasks if task.task == "train"))
    ok = {job.spec.name: state_name(job.state) for job in final}
    expected = {"flaky-step": "FAILED", "too-big": "CANCELLED"}
    wrong = {n: s for n, s in ok.items() if s != expected.get(n, "SUCCEEDED")}
    if data:
        moved = features_moved(next(job for job in final if job.id == pipeline))
        console.print(moved or text("camera-pipeline's features did not arrive intact", "red"))
        if moved is None:
            wrong["camera-pipeline"] = "features not intact"
    if wrong:
        console.print(text(f"unexpected outcomes: {wrong}", "red"))
        return 1
    console.print("[green]every job ended as expected[/green]")
    return 0


def results_table(jobs: list[jobs_pb2.Job]) -> Table:
    table = Table(title="Where each job ran and how it ended")
    for column in ("job", "task", "site", "devices", "state", "exit", "note"):
        table.add_column(column, overflow="fold")
    for job in jobs:
        for task in job.tasks:
            note = ""
            if task.state == jobs_pb2.JOB_STATE_FAILED:
                lines = task.output_tail.strip().splitlines()
                note = f"{task.reason}: {lines[-1]}" if lines else task.reason
            elif task.state != jobs_pb2.JOB_STATE_SUCCEEDED:
                note = task.reason
            cells = (
                job.spec.name,
                task.name,
                task.site or "-",
                " ".join(task.devices) or "-",
                state_name(task.state),
                str(task.exit_code) if is_terminal(task.state) else "-",
                note,
            )
            table.add_row(*map(text, cells))
    return table
