"""One tenant floods the coordinator; how much slower another tenant's calls get, and what the
store keeps of the flood.

A real coordinator (embedded store, mTLS) with one CPU site. The victim, in this process, reads
its job with GetJob in a loop, quiet first (the baseline), then while the abuser runs in a
process of its own: costly CEL selectors (some that once passed the static check), specs of
3 MB, batches of 100 jobs that would hold the site's CPUs for ten minutes (the tenant's cap on
unfinished jobs refuses most), 1,000-job listings and 64 open watches, each retried as fast as
the coordinator answers, whatever it answers. ``victim_p99_ratio`` is the loaded p99 over
the quiet p99 of the same run; ``store_growth_mb`` is what the coordinator's data folder grew
by, also per 10,000 jobs the abuser had refused or accepted.

    python bench/abuse.py [--seconds 30] [--samples 1000] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from federation.api.v1 import job_service_pb2, job_service_pb2_grpc
from federation.jobspec import job_spec_from_dict
from federation.local import LocalFederation, SiteSpec
from federation.security.identity import Identity, Role
from federation.security.pki import issue_client_files
from federation.security.tls import TlsFiles, channel_credentials

FORTY = "[" + ",".join(str(i) for i in range(40)) + "]"
ZEROS = "[" + ",".join(["0"] * 900) + "]"
COSTLY_SELECTORS = (
    FORTY + ".all(a, " * 4 + "[1,2].all(e, true)" + ")" * 4,  # refused by its estimate
    f"size({ZEROS}.map(x, [0,0,0,0,0,0,0,0,0,0])) > 0",  # ran 9 s under the old estimate
    f"size({ZEROS}.filter(x, true)) > 0",
)


def tls_of(fed: LocalFederation, tenant: str) -> TlsFiles:
    cert, key = issue_client_files(fed.pki, Identity(Role.TENANT, tenant))
    return TlsFiles(ca=fed.pki.ca_cert, cert=cert, key=key)


def spec(name: str, tasks: list[dict[str, Any]]) -> Any:
    return job_spec_from_dict({"name": name, "tasks": tasks})


def abuse(address: str, tls: TlsFiles, seconds: float, counts: Any) -> None:
    """The abuser's process; ``counts`` gets (requests, refused, jobs accepted)."""
    asyncio.run(_abuse(address, tls, seconds, counts))


async def _abuse(address: str, tls: TlsFiles, seconds: float, counts: Any) -> None:
    options = [("grpc.max_send_message_length", 64 << 20)]
    channel = grpc.aio.secure_channel(address, channel_credentials(tls), options=options)
    stub = job_service_pb2_grpc.JobServiceStub(channel)
    deadline = time.monotonic() + seconds
    watches = [stub.WatchJobs(job_service_pb2.WatchJobsRequest()) for _ in range(64)]
    sleeper = {"name": "t", "command": ["/bin/sleep", "600"], "resources": {"cpu": 4}}
    costly = [
        spec("c", [{**sleeper, "resources": {"accelerator": {"count": 1, "selector": s}}}])
        for s in COSTLY_SELECTORS
    ]
    huge = spec("huge", [{**sleeper, "env": {f"V{i}": "x" * 30_000 for i in range(100)}}])
    flood = [spec(f"flood-{i}", [sleeper]) for i in range(100)]

    async def hammer(call: Any, request: Any, jobs: int) -> None:
        while time.monotonic() < deadline:
            counts[0] += 1
            try:
                await call(request, timeout=5)
                counts[2] += jobs
            except grpc.aio.AioRpcError:
                counts[1] += jobs or 1  # refused: keep pushing
                await asyncio.sleep(0)

    await asyncio.gather(
        *(hammer(stub.SubmitJob, job_service_pb2.SubmitJobRequest(spec=c), 1) for c in costly),
        hammer(stub.SubmitJob, job_service_pb2.SubmitJobRequest(spec=huge), 1),
        hammer(stub.SubmitJobs, job_service_pb2.SubmitJobsRequest(specs=flood), len(flood)),
        hammer(stub.ListJobs, job_service_pb2.ListJobsRequest(page_size=1000), 0),
    )
    for watch in watches:
        watch.cancel()
    with contextlib.suppress(Exception):
        await channel.close()


async def latencies(stub: Any, job_id: str, samples: int) -> list[float]:
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
        times.append(time.perf_counter() - start)
        await asyncio.sleep(0.01)
    return times


def p99(times: list[float]) -> float:
    return statistics.quantiles(times, n=100)[98]


def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


async def measure(fed: LocalFederation, seconds: float, samples: int) -> dict[str, float]:
    data = fed.root / "coordinator"
    tls = tls_of(fed, "alice")
    async with grpc.aio.secure_channel(fed.address, channel_credentials(tls)) as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        job = (
            await stub.SubmitJob(
                job_service_pb2.SubmitJobRequest(
                    spec=spec("mine", [{"name": "t", "command": ["true"]}])
                )
            )
        ).job
        await latencies(stub, job.id, samples // 5)  # warm the channel and the coordinator
        quiet = await latencies(stub, job.id, samples)
        before_mb = folder_mb(data)
        counts = multiprocessing.get_context("spawn").Array("q", 3)
        abuser = multiprocessing.get_context("spawn").Process(
            target=abuse, args=(fed.address, tls_of(fed, "mallory"), seconds, counts)
        )
        abuser.start()
        try:
            await asyncio.sleep(2.0)  # the abuse in full swing
            loaded = await latencies(stub, job.id, samples)
            was_alive = abuser.is_alive()
        finally:
            abuser.join(seconds + 30)
            if abuser.is_alive():
                abuser.kill()
                abuser.join()
    growth_mb = folder_mb(data) - before_mb
    requests, refused, accepted = counts[:]
    return {
        "seconds": seconds,
        "victim_quiet_p99_ms": p99(quiet) * 1e3,
        "victim_loaded_p99_ms": p99(loaded) * 1e3,
        "victim_p99_ratio": p99(loaded) / p99(quiet),
        "abuse_outlasted_measurement": float(was_alive),
        "abuser_requests": requests,
        "abuser_jobs_refused": refused,
        "abuser_jobs_accepted": accepted,
        "store_growth_mb": growth_mb,
        "store_growth_mb_per_10k_jobs": growth_mb / max(refused + accepted, 1) * 10_000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="how long the abuse lasts")
    parser.add_argument("--samples", type=int, default=1000, help="GetJob calls per window")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        site = SiteSpec("small", "datacenter", nodes=[{"name": "n", "cpu_cores": 4}])
        fed = LocalFederation(Path(root), [site])
        try:
            asyncio.run(fed.start())
            result = asyncio.run(measure(fed, args.seconds, args.samples))
        finally:
            fed.stop()
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return
    print(f"{'victim GetJob p99 ms: quiet':>28} {'loaded':>8} {'ratio':>6}")
    print(
        f"{result['victim_quiet_p99_ms']:>28.1f} {result['victim_loaded_p99_ms']:>8.1f} "
        f"{result['victim_p99_ratio']:>6.2f}"
    )
    print(
        f"abuser: {result['abuser_requests']:,} requests in {args.seconds:.0f} s, "
        f"{result['abuser_jobs_refused']:,} jobs refused, {result['abuser_jobs_accepted']:,} "
        f"accepted; the store grew {result['store_growth_mb']:.1f} MB "
        f"({result['store_growth_mb_per_10k_jobs']:.2f} MB per 10,000 jobs)"
    )


if __name__ == "__main__":
    main()
