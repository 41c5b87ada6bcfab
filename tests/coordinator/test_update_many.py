"""JobRepository.update_many over a real SQLite store: batching, chunking, failures, CAS retry."""

from __future__ import annotations

from collections import Counter

from federation.api.v1 import jobs_pb2, records_pb2
from federation.common import job_state
from federation.coordinator.jobs.events import EventHub
from federation.coordinator.jobs.records import JOBS, Change, job_key, read_record, transition
from federation.coordinator.jobs.repository import MAX_OPS_PER_COMMIT, JobRepository
from federation.errors import JobNotFoundError, UnavailableError
from federation.store import Put, SqliteStore, StoreError

from .test_job_repository import drain, move, new_job

P = job_state.PENDING
SCH = job_state.SCHEDULING
DEL = job_state.DELEGATED


async def stored_job(store: SqliteStore, job_id: str) -> jobs_pb2.Job:
    """The job as the store holds it (not the repository's cache)."""
    kv = await store.get(job_key(job_id))
    assert kv is not None
    return read_record(kv.value).job


async def test_small_batch_writes_every_job_in_one_commit(
    store: SqliteStore, repo: JobRepository
) -> None:
    """Mutations of several jobs are all written, with their next event sequences, in one commit."""
    await repo.create([new_job("a", "x", "y"), new_job("b"), new_job("c")])
    before = await store.revision()
    results = await repo.update_many(
        [
            ("a", move(("x", SCH, "a-x"), ("y", SCH, "a-y"))),
            ("b", move(("main", SCH, "b-main"))),
            ("c", move(("main", SCH, "c-main"))),
        ]
    )
    assert await store.revision() == before + 1
    assert set(results) == {"a", "b", "c"}
    for job_id, result in results.items():
        assert isinstance(result, jobs_pb2.Job)
        assert result == await stored_job(store, job_id)
        kv = await store.get(job_key(job_id))
        assert kv is not None
        assert kv.mod_revision == before + 1
    assert [(e.sequence, e.task, e.reason) for e in await repo.events("a")] == [
        (1, "", "submitted"),
        (2, "x", "a-x"),
        (3, "y", "a-y"),
    ]
    assert [(e.sequence, e.reason) for e in await repo.events("b")] == [
        (1, "submitted"),
        (2, "b-main"),
    ]
    assert [(e.sequence, e.reason) for e in await repo.events("c")] == [
        (1, "submitted"),
        (2, "c-main"),
    ]
    a = results["a"]
    assert isinstance(a, jobs_pb2.Job)
    assert (a.state, a.last_event_sequence, a.reason) == (SCH, 3, "a-y")
    assert {j.id: j.state for j in repo.active()} == {"a": SCH, "b": SCH, "c": SCH}


async def test_mutations_of_one_job_apply_in_order_to_one_copy(
    store: SqliteStore, repo: JobRepository
) -> None:
    """Two mutations of the same job in one call run in order; both events are recorded."""
    await repo.create([new_job("j")])
    before = await store.revision()
    results = await repo.update_many(
        [
            ("j", move(("main", SCH, "placing"))),
            ("j", move(("main", DEL, "offered to s1"))),
        ]
    )
    assert await store.revision() == before + 1
    job = results["j"]
    assert isinstance(job, jobs_pb2.Job)
    assert job.tasks[0].state == DEL
    assert (job.state, job.last_event_sequence, job.reason) == (DEL, 3, "offered to s1")
    assert job == await stored_job(store, "j")
    events = await repo.events("j")
    assert [(e.sequence, e.task, e.state, e.reason) for e in events[1:]] == [
        (2, "main", SCH, "placing"),
        (3, "main", DEL, "offered to s1"),
    ]
    assert events[-1].job_state == DEL


async def test_each_event_carries_the_job_state_after_it(repo: JobRepository) -> None:
    """An event's job_state is the job's state after that event, as if updated one by one."""
    await repo.create([new_job("j")])
    await repo.update_many(
        [
            ("j", move(("main", SCH, "placing"))),
            ("j", move(("main", DEL, "offered to s1"))),
        ]
    )
    events = await repo.events("j")
    assert [(e.sequence, e.job_state) for e in events] == [(1, P), (2, SCH), (3, DEL)]


async def test_second_mutation_sees_the_first_ones_change(repo: JobRepository) -> None:
    """The later mutation of a job gets the copy the earlier one changed, not a fresh one."""
    await repo.create([new_job("j")])
    seen: list[jobs_pb2.JobState.ValueType] = []

    def look(job: jobs_pb2.Job) -> list[Change]:
        seen.append(job.tasks[0].state)
        return []

    await repo.update_many([("j", move(("main", SCH, "placing"))), ("j", look)])
    assert seen == [SCH]


async def test_large_batch_is_split_over_several_commits(
    store: SqliteStore, repo: JobRepository, hub: EventHub
) -> None:
    """More ops than MAX_OPS_PER_COMMIT go in several commits, each within the limit."""
    count = MAX_OPS_PER_COMMIT  # three ops each: three times the limit in all
    ids = [f"j{i:04d}" for i in range(count)]
    await repo.create([new_job(job_id) for job_id in ids])
    sub = hub.subscribe(lambda job: True)
    before = await store.revision()
    results = await repo.update_many([(job_id, move(("main", SCH, job_id))) for job_id in ids])
    after = await store.revision()
    assert after > before + 1
    assert sorted(results) == ids
    assert all(isinstance(r, jobs_pb2.Job) and r.state == SCH for r in results.values())
    written = [kv for kv in await store.range("/jobs/") if kv.mod_revision > before]
    assert len(written) == count  # every job, with its new event in its record
    # Each job's record, its new state's index entry, and its old one's deletion.
    per_commit = Counter(kv.mod_revision for kv in written)
    assert set(per_commit) == set(range(before + 1, after + 1))
    assert 3 * max(per_commit.values()) <= MAX_OPS_PER_COMMIT
    assert await store.count("/index/state/JOB_STATE_SCHEDULING/") == count
    assert await store.count("/index/state/JOB_STATE_PENDING/") == 0
    for job_id in ids:
        job_kv = await store.get(job_key(job_id))
        assert job_kv is not None
        record = read_record(job_kv.value)
        assert record.job.tasks[0].state == SCH
        assert [e.sequence for e in record.events] == [1, 2]
    assert sorted(e.job_id for e in drain(sub)) == ids


async def test_missing_job_fails_alone(store: SqliteStore, repo: JobRepository) -> None:
    """An unknown job id gets JobNotFoundError in the result; the other jobs are written."""
    await repo.create([new_job("a"), new_job("b")])
    before = await store.revision()
    results = await repo.update_many(
        [
            ("a", move(("main", SCH, "a"))),
            ("nope", move(("main", SCH, "nope"))),
            ("b", move(("main", SCH, "b"))),
        ]
    )
    assert isinstance(results["nope"], JobNotFoundError)
    for job_id in ("a", "b"):
        result = results[job_id]
        assert isinstance(result, jobs_pb2.Job)
        assert result.tasks[0].state == SCH
        assert (await stored_job(store, job_id)).tasks[0].state == SCH
    assert await store.revision() == before + 1
    assert await store.get(job_key("nope")) is None
    assert await repo.events("nope") == []


async def test_mutation_changing_nothing_writes_nothing(
    store: SqliteStore, repo: JobRepository, hub: EventHub
) -> None:
    """A mutation that changes nothing commits nothing, publishes nothing, and returns the job."""
    await repo.create([new_job("j")])
    sub = hub.subscribe(lambda job: True)
    before = await store.revision()
    results = await repo.update_many([("j", lambda job: [])])
    assert await store.revision() == before
    job = results["j"]
    assert isinstance(job, jobs_pb2.Job)
    assert job.id == "j"
    assert job == await stored_job(store, "j")
    assert job.last_event_sequence == 1
    assert drain(sub) == []


async def test_lost_cas_rereads_and_reapplies_on_the_fresh_version(
    store: SqliteStore, repo: JobRepository, hub: EventHub
) -> None:
    """A job changed behind the repository's back is re-read and its mutation re-applied."""
    await repo.create([new_job("stale", "a", "b"), new_job("other")])
    # Another writer moves task b and records its event, bumping the job's mod revision.
    fresh = await stored_job(store, "stale")
    transition(fresh, "b", SCH, "elsewhere")
    fresh.state = SCH
    fresh.last_event_sequence = 2
    fresh.cancel_requested = True
    outside = jobs_pb2.JobEvent(job_id="stale", sequence=2, state=SCH, task="b", reason="elsewhere")
    kept = (await repo.events("stale"))[:1]
    record = records_pb2.JobRecord(job=fresh, events=[*kept, outside])
    await store.commit([Put(job_key("stale"), record.SerializeToString())])
    sub = hub.subscribe(lambda job: True)
    results = await repo.update_many(
        [("stale", move(("a", SCH, "here"))), ("other", move(("main", SCH, "other")))]
    )
    stale = results["stale"]
    other = results["other"]
    assert isinstance(stale, jobs_pb2.Job)
    assert isinstance(other, jobs_pb2.Job)
    # The mutation ran on the store's version: b's move and the flag survive.
    assert [t.state for t in stale.tasks] == [SCH, SCH]
    assert stale.cancel_requested
    assert stale.last_event_sequence == 3
    assert stale == await stored_job(store, "stale")
    assert [(e.sequence, e.task, e.reason) for e in await repo.events("stale")] == [
        (1, "", "submitted"),
        (2, "b", "elsewhere"),
        (3, "a", "here"),
    ]
    assert other.tasks[0].state == SCH
    assert other == await stored_job(store, "other")
    assert [e.sequence for e in await repo.events("other")] == [1, 2]
    # The lost commit published nothing: each written event reaches watchers exactly once.
    assert sorted((e.job_id, e.sequence) for e in drain(sub)) == [("other", 2), ("stale", 3)]
    assert {j.id: j for j in repo.active()} == {"stale": stale, "other": other}


async def test_watchers_receive_every_jobs_events(repo: JobRepository, hub: EventHub) -> None:
    """A watcher hears the new events of every job in the batch, each job's in order."""
    await repo.create([new_job("a", "x", "y"), new_job("b"), new_job("c")])
    every = hub.subscribe(lambda job: True)
    only_b = hub.subscribe(lambda job: job.id == "b")
    await repo.update_many(
        [
            ("a", move(("x", SCH, "a1"))),
            ("b", move(("main", SCH, "b1"))),
            ("a", move(("y", SCH, "a2"))),
            ("c", move(("main", SCH, "c1"))),
        ]
    )
    published = drain(every)
    assert sorted((e.job_id, e.sequence, e.reason) for e in published) == [
        ("a", 2, "a1"),
        ("a", 3, "a2"),
        ("b", 2, "b1"),
        ("c", 2, "c1"),
    ]
    assert [e.sequence for e in published if e.job_id == "a"] == [2, 3]
    assert [(e.job_id, e.sequence) for e in drain(only_b)] == [("b", 2)]
    for job_id in ("a", "b", "c"):
        assert [e for e in published if e.job_id == job_id] == (await repo.events(job_id))[1:]


async def test_empty_batch_writes_nothing(store: SqliteStore, repo: JobRepository) -> None:
    """No mutations give an empty result and no commit."""
    await repo.create([new_job("j")])
    before = await store.revision()
    assert await repo.update_many([]) == {}
    assert await store.revision() == before


async def test_jobs_not_cached_are_read_from_the_store(store: SqliteStore) -> None:
    """A repository that never loaded the jobs reads them from the store and writes them."""
    writer = JobRepository(store, EventHub())
    await writer.create([new_job("a"), new_job("b")])
    fresh = JobRepository(store, EventHub())
    results = await fresh.update_many(
        [("a", move(("main", SCH, "a"))), ("b", move(("main", SCH, "b")))]
    )
    assert all(isinstance(r, jobs_pb2.Job) for r in results.values())
    assert [(await stored_job(store, j)).tasks[0].state for j in ("a", "b")] == [SCH, SCH]
    assert len(await store.range(JOBS)) == 2


class FailingFor:
    """A store whose commits fail when they write job ``victim`` (a timeout, a too-large
    request); every other commit goes through to the real store."""

    def __init__(self, inner: SqliteStore, victim: str) -> None:
        self._inner = inner
        self._victim = victim

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    async def commit(self, ops: list[Put]) -> int:
        if any(op.key == JOBS + self._victim for op in ops):
            raise StoreError("request is too large")
        return await self._inner.commit(ops)


async def test_a_failed_chunk_fails_its_jobs_alone(store: SqliteStore, hub: EventHub) -> None:
    """When one commit of a split batch fails, its jobs get an error and the rest are written."""
    repo = JobRepository(store, hub)
    ids = [f"j{i:03d}" for i in range(2 * MAX_OPS_PER_COMMIT)]  # one op each: two commits
    await repo.create([new_job(i) for i in ids])
    flaky = JobRepository(FailingFor(store, ids[-1]), hub)  # type: ignore[arg-type]
    await flaky.load()
    results = await flaky.update_many([(i, move(("main", SCH, "placing"))) for i in ids])
    failed = {i for i, r in results.items() if isinstance(r, UnavailableError)}
    assert ids[-1] in failed
    assert 0 < len(failed) < len(ids)
    for job_id in ids:
        state = (await stored_job(store, job_id)).tasks[0].state
        assert state == (P if job_id in failed else SCH)
