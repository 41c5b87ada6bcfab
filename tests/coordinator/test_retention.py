"""Indexes and retention over a real store: index-served answers equal a full scan after many
random transitions; finished jobs past their time leave (archived first), the counts stay
right, and a job not finished is never removed."""

from __future__ import annotations

import random
import stat
import time
from collections import Counter
from pathlib import Path

from coordinator.test_job_repository import move, new_job
from federation.api.v1 import audit_service_pb2, job_service_pb2, jobs_pb2
from federation.common import job_state
from federation.coordinator import audit
from federation.coordinator.jobs import index as job_index
from federation.coordinator.jobs.events import EventHub
from federation.coordinator.jobs.listing import ListFilter
from federation.coordinator.jobs.records import JOBS, read_record
from federation.coordinator.jobs.redaction import REDACTED
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.jobs.retention import Retention, archive_path, read_archive
from federation.errors import JobNotFoundError
from federation.store import SqliteStore, Store

P, SCH, DEL, RUN = job_state.PENDING, job_state.SCHEDULING, job_state.DELEGATED, job_state.RUNNING
OK, FAIL, CANCELLED = job_state.SUCCEEDED, job_state.FAILED, job_state.CANCELLED
DAY_S = 86400.0
TENANTS, QUEUES, SITES = ("t1", "t2", "t/3"), ("", "q1", "q2"), ("s1", "s2", "s 3")


def shaped(job_id: str, rng: random.Random) -> jobs_pb2.Job:
    job = new_job(job_id, "a", "b")
    job.spec.tenant = rng.choice(TENANTS)
    job.spec.queue = rng.choice(QUEUES)
    return job


async def scanned(store: Store) -> list[jobs_pb2.Job]:
    """Every stored job, decoded: the answer the indexes must give."""
    return [read_record(kv.value).job for kv in await store.range(JOBS)]


async def listed(repo: JobRepository, where: ListFilter, page_size: int = 7) -> list[str]:
    """Every job id a filtered listing finds, following its page tokens."""
    found: list[str] = []
    token = ""
    while True:
        page = job_service_pb2.ListJobsResponse().jobs
        token = await repo.list_page(
            lambda job: True, page, page_size, token, max_scanned=50, where=where
        )
        found += [job.id for job in page]
        if not token:
            return found


async def check_indexes(store: Store, repo: JobRepository) -> None:
    """Counts, every index entry and filtered listings agree with a full scan of the records."""
    jobs = await scanned(store)
    by_state = Counter(jobs_pb2.JobState.Name(job.state) for job in jobs)
    assert await repo.count_by_state() == dict(by_state)
    assert await JobRepository(store, EventHub()).count_by_state() == dict(by_state)
    expected = set().union(*(job_index.keys(job) for job in jobs))
    assert {kv.key for kv in await store.range(job_index.INDEX)} == expected
    for states, tenant, site, queue in [
        ((OK,), "t1", "", ""),
        ((P, SCH), "", "", ""),
        ((), "t/3", "s1", ""),
        ((RUN, DEL), "t2", "", "q1"),
        ((), "", "s 3", ""),
    ]:
        want = [
            job.id
            for job in jobs
            if (not states or job.state in states)
            and (not tenant or job.spec.tenant == tenant)
            and (not site or any(t.site == site for t in job.tasks))
            and (not queue or job.spec.queue == queue)
        ]
        assert await listed(repo, ListFilter.of(states, tenant, site, queue)) == want


def step(job: jobs_pb2.Job, rng: random.Random) -> list:  # type: ignore[type-arg]
    """A random legal move of one task of ``job`` (placing it at a site when it goes there)."""
    task = rng.choice(list(job.tasks))
    nexts = {P: [SCH, CANCELLED], SCH: [DEL, P], DEL: [RUN, P, FAIL], RUN: [OK, FAIL, P]}
    if task.state not in nexts:
        return []
    state = rng.choice(nexts[task.state])
    changes = move((task.name, state, "random"))(job)
    if state == DEL:
        task.site = rng.choice(SITES)
    elif state == P:
        task.site = ""
    return changes


async def test_indexes_match_a_full_scan_after_random_transitions(store: SqliteStore) -> None:
    rng = random.Random(7)
    repo = JobRepository(store, EventHub())
    await repo.load()
    await repo.create([shaped(f"j{i:03d}", rng) for i in range(60)])
    for round_ in range(12):
        ids = rng.sample([f"j{i:03d}" for i in range(60)], 25)
        await repo.update_many([(job_id, lambda job: step(job, rng)) for job_id in ids])
        if round_ % 4 == 3:
            await check_indexes(store, repo)
    await check_indexes(store, repo)
    # A new term reads the same from the indexes (only unfinished jobs are loaded).
    fresh = JobRepository(store, EventHub())
    loaded = await fresh.load()
    jobs = await scanned(store)
    assert sorted(j.id for j in loaded) == [
        j.id for j in jobs if not job_state.is_terminal(j.state)
    ]
    await check_indexes(store, fresh)


async def finish(repo: JobRepository, job_id: str, state: int = OK) -> None:
    await repo.update(job_id, move(("main", SCH, "s"), ("main", DEL, "s"), ("main", RUN, "r")))
    await repo.update(job_id, move(("main", state, "done")))  # type: ignore[arg-type]


async def test_finished_jobs_past_their_time_are_removed_and_archived(
    store: SqliteStore, tmp_path: Path
) -> None:
    repo = JobRepository(store, EventHub())
    await repo.load()
    jobs = [new_job(f"j{i:03d}") for i in range(150)]
    for job in jobs:
        job.spec.tenant = "t1"
        job.spec.tasks[0].env["DB_PASSWORD"] = "hunter2"
    await repo.create(jobs)
    for i in range(0, 120):
        await finish(repo, f"j{i:03d}", FAIL if i % 10 == 0 else OK)
    await repo.update("j120", move(("main", SCH, "s"), ("main", DEL, "s"), ("main", RUN, "r")))
    await store.commit([audit.entry("operator:o", "site.cordon", "s1")])
    now = time.time()
    archive = tmp_path / "archive"
    archive.mkdir(mode=0o755)  # made by hand, readable by all
    kept = Retention(
        repo,
        store,
        finished_job_retention_s=7 * DAY_S,
        audit_retention_s=90 * DAY_S,
        archive_dir=archive,
        clock=lambda: now,
    )
    assert await kept.sweep() == (0, 0)  # finished just now: kept
    later = now + 7 * DAY_S + 60
    sweeper = Retention(
        repo,
        store,
        finished_job_retention_s=7 * DAY_S,
        audit_retention_s=90 * DAY_S,
        archive_dir=archive,
        clock=lambda: later,
    )
    assert await sweeper.sweep() == (120, 0)
    for i in (0, 5, 119):
        try:
            await repo.get(f"j{i:03d}")
            raise AssertionError("a removed job is still found")
        except JobNotFoundError:
            pass
    assert (await repo.get("j120")).state == RUN  # running: never removed
    assert await repo.count_by_state() == {"JOB_STATE_RUNNING": 1, "JOB_STATE_PENDING": 29}
    await check_indexes(store, repo)
    assert await listed(repo, ListFilter.of(tenant="t1")) == [f"j{i:03d}" for i in range(120, 150)]
    path = archive_path(archive, later)
    records = read_archive(path)
    assert sorted(r.job.id for r in records) == [f"j{i:03d}" for i in range(120)]
    # Secrets stay out of history: env values are redacted, the files are the owner's alone.
    assert "hunter2" not in path.read_text()
    assert all(r.job.spec.tasks[0].env["DB_PASSWORD"] == REDACTED for r in records)
    assert (await repo.get("j120")).spec.tasks[0].env["DB_PASSWORD"] == "hunter2"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(archive.stat().st_mode) == 0o700
    assert all(job_state.is_terminal(r.job.state) and r.events for r in records)
    assert await sweeper.sweep() == (0, 0)
    # The audit trail keeps its own time.
    much_later = now + 91 * DAY_S
    audit_sweeper = Retention(
        repo,
        store,
        finished_job_retention_s=0,
        audit_retention_s=90 * DAY_S,
        clock=lambda: much_later,
    )
    assert await audit_sweeper.sweep() == (0, 1)
    trail = await audit.list_events(store, audit_service_pb2.ListAuditEventsRequest())
    assert not trail.events


async def test_a_finished_job_with_no_time_is_kept(store: SqliteStore) -> None:
    """A job finished by its record but with no time in it (an old release's, or written by
    hand) has no known age: it stays."""
    repo = JobRepository(store, EventHub())
    job = new_job("timeless")
    job.state = job.tasks[0].state = OK
    await repo.create([job])
    assert await repo.remove_finished(time.time_ns()) == 0
    assert (await repo.get("timeless")).state == OK


async def test_a_retention_of_zero_keeps_finished_jobs(store: SqliteStore) -> None:
    repo = JobRepository(store, EventHub())
    await repo.create([new_job("a")])
    await finish(repo, "a")
    forever = Retention(
        repo,
        store,
        finished_job_retention_s=0,
        audit_retention_s=0,
        clock=lambda: time.time() + 3650 * DAY_S,
    )
    assert await forever.sweep() == (0, 0)
    assert (await repo.get("a")).state == OK
