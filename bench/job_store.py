"""How `fedctl status` and a filtered job listing scale with the jobs stored: 10,000 to 1,000,000.

For each size N, an embedded store is filled in bulk with N jobs written as the repository writes
them (each job's record and its index entries, ``job_index.ops``; big commits, as a bulk load,
not one per job): 99% finished, 1% waiting or running; ten tenants of which one ("rare") holds
2% of the jobs; four queues, eight sites. Then, in the same run:

- `status ms`: ``JobRepository.count_by_state`` as `fedctl status` calls it on the leader (kept
  since ``load``); `index count ms`: the same counts taken from the state index alone (a fresh
  repository, as before its load), and `full scan ms`: the baseline, counting by decoding every
  stored record (how the counts were taken before the indexes).
- `page ms` for two filters, tenant and state: a common one (tenant t1, SUCCEEDED: about 8% of
  the jobs) and a rare one (tenant rare, FAILED: 1%): one ListJobs page of 100 served from the
  indexes, beside `scan page ms`, the same call reading records with the filter applied to each
  (the path without indexes, which stops after 10,000 records with a short page and a token).

    python bench/job_store.py [--sizes 10000,100000,1000000] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.common import job_state
from federation.coordinator.jobs import index as job_index
from federation.coordinator.jobs.events import EventHub
from federation.coordinator.jobs.listing import ListFilter
from federation.coordinator.jobs.records import (
    JOBS,
    encoded_events,
    job_key,
    read_record,
    record_value,
)
from federation.coordinator.jobs.repository import JobRepository
from federation.store import Op, Put, SqliteStore, Store

TENANTS = [f"t{i}" for i in range(1, 10)]
QUEUES = ["", "batch", "train", "serve"]
SITES = [f"site-{i}" for i in range(8)]
FINISHED = (job_state.SUCCEEDED, job_state.SUCCEEDED, job_state.SUCCEEDED, job_state.FAILED)
OPS_PER_COMMIT = 20_000
FILTERS = {
    "common": ((job_state.SUCCEEDED,), "t1"),
    "rare": ((job_state.FAILED,), "rare"),
}


def made(i: int, rng: random.Random, now_ns: int) -> jobs_pb2.Job:
    job = jobs_pb2.Job(id=f"j-{i:09d}")
    job.spec.tenant = "rare" if i % 50 == 7 else TENANTS[i % len(TENANTS)]
    job.spec.queue = QUEUES[i % len(QUEUES)]
    job.spec.tasks.add(name="main", command=["train.py", "--epochs", "10"])
    task = job.tasks.add(name="main", reason="done")
    if i % 100 == 50:
        task.state = rng.choice((job_state.PENDING, job_state.RUNNING))
    elif job.spec.tenant == "rare":
        task.state = job_state.FAILED if i % 2 else job_state.SUCCEEDED
    else:
        task.state = FINISHED[i % len(FINISHED)]
    if task.state != job_state.PENDING:
        task.site = SITES[i % len(SITES)]
    if job_state.is_terminal(task.state):
        task.finished_at.FromNanoseconds(now_ns - (N_MAX - i) * 1_000_000)
    job.state = task.state
    job.created_at.FromNanoseconds(now_ns - 10**12)
    job.updated_at.FromNanoseconds(now_ns)
    return job


N_MAX = 10_000_000


async def fill(store: Store, count: int) -> float:
    """Write ``count`` jobs as the repository stores them; returns the seconds it took."""
    rng = random.Random(1)
    now_ns = time.time_ns()
    started = time.perf_counter()
    ops: list[Op] = []
    for i in range(count):
        job = made(i, rng, now_ns)
        event = jobs_pb2.JobEvent(job_id=job.id, sequence=1, state=job.state, reason="done")
        ops.append(Put(job_key(job.id), record_value(job, encoded_events([event]))))
        ops += job_index.ops(None, job)
        if len(ops) >= OPS_PER_COMMIT:
            await store.commit(ops)
            ops = []
    if ops:
        await store.commit(ops)
    return time.perf_counter() - started


async def scan_counts(store: Store) -> dict[str, int]:
    """The baseline: counts by decoding every stored record."""
    counts: dict[str, int] = {}
    start = ""
    while page := await store.range(JOBS, start_after=start, limit=5000):
        for kv in page:
            name = jobs_pb2.JobState.Name(read_record(kv.value).job.state)
            counts[name] = counts.get(name, 0) + 1
        start = page[-1].key
    return counts


async def timed(call: Callable[[], Awaitable[Any]], repeat: int) -> tuple[float, Any]:
    """Median milliseconds of ``repeat`` calls (after one untimed), and the last result."""
    times = []
    result = await call()
    for _ in range(repeat):
        started = time.perf_counter()
        result = await call()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), result


async def page(repo: JobRepository, name: str, indexed: bool) -> int:
    states, tenant = FILTERS[name]
    where = ListFilter.of(states, tenant)
    reply = job_service_pb2.ListJobsResponse()

    def accepts(job: jobs_pb2.Job) -> bool:
        return job.state in states and job.spec.tenant == tenant

    await repo.list_page(accepts, reply.jobs, 100, "", where=where if indexed else None)
    return len(reply.jobs)


async def measure(count: int, folder: Path, repeat: int) -> dict[str, Any]:
    store = await SqliteStore.open(folder / f"jobs-{count}.db")
    try:
        fill_s = await fill(store, count)
        repo = JobRepository(store, EventHub())
        started = time.perf_counter()
        loaded = len(await repo.load())
        load_s = time.perf_counter() - started
        row: dict[str, Any] = {
            "jobs": count,
            "fill_s": round(fill_s, 1),
            "load_s": round(load_s, 2),
        }
        row["active_loaded"] = loaded
        row["status_ms"], kept = await timed(repo.count_by_state, repeat)
        fresh = JobRepository(store, EventHub())
        row["index_count_ms"], counted = await timed(fresh.count_by_state, repeat)
        started = time.perf_counter()
        scanned = await scan_counts(store)
        row["full_scan_ms"] = (time.perf_counter() - started) * 1000
        assert kept == counted == scanned, (kept, counted, scanned)
        for name in FILTERS:
            row[f"{name}_page_ms"], row[f"{name}_page_jobs"] = await timed(
                functools.partial(page, repo, name, True), repeat
            )
            row[f"{name}_scan_page_ms"], row[f"{name}_scan_page_jobs"] = await timed(
                functools.partial(page, repo, name, False), repeat
            )
        for key, value in row.items():
            if key.endswith("_ms"):
                row[key] = round(value, 3)
        return row
    finally:
        await store.close()


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'jobs':>9} {'fill s':>7} {'load s':>7} {'status ms':>10} {'index count ms':>15} "
        f"{'full scan ms':>13} {'common page ms':>15} {'scan':>9} {'rare page ms':>13} "
        f"{'scan (jobs)':>16}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['jobs']:>9,} {r['fill_s']:>7.1f} {r['load_s']:>7.2f} {r['status_ms']:>10.3f} "
            f"{r['index_count_ms']:>15.1f} {r['full_scan_ms']:>13.0f} "
            f"{r['common_page_ms']:>15.1f} {r['common_scan_page_ms']:>9.1f} "
            f"{r['rare_page_ms']:>13.1f} "
            f"{r['rare_scan_page_ms']:>9.1f} ({r['rare_scan_page_jobs']:>3})"
        )
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in (int(s) for s in args.sizes.split(",")):
            rows.append(await measure(size, Path(tmp), args.repeat))
            if not args.json:
                print(f"measured {size:,} jobs", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"rows": rows}))
    else:
        print(table(rows))


if __name__ == "__main__":
    asyncio.run(main())
