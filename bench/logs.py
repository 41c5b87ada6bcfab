"""How fast a task's log streams to a client, end to end.

A real coordinator and agent (embedded store, mTLS, loopback). A task writes N lines; once it
has ended, ``Client.logs`` reads them all through the coordinator, which asks the agent over
its stream (``ReadLogs``) about 1 MiB at a time. Baseline, in the same run: the same lines
read straight from the site's log files with the agent's own reader, no network and no
coordinator.

    python bench/logs.py [--lines 200000] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from federation.agent.task_logs import read_log
from federation.api.v1 import site_link_service_pb2
from federation.client import Client
from federation.local import LocalFederation
from federation.testing.cluster import cpu_site

LINE = "log line %07d of a task that writes a lot"


def task_code(lines: int) -> str:
    return f"import sys\nw = sys.stdout.write\nfor i in range({lines}): w('{LINE}\\n' % i)\n"


def replica_dir(root: Path, job_id: str) -> Path:
    """Where the site keeps the task's replica 0's supervisor files (its log among them)."""
    return next(root.rglob(f"{job_id}/t/*.run/0"))


def read_locally(run_dir: Path) -> int:
    """Every line, through the agent's reader, as the site would answer them."""
    request, count = site_link_service_pb2.ReadLogs(), 0
    while True:
        answer = read_log(run_dir, request)
        count += len(answer.lines)
        if not answer.more:
            return count
        request.after_ns = answer.lines[-1].stamp_ns


async def measure(lines: int, repeat: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-logs-") as root:
        fed = LocalFederation(Path(root), [cpu_site("bench-logs")])
        await fed.start()
        try:
            async with Client(fed.address, fed.operator().tls) as client:
                task = {
                    "name": "t",
                    "command": [sys.executable, "-c", task_code(lines)],
                    "resources": {"cpu": 1, "memory_mib": 64},
                }
                job = await client.submit({"name": "loud", "tasks": [task]})
                await client.wait([job.id])
                streamed, local = [], []
                run_dir = await asyncio.to_thread(replica_dir, Path(root), job.id)
                for _ in range(repeat):
                    start, count = time.perf_counter(), 0
                    async for _line in client.logs(job.id):
                        count += 1
                    assert count == lines, (count, lines)
                    streamed.append(count / (time.perf_counter() - start))
                    start = time.perf_counter()
                    assert read_locally(run_dir) == lines
                    local.append(lines / (time.perf_counter() - start))
        finally:
            fed.stop()
    return {
        "lines": float(lines),
        "log_lines_per_s": statistics.median(streamed),
        "local_lines_per_s": statistics.median(local),
        "streamed_vs_local": statistics.median(streamed) / statistics.median(local),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(measure(args.lines, args.repeat))
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    print(f"{'lines':>8} {'streamed lines/s':>17} {'local lines/s':>14} {'ratio':>6}")
    print(
        f"{int(result['lines']):>8} {result['log_lines_per_s']:>17,.0f} "
        f"{result['local_lines_per_s']:>14,.0f} {result['streamed_vs_local']:>6.2f}"
    )


if __name__ == "__main__":
    main()
