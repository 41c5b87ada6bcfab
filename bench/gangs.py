"""Gangs across sites: do they start whole, together, and what do let-go reservations cost?

A real coordinator and three sites of 2 GPUs each (a declared inventory) on loopback. N jobs
of one 4-part task (1 GPU a part, so one gang fits the 6 GPUs at a time and the next must
wait) are submitted at once, twice: as all-or-nothing gangs, and as plain spread parts
(the baseline, placed each on its own). The jobs are watched every 0.1 s.

    python bench/gangs.py [--jobs 6] [--json]

JSON keys: ``partial_starts`` (gangs seen with a part running while another waited to be
placed; must be 0), ``gang_start_skew_s`` (p99 over gangs of the spread of their parts'
start times), ``reservation_waste_s`` (device-seconds held by gang parts' reservations that
were let go, per gang started), and the baseline's ``baseline_partial_starts`` and
``baseline_start_skew_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from federation.api.v1 import jobs_pb2
from federation.client import Client
from federation.common.job_state import is_terminal
from federation.local import LocalFederation, SiteSpec

PARTS = 4
SITES = ("bench-gang-a", "bench-gang-b", "bench-gang-c")
WASTE_METRIC = "federation_gang_reservation_device_seconds_total"


def site(name: str) -> SiteSpec:
    node = {
        "name": f"{name}-box",
        "cpu_cores": 8,
        "memory_mib": 16384,
        "devices": [{"kind": "GPU", "vendor": "nvidia", "model": "H100", "count": 2}],
    }
    return SiteSpec(name, "datacenter", nodes=[node], settings={"stop_tasks_on_exit": True})


def spec(name: str, gang: bool) -> dict[str, object]:
    task = {
        "name": "train",
        "command": [sys.executable, "-c", "import time; time.sleep(1)"],
        "replicas": PARTS,
        "resources": {"cpu": 1, "accelerator": {"kind": "GPU", "count": 1}},
        "spread": {"part_replicas": 1, "all_or_nothing": gang},
    }
    return {"name": name, "tasks": [task]}


def waste(fed: LocalFederation) -> float:
    url = f"http://127.0.0.1:{fed.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith(WASTE_METRIC + " "):
                return float(line.split()[1])
    return 0.0


async def run(client: Client, jobs: int, gang: bool) -> tuple[int, list[float]]:
    """Submits the jobs, watches them to the end: gangs seen partly started, and each
    gang's start skew."""
    label = "gang" if gang else "plain"
    ids = [(await client.submit(spec(f"{label}-{i}", gang))).id for i in range(jobs)]
    partial: set[str] = set()
    deadline = time.monotonic() + 300
    while True:
        found = [await client.get(job_id) for job_id in ids]
        for job in found:
            states = {t.state for t in job.tasks}
            if jobs_pb2.JOB_STATE_RUNNING in states and jobs_pb2.JOB_STATE_PENDING in states:
                partial.add(job.id)
        if all(is_terminal(job.state) for job in found):
            break
        if time.monotonic() > deadline:
            raise RuntimeError("the jobs did not end within 300 s")
        await asyncio.sleep(0.1)
    skews = []
    for job in found:
        starts = [t.started_at.ToNanoseconds() / 1e9 for t in job.tasks]
        skews.append(max(starts) - min(starts))
    return len(partial), skews


def p99(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[98]


async def measure(jobs: int) -> dict[str, float | int]:
    with tempfile.TemporaryDirectory(prefix="bench-gangs-") as root:
        args = ["--metrics-listen", "127.0.0.1:0"]
        fed = LocalFederation(Path(root), [site(n) for n in SITES], coordinator_args=args)
        await fed.start()
        try:
            async with Client(fed.address, fed.operator().tls) as client:
                partial, skews = await run(client, jobs, gang=True)
                wasted = waste(fed)
                base_partial, base_skews = await run(client, jobs, gang=False)
        finally:
            fed.stop()
    return {
        "jobs": jobs,
        "partial_starts": partial,
        "gang_start_skew_s": p99(skews),
        "reservation_waste_s": wasted / jobs,
        "baseline_partial_starts": base_partial,
        "baseline_start_skew_s": p99(base_skews),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(measure(args.jobs))
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    print(f"{'figure':<28} {'gangs':>9} {'plain parts':>12}")
    print(
        f"{'partial starts':<28} {result['partial_starts']:>9} "
        f"{result['baseline_partial_starts']:>12}"
    )
    print(
        f"{'start skew p99 s':<28} {result['gang_start_skew_s']:>9.3f} "
        f"{result['baseline_start_skew_s']:>12.3f}"
    )
    print(f"{'let-go device-s per gang':<28} {result['reservation_waste_s']:>9.3f} {'-':>12}")


if __name__ == "__main__":
    main()
