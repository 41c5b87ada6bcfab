"""The store's key layout: a store written in layout 1 is migrated (in bounded, resumable
commits) and every job and its events are found; a store of a newer layout is refused."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import pytest_asyncio
from store.etcd_server import LocalEtcd, etcd_binary

from federation.api.v1 import jobs_pb2
from federation.coordinator import layout
from federation.coordinator.jobs.events import EventHub
from federation.coordinator.jobs.records import OLD_EVENTS, job_key
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.layout import (
    CURRENT,
    LAYOUT_KEY,
    PROGRESS_KEY,
    LayoutError,
    check_layout,
    upgrade_layout,
)
from federation.store import Op, Put, SqliteStore, Store, StoreError
from federation.store.etcd import EtcdStore

P = jobs_pb2.JOB_STATE_PENDING
R = jobs_pb2.JOB_STATE_RUNNING
S = jobs_pb2.JOB_STATE_SUCCEEDED
JOBS = 150  # more than one commit's worth (etcd: at most 128 operations per transaction)
ETCD_LIMIT = 128


@pytest_asyncio.fixture(params=["sqlite", "etcd"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """An empty store, embedded or in a real etcd under a fresh prefix."""
    opened: Store
    if request.param == "sqlite":
        opened = await SqliteStore.open(tmp_path / "db")
    else:
        if etcd_binary() is None:
            pytest.skip("etcd is not installed (apt-get install -y etcd-server)")
        etcd: LocalEtcd = request.getfixturevalue("etcd")
        opened = await EtcdStore.open([etcd.endpoint], prefix=f"/test-{uuid.uuid4().hex}")
    yield opened
    await opened.close()


def old_job(i: int) -> tuple[jobs_pb2.Job, list[jobs_pb2.JobEvent]]:
    """Job ``i`` as layout 1 stored it, with its events: every third one finished."""
    job_id = f"job-{i:04}"
    done = i % 3 == 0
    job = jobs_pb2.Job(id=job_id, state=S if done else P, submitted_by="admin:test")
    job.spec.id = job.spec.name = job_id
    job.spec.tasks.add(name="main", command=["run"])
    job.tasks.add(name="main", state=S if done else P, reason="old")
    events = [jobs_pb2.JobEvent(job_id=job_id, sequence=1, task="main", state=P, reason="new")]
    if done:
        events += [
            jobs_pb2.JobEvent(job_id=job_id, sequence=2, task="main", state=R, reason="ran"),
            jobs_pb2.JobEvent(job_id=job_id, sequence=3, task="main", state=S, reason="done"),
        ]
    return job, events


async def write_layout_1(store: Store, count: int = JOBS) -> dict[str, list[jobs_pb2.JobEvent]]:
    """Write ``count`` jobs the way layout 1 did (each job alone under /jobs/, each event
    under /events/JOB/SEQUENCE, no layout record); returns each job's events."""
    ops: list[Op] = []
    written: dict[str, list[jobs_pb2.JobEvent]] = {}
    for i in range(count):
        job, events = old_job(i)
        written[job.id] = events
        ops.append(Put(job_key(job.id), job.SerializeToString()))
        ops += [
            Put(f"{OLD_EVENTS}{job.id}/{e.sequence:010d}", e.SerializeToString()) for e in events
        ]
    for at in range(0, len(ops), 100):
        await store.commit(ops[at : at + 100])
    return written


async def every_job_found(store: Store, written: dict[str, list[jobs_pb2.JobEvent]]) -> None:
    repo = JobRepository(store, EventHub())
    active = await repo.load()
    assert sorted(j.id for j in active) == sorted(
        job_id for job_id, events in written.items() if len(events) == 1
    )
    for job_id, events in written.items():
        job = await repo.get(job_id)
        assert job.id == job_id
        assert job.tasks[0].state == events[-1].state
        assert list(await repo.events(job_id)) == events
    assert await store.count(OLD_EVENTS) == 0
    assert await store.count(PROGRESS_KEY) == 0


class Recording:
    """A store that records each commit's size and can fail one commit (a leader that dies)."""

    def __init__(self, store: Store, fail_at: int = 0) -> None:
        self._store = store
        self.commits: list[Sequence[Op]] = []
        self._fail_at = fail_at

    def __getattr__(self, name: str) -> object:
        return getattr(self._store, name)

    async def commit(self, ops: Sequence[Op]) -> int:
        self.commits.append(ops)
        if len(self.commits) == self._fail_at:
            raise StoreError("the leader died here")
        return await self._store.commit(ops)


async def test_a_store_of_layout_1_is_migrated_and_every_job_found(store: Store) -> None:
    """The proof: a store written the previous way, upgraded, and every job and each of its
    events found; no commit of the migration exceeds etcd's transaction limit."""
    written = await write_layout_1(store)
    recording = Recording(store)
    assert await upgrade_layout(recording) == 1  # type: ignore[arg-type]
    assert all(len(ops) < ETCD_LIMIT for ops in recording.commits)
    assert len(recording.commits) > 3  # it did take several commits
    assert (await store.get(LAYOUT_KEY)).value == str(CURRENT).encode()  # type: ignore[union-attr]
    await every_job_found(store, written)
    assert await upgrade_layout(store) == CURRENT  # a second start finds nothing to do


async def test_an_interrupted_migration_resumes_where_it_stopped(store: Store) -> None:
    """A leader that dies after the first batch: the next run carries on after the jobs
    already rewritten (it never reads a record as a job) and finds every job."""
    written = await write_layout_1(store)
    dying = Recording(store, fail_at=3)  # layout 1 recorded, one batch rewritten, then dead
    with pytest.raises(StoreError, match="died here"):
        await upgrade_layout(dying)  # type: ignore[arg-type]
    assert await store.get(PROGRESS_KEY) is not None
    with pytest.raises(StoreError, match="written by an earlier version"):
        await JobRepository(store, EventHub()).load()  # half migrated: not read as it stands
    resumed = Recording(store)
    await upgrade_layout(resumed)  # type: ignore[arg-type]
    rewritten = [op.key for ops in resumed.commits for op in ops if op.key.startswith("/jobs/")]
    assert rewritten == [job_key(f"job-{i:04}") for i in range(100, JOBS)]
    await every_job_found(store, written)


async def test_a_fresh_store_gets_the_current_layout_at_once(store: Store) -> None:
    await upgrade_layout(store)
    assert (await store.get(LAYOUT_KEY)).value == str(CURRENT).encode()  # type: ignore[union-attr]


async def test_a_store_of_a_newer_layout_is_refused_naming_both(store: Store) -> None:
    await store.commit([Put(LAYOUT_KEY, str(CURRENT + 1).encode())])
    message = f"key layout {CURRENT + 1}, newer than layout {CURRENT}.*downgrades are not"
    with pytest.raises(LayoutError, match=message):
        await check_layout(store)
    with pytest.raises(LayoutError, match=message):
        await upgrade_layout(store)
    assert (await store.get(LAYOUT_KEY)).value == str(CURRENT + 1).encode()  # type: ignore[union-attr]


async def test_migrations_run_step_by_step_from_the_table(store: Store) -> None:
    """Each registered step runs once, in order, and the record follows each."""
    ran: list[int] = []

    async def step(into: Store, progress: layout.Progress) -> None:
        ran.append(progress.source)
        assert (await into.get(LAYOUT_KEY)).value == str(progress.source).encode()  # type: ignore[union-attr]

    await store.commit([Put(LAYOUT_KEY, b"2")])
    table = {v: layout.Migration(v, f"step {v}", step) for v in (2, 3)}
    assert await upgrade_layout(store, table, current=4) == 2
    assert ran == [2, 3]
    assert (await store.get(LAYOUT_KEY)).value == b"4"  # type: ignore[union-attr]
