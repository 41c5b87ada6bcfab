"""Jobs a coordinator accepts, places and commits per second, and how long that takes.

A real coordinator process (embedded store, mTLS) and N sites speaking the real agent protocol
over mTLS from a second process, whose local core accepts every offer and "runs" each task
instantly. A client submits jobs over mTLS, one RPC per job (SubmitJob) or in batches
(SubmitJobs), and follows them with WatchJobs: a job counts once it is committed to a site
(DELEGATED). In the same run, a bare unary RPC (health Check) over the same mTLS channel is
the baseline the unary rate is compared with. Latency is reported under saturation (the two
closed-loop runs) and at moderate load (unary submits paced at a quarter of the unary rate).

    python bench/submit.py [--sites 10,100] [--jobs 2000] [--batch 500] [--json]
        [--profile DIR] [--backlog N]

``--backlog N`` first submits N jobs that no site can take (an FPGA each): they wait in line
through every run, as a flood of jobs bigger than the fleet would, and the coordinator's CPU
while nothing else happens is read too (``idle_cpu_percent``).

``--profile DIR`` samples the coordinator with py-spy during each run (echo, unary, batched)
and writes its stacks, collapsed, to ``DIR/<sites>-<run>.txt``: sampling slows the coordinator,
so figures of a profiled run are not the ones to compare.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc
import numpy as np
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from federation.api.v1 import (
    job_service_pb2,
    job_service_pb2_grpc,
    jobs_pb2,
    resources_pb2,
)
from federation.common import job_state
from federation.coordinator.jobs.events import EventHub
from federation.coordinator.jobs.records import Change, new_job_id, transition
from federation.coordinator.jobs.repository import JobRepository
from federation.local import LocalFederation
from federation.logging import configure_logging
from federation.store import SqliteStore
from federation.testing.scripted_core import ScriptedCore, start_scripted_sites
from federation.watch import events_of

ECHO_CALLS = 2000
BACKLOG_STEP = 2000
"""Backlog jobs submitted before waiting for their first tries (``fill_backlog``)."""
BACKLOG_SETTLE_S = 70.0
"""After every backlog job was tried once: time for their retries to reach their longest
waits (0.5, 1, 2 ... 32 s, then the coordinator's unfit_retry_interval_s, 60 s, each cut by
up to a fifth), so the idle figure is the steady cost of the backlog."""
IDLE_S = 60.0
"""How long the coordinator's CPU is read with the backlog waiting and nothing submitted
(``idle_cpu_percent``): a whole retry interval, as the retries come spread over it."""
MODERATE_SHARE = 0.25
"""Moderate load, for the latency target: this share of the unary rate measured in the run."""

T = TypeVar("T")
COMMITTED = frozenset(
    {jobs_pb2.JOB_STATE_DELEGATED, jobs_pb2.JOB_STATE_RUNNING, jobs_pb2.JOB_STATE_SUCCEEDED}
)


def spec(i: int) -> jobs_pb2.JobSpec:
    return jobs_pb2.JobSpec(
        name=f"bench-{i}",
        tasks=[
            jobs_pb2.TaskSpec(
                name="t", command=["true"], resources=jobs_pb2.ResourceRequest(cpu=1, memory_mib=64)
            )
        ],
    )


def unplaceable(i: int) -> jobs_pb2.JobSpec:
    """A job no bench site can take (they have no FPGA): it waits in line for good."""
    job = spec(i)
    job.name = f"backlog-{i}"
    job.tasks[0].resources.accelerator.kind = resources_pb2.DEVICE_KIND_FPGA
    job.tasks[0].resources.accelerator.count = 1
    return job


async def fill_backlog(channel: grpc.aio.Channel, jobs: int, batch: int) -> None:
    """Submit ``jobs`` unplaceable jobs and wait until the scheduler has tried each once and
    recorded why no site takes it (its first PENDING event after "submitted"). A few batches
    at a time: a watcher that falls 10,000 messages behind is cut off."""
    stub = job_service_pb2_grpc.JobServiceStub(channel)
    watch = stub.WatchJobs(job_service_pb2.WatchJobsRequest())
    await asyncio.sleep(0.2)  # let the watch subscribe before the first submit
    tried: set[str] = set()
    caught_up = asyncio.Event()
    submitted = 0

    async def follow() -> None:
        async for event in events_of(watch):
            if event.job_state == jobs_pb2.JOB_STATE_PENDING and event.reason != "submitted":
                tried.add(event.job_id)
                if len(tried) >= submitted:
                    caught_up.set()

    follower = asyncio.create_task(follow())
    try:
        for first in range(0, jobs, batch):
            specs = [unplaceable(i) for i in range(first, min(first + batch, jobs))]
            await stub.SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=specs))
            submitted += len(specs)
            if submitted % BACKLOG_STEP and submitted < jobs:
                continue
            caught_up.clear()
            if len(tried) >= submitted:
                continue
            waiter = asyncio.create_task(caught_up.wait())
            await asyncio.wait([waiter, follower], timeout=600, return_when="FIRST_COMPLETED")
            if not caught_up.is_set():
                waiter.cancel()
                raise RuntimeError(f"the backlog's first tries stopped at {len(tried)} jobs")
    finally:
        watch.cancel()
        follower.cancel()
    await asyncio.sleep(BACKLOG_SETTLE_S)


async def echo_rate(channel: grpc.aio.Channel, calls: int, concurrency: int) -> float:
    stub = health_pb2_grpc.HealthStub(channel)
    request = health_pb2.HealthCheckRequest()
    left = calls

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await stub.Check(request)  # type: ignore[attr-defined]  # untyped generated stub

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return calls / (time.perf_counter() - start)


async def run_jobs(
    channel: grpc.aio.Channel,
    jobs: int,
    batch: int,
    concurrency: int,
    rate: float | None = None,
) -> dict[str, float]:
    """Submit ``jobs`` (batch 1 = SubmitJob) and wait until all are committed.

    Closed loop (``concurrency`` submitters, each sending its next request when the last one
    returns) measures the most the coordinator takes; with ``rate``, unary submits leave at
    that pace whatever happens to earlier ones (open loop), for latency at a known load.
    """
    stub = job_service_pb2_grpc.JobServiceStub(channel)
    submitted_at: dict[str, float] = {}
    committed_at: dict[str, float] = {}
    done = asyncio.Event()
    watch = stub.WatchJobs(job_service_pb2.WatchJobsRequest())
    await asyncio.sleep(0.2)  # let the watch subscribe before the first submit

    def check_done() -> None:
        if len(submitted_at) == jobs and len(committed_at.keys() & submitted_at.keys()) == jobs:
            done.set()

    async def follow() -> None:
        async for event in events_of(watch):
            if event.job_state in COMMITTED and event.job_id not in committed_at:
                committed_at[event.job_id] = time.perf_counter()
                check_done()

    async def submit(chunk: list[jobs_pb2.JobSpec]) -> None:
        t0 = time.perf_counter()
        if len(chunk) == 1:
            reply = await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=chunk[0]))
            ids = [reply.job.id]
        else:
            many = await stub.SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=chunk))
            ids = [j.id for j in many.jobs]
        for job_id in ids:
            submitted_at[job_id] = t0
        check_done()

    follower = asyncio.create_task(follow())
    counter = iter(range(jobs))

    async def worker() -> None:
        while chunk := [spec(i) for _, i in zip(range(batch), counter, strict=False)]:
            await submit(chunk)

    async def paced(rate: float) -> None:
        sends = []
        for i in range(jobs):
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            sends.append(asyncio.create_task(submit([spec(i)])))
        await asyncio.gather(*sends)

    start = time.perf_counter()
    if rate is None:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    else:
        await paced(rate)
    await asyncio.wait_for(done.wait(), 600)
    elapsed = max(committed_at.values()) - start
    watch.cancel()
    follower.cancel()
    latency = [(committed_at[j] - t0) * 1000 for j, t0 in submitted_at.items()]
    return {
        "jobs_per_s": jobs / elapsed,
        "p50_ms": float(np.percentile(latency, 50)),
        "p99_ms": float(np.percentile(latency, 99)),
    }


UNLIMITED = (
    "client_requests_per_s",
    "client_jobs_per_s",
    "client_streams",
    "max_unfinished_jobs_per_tenant",
)


@contextlib.contextmanager
def sampled(pid: int, out: Path | None) -> Iterator[None]:
    """Sample process ``pid`` with py-spy while the block runs, stacks collapsed into ``out``
    (on-CPU samples only: idle threads are left out); nothing when ``out`` is None."""
    if out is None:
        yield
        return
    py_spy = Path(sys.executable).with_name("py-spy")
    spy = subprocess.Popen(
        [
            str(py_spy),
            "record",
            "--pid",
            str(pid),
            "--format",
            "raw",
            "--rate",
            "500",
            "-o",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # py-spy attaches before the run starts
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes what it has on SIGINT
        spy.wait(30)


async def measure(
    sites: int, jobs: int, batch: int, profile: Path | None = None, backlog: int = 0
) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-submit-") as root:
        # The bench measures what the coordinator can take, not one identity's allowance.
        unlimited = Path(root) / "unlimited.toml"
        unlimited.write_text("".join(f"{name} = 0\n" for name in UNLIMITED))
        fed = LocalFederation(Path(root), [], coordinator_args=["--config", str(unlimited)])
        await fed.start_coordinator()
        coordinator = psutil.Process(fed.processes["coordinator"].pid)
        harness = psutil.Process()

        def cpu_s(process: psutil.Process) -> float:
            times = process.cpu_times()
            return times.user + times.system

        def loop_cpu_s() -> float:
            """The coordinator's main thread's: its event loop, where Python runs but for
            the store's worker thread (the rest is gRPC's threads and the store's)."""
            main = next(t for t in coordinator.threads() if t.id == coordinator.pid)
            return main.user_time + main.system_time

        loop_used: dict[str, float] = {}

        async def with_cpu(run: Awaitable[T], name: str) -> tuple[T, float, float]:
            """What ``run`` returns, and the CPU seconds (all threads, user + system) the
            coordinator and this process (the client and the sites) used meanwhile: per job,
            figures less shaken by a noisy machine than a rate. The coordinator's event loop
            thread's share goes in ``loop_used[name]``."""
            before = cpu_s(coordinator), cpu_s(harness), loop_cpu_s()
            result = await run
            loop_used[name] = loop_cpu_s() - before[2]
            return result, cpu_s(coordinator) - before[0], cpu_s(harness) - before[1]

        runners: list[asyncio.Task[None]] = []
        try:
            cores = {f"site-{i:03d}": ScriptedCore() for i in range(sites)}
            runners = await start_scripted_sites(fed, cores)
            pid = coordinator.pid

            def spy(run: str) -> contextlib.AbstractContextManager[None]:
                return sampled(pid, profile / f"{sites}-{run}.txt" if profile else None)

            async with fed.operator().channel() as channel:
                idle = 0.0
                if backlog:
                    await fill_backlog(channel, backlog, batch)
                    before = cpu_s(coordinator)
                    await asyncio.sleep(IDLE_S)
                    idle = (cpu_s(coordinator) - before) / IDLE_S * 100
                with spy("echo"):
                    echo, echo_cpu, echo_harness = await with_cpu(
                        echo_rate(channel, ECHO_CALLS, 16), "echo"
                    )
                with spy("unary"):
                    unary, unary_cpu, unary_harness = await with_cpu(
                        run_jobs(channel, jobs // 4, 1, 16), "unary"
                    )
                with spy("batched"):
                    batched, batched_cpu, harness_cpu = await with_cpu(
                        run_jobs(channel, jobs, batch, 2), "batched"
                    )
                # The echo again: the machine's speed drifts within a run, and the job runs'
                # CPU is compared with the echo's over both (before and after them).
                _, echo_again_cpu, _ = await with_cpu(
                    echo_rate(channel, ECHO_CALLS, 16), "echo again"
                )
                # Moderate load: unary submits at a quarter of the most this run took.
                rate = unary["jobs_per_s"] * MODERATE_SHARE
                moderate = await run_jobs(channel, int(rate * 5), 1, 1, rate=rate)
        finally:
            for runner in runners:
                runner.cancel()
            fed.stop()
    echo_us = (echo_cpu + echo_again_cpu) / (2 * ECHO_CALLS) * 1e6
    return {
        "backlog_jobs": backlog,
        "idle_cpu_percent": idle,
        "echo_rpc_per_s": echo,
        "unary_jobs_per_s": unary["jobs_per_s"],
        "unary_vs_echo": unary["jobs_per_s"] / echo,
        "unary_p50_ms": unary["p50_ms"],
        "unary_p99_ms": unary["p99_ms"],
        "echo_cpu_us_per_call": echo_us,
        "echo_cpu_us_per_call_first": echo_cpu / ECHO_CALLS * 1e6,
        "echo_cpu_us_per_call_last": echo_again_cpu / ECHO_CALLS * 1e6,
        "echo_harness_cpu_us_per_call": echo_harness / ECHO_CALLS * 1e6,
        "echo_loop_cpu_us_per_call": (loop_used["echo"] + loop_used["echo again"])
        / (2 * ECHO_CALLS)
        * 1e6,
        "unary_cpu_us_per_job": unary_cpu / (jobs // 4) * 1e6,
        "unary_cpu_vs_echo": unary_cpu / (jobs // 4) * 1e6 / echo_us,
        "unary_loop_cpu_us_per_job": loop_used["unary"] / (jobs // 4) * 1e6,
        "unary_harness_cpu_us_per_job": unary_harness / (jobs // 4) * 1e6,
        "batched_jobs_per_s": batched["jobs_per_s"],
        "batched_cpu_us_per_job": batched_cpu / jobs * 1e6,
        "batched_cpu_vs_echo": batched_cpu / jobs * 1e6 / echo_us,
        "batched_loop_cpu_us_per_job": loop_used["batched"] / jobs * 1e6,
        "batched_harness_cpu_us_per_job": harness_cpu / jobs * 1e6,
        "batched_p50_ms": batched["p50_ms"],
        "batched_p99_ms": batched["p99_ms"],
        "moderate_jobs_per_s": rate,
        "moderate_p50_ms": moderate["p50_ms"],
        "moderate_p99_ms": moderate["p99_ms"],
    }


async def job_writes_only(jobs: int, batch: int) -> dict[str, float]:
    """The ceiling the job store sets: jobs/s if a coordinator did nothing but write each
    job's transitions as the real one does, in batches (submit; DELEGATED with its epoch;
    RUNNING and SUCCEEDED together), with the real JobRepository over the embedded store, in
    this process (run before anything else, so the CPU time is its own)."""

    def delegated(job: jobs_pb2.Job) -> list[Change]:
        job.tasks[0].site = "site-000"
        job.tasks[0].epoch = job.tasks[0].issued_epoch = 1
        return [transition(job, "t", job_state.DELEGATED, "site-000 accepted")]

    def finished(job: jobs_pb2.Job) -> list[Change]:
        return [
            transition(job, "t", job_state.RUNNING, "running at site-000"),
            transition(job, "t", job_state.SUCCEEDED, "exit 0"),
        ]

    with tempfile.TemporaryDirectory(prefix="bench-writes-") as root:
        store = await SqliteStore.open(Path(root) / "db")
        repo = JobRepository(store, EventHub())
        try:
            start, cpu = time.perf_counter(), time.process_time()
            for first in range(0, jobs, batch):
                chunk = []
                for i in range(first, min(first + batch, jobs)):
                    job = jobs_pb2.Job(id=f"{new_job_id()}-{i}", spec=spec(i), reason="submitted")
                    job.tasks.add(name="t", state=job_state.PENDING, reason="submitted")
                    chunk.append(job)
                await repo.create(chunk)
                for mutate in (delegated, finished):
                    await repo.update_many([(job.id, mutate) for job in chunk])
            elapsed, used = time.perf_counter() - start, time.process_time() - cpu
        finally:
            await store.close()
    return {"jobs_per_s": jobs / elapsed, "cpu_us_per_job": used / jobs * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", default="10,100")
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=500)
    parser.add_argument(
        "--backlog", type=int, default=0, help="jobs no site can take, waiting through the runs"
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--profile", type=Path, metavar="DIR", help="sample the coordinator with py-spy"
    )
    args = parser.parse_args()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    configure_logging(level="info")  # as the daemons log; per-job debug lines cost CPU here
    writes = asyncio.run(job_writes_only(args.jobs, args.batch))
    results = {
        n: asyncio.run(measure(int(n), args.jobs, args.batch, args.profile, args.backlog))
        for n in args.sites.split(",")
    }
    if args.json:
        json.dump({"by_sites": results, "job_writes_only": writes}, sys.stdout, indent=2)
        print()
        return
    print(
        f"{'sites':>6} {'echo/s':>8} {'unary jobs/s':>13} {'x echo':>7} {'unary p50/p99 ms':>17} "
        f"{'batched jobs/s':>15} {'batched p50/p99 ms':>19} {'moderate load: jobs/s':>22} "
        f"{'p50/p99 ms':>15} {'CPU us coordinator/harness: echo, unary, batched':>49} "
        f"{'coordinator CPU x echo: unary, batched':>39}"
    )
    for n, r in results.items():
        print(
            f"{n:>6} {r['echo_rpc_per_s']:>8.0f} {r['unary_jobs_per_s']:>13.0f} "
            f"{r['unary_vs_echo']:>7.2f} {r['unary_p50_ms']:>8.1f}/{r['unary_p99_ms']:<8.1f} "
            f"{r['batched_jobs_per_s']:>15.0f} {r['batched_p50_ms']:>9.1f}/"
            f"{r['batched_p99_ms']:<9.1f} {r['moderate_jobs_per_s']:>22.0f} "
            f"{r['moderate_p50_ms']:>7.1f}/{r['moderate_p99_ms']:<7.1f} "
            f"{r['echo_cpu_us_per_call']:>24.0f}/{r['echo_harness_cpu_us_per_call']:.0f}, "
            f"{r['unary_cpu_us_per_job']:.0f}/{r['unary_harness_cpu_us_per_job']:.0f}, "
            f"{r['batched_cpu_us_per_job']:.0f}/{r['batched_harness_cpu_us_per_job']:.0f} "
            f"{r['unary_cpu_vs_echo']:>33.2f}, {r['batched_cpu_vs_echo']:.2f}"
        )
    if args.backlog:
        for n, r in results.items():
            print(
                f"{n} sites, {args.backlog:,} jobs no site can take waiting: the coordinator "
                f"idle at {r['idle_cpu_percent']:.1f}% of a core"
            )
    print(
        f"job writes alone (3 per job, embedded store, batches of {args.batch}): "
        f"{writes['jobs_per_s']:,.0f} jobs/s, {writes['cpu_us_per_job']:.0f} us CPU per job"
    )


if __name__ == "__main__":
    main()
