"""JobRepository.create_one over a real SQLite store: concurrent single jobs share a commit
(group commit), and each caller still gets its own outcome."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from federation.coordinator.jobs.events import EventHub
from federation.coordinator.jobs.records import job_key
from federation.coordinator.jobs.repository import MAX_OPS_PER_COMMIT, JobRepository
from federation.errors import InvalidArgumentError
from federation.store import Op, SqliteStore, StoreError

from .test_job_repository import new_job


class Counting:
    """The store, with every commit's ops recorded; ``fail`` makes the next commit raise."""

    def __init__(self, store: SqliteStore) -> None:
        self.store = store
        self.commits: list[list[Op]] = []
        self.fail: StoreError | None = None
        self.committing = asyncio.Event()
        """Set once a commit has left for the store."""

    async def commit(self, ops: Sequence[Op]) -> int:
        if self.fail is not None:
            err, self.fail = self.fail, None
            raise err
        self.commits.append(list(ops))
        self.committing.set()
        return await self.store.commit(ops)

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)


@pytest.fixture
def counting(store: SqliteStore) -> Counting:
    return Counting(store)


@pytest.fixture
def grouped(counting: Counting) -> JobRepository:
    return JobRepository(counting, EventHub())  # type: ignore[arg-type]


def field_of(err: InvalidArgumentError) -> list[str]:
    return [v.field for v in err.violations]


async def test_concurrent_single_jobs_share_one_commit(
    store: SqliteStore, counting: Counting, grouped: JobRepository
) -> None:
    """Twenty callers at once: one commit, one revision, and each job stored and cached."""
    ids = [f"j{i}" for i in range(20)]
    before = await store.revision()
    await asyncio.gather(*(grouped.create_one(new_job(job_id)) for job_id in ids))
    assert len(counting.commits) == 1
    assert await store.revision() == before + 1
    for job_id in ids:
        assert await store.get(job_key(job_id)) is not None
        assert (await grouped.get(job_id)).id == job_id
        assert [e.sequence for e in await grouped.events(job_id)] == [1]


async def test_jobs_arriving_during_a_commit_go_in_the_next_one(
    counting: Counting, grouped: JobRepository
) -> None:
    """One caller alone is written at once; those that come while its commit is under way
    wait for it and then share the next commit."""
    first = asyncio.create_task(grouped.create_one(new_job("first")))
    await counting.committing.wait()
    later = [asyncio.create_task(grouped.create_one(new_job(f"later-{i}"))) for i in range(5)]
    await asyncio.gather(first, *later)
    assert [len(ops) for ops in counting.commits] == [2, 10]  # each job: record, state index


async def test_a_taken_id_refuses_only_its_caller(
    store: SqliteStore, counting: Counting, grouped: JobRepository
) -> None:
    """A job whose id exists already is refused on ``spec.id``; the others in its group are
    written in the next commit."""
    await grouped.create_one(new_job("old"))
    results = await asyncio.gather(
        grouped.create_one(new_job("a")),
        grouped.create_one(new_job("old", "other")),
        grouped.create_one(new_job("b")),
        return_exceptions=True,
    )
    assert results[0] is None
    assert results[2] is None
    assert isinstance(results[1], InvalidArgumentError)
    assert field_of(results[1]) == ["spec.id"]
    assert "already exists" in str(results[1])
    assert {t.name for t in (await grouped.get("old")).tasks} == {"main"}  # the first one
    for job_id in ("a", "b"):
        assert await store.get(job_key(job_id)) is not None


async def test_the_same_id_twice_at_once_is_one_job_and_one_refusal(
    grouped: JobRepository,
) -> None:
    """Two callers choosing one id concurrently: the first is stored, the second refused, as
    when they come one after the other (a commit never holds one key twice)."""
    results = await asyncio.gather(
        grouped.create_one(new_job("x")),
        grouped.create_one(new_job("x", "other")),
        return_exceptions=True,
    )
    assert results[0] is None
    assert isinstance(results[1], InvalidArgumentError)
    assert field_of(results[1]) == ["spec.id"]
    assert {t.name for t in (await grouped.get("x")).tasks} == {"main"}


async def test_a_store_failure_fails_every_caller_of_the_group(
    store: SqliteStore, counting: Counting, grouped: JobRepository
) -> None:
    """The commit itself failing is each caller's error, and nothing is written or cached;
    the next caller is written as usual."""
    counting.fail = StoreError("disk on fire")
    results = await asyncio.gather(
        *(grouped.create_one(new_job(f"j{i}")) for i in range(3)), return_exceptions=True
    )
    assert [str(r) for r in results] == ["disk on fire"] * 3
    assert all(isinstance(r, StoreError) for r in results)
    assert grouped.active() == []
    for i in range(3):
        assert await store.get(job_key(f"j{i}")) is None
    await grouped.create_one(new_job("after"))
    assert await store.get(job_key("after")) is not None


async def test_a_group_stays_within_what_one_commit_may_hold(
    counting: Counting, grouped: JobRepository
) -> None:
    """Many callers at once take as many commits as the store's limits ask for."""
    ids = [f"j{i:03d}" for i in range(120)]
    await asyncio.gather(*(grouped.create_one(new_job(job_id)) for job_id in ids))
    assert 1 < len(counting.commits) < len(ids)
    assert all(len(ops) <= MAX_OPS_PER_COMMIT for ops in counting.commits)
    assert {j.id for j in grouped.active()} == set(ids)


async def test_a_caller_gone_before_its_group_forms_is_left_out(
    store: SqliteStore, grouped: JobRepository
) -> None:
    """A caller cancelled while it waits for the next group: its job is not written."""
    first = asyncio.create_task(grouped.create_one(new_job("kept")))
    gone = asyncio.create_task(grouped.create_one(new_job("gone")))
    await asyncio.sleep(0)  # both wait for the group about to form
    gone.cancel()
    await first
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert await store.get(job_key("kept")) is not None
    assert await store.get(job_key("gone")) is None
