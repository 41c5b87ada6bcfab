"""JobRepository over a real SQLite store: atomic writes, event sequences, cache and recovery."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2, records_pb2
from federation.common import job_state
from federation.common.job_state import IllegalTransitionError
from federation.coordinator.jobs import records, repository
from federation.coordinator.jobs.events import EventHub, Subscription
from federation.coordinator.jobs.records import Change, Mutation, job_key, read_record, transition
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.policy.reservations import Reservations
from federation.errors import InvalidArgumentError, JobNotFoundError
from federation.store import Put, SqliteStore, StoreError

P = job_state.PENDING
SCH = job_state.SCHEDULING
DEL = job_state.DELEGATED
RUN = job_state.RUNNING
OK = job_state.SUCCEEDED
FAIL = job_state.FAILED


def new_job(job_id: str, *tasks: str) -> jobs_pb2.Job:
    """A freshly submitted job, shaped as the job manager builds one."""
    task_names = tasks or ("main",)
    job = jobs_pb2.Job(id=job_id, state=P, reason="submitted", submitted_by="admin:test")
    job.spec.id = job_id
    job.spec.name = job_id
    for name in task_names:
        job.spec.tasks.add(name=name, command=["run"])
        job.tasks.add(name=name, state=P, reason="submitted")
    return job


def move(*steps: tuple[str, jobs_pb2.JobState.ValueType, str]) -> Mutation:
    """A mutation moving tasks through ``(task, state, reason)`` steps in order."""

    def mutate(job: jobs_pb2.Job) -> list[Change]:
        return [transition(job, task, state, reason) for task, state, reason in steps]

    return mutate


def drain(sub: Subscription) -> list[jobs_pb2.JobEvent]:
    """Every event queued for ``sub`` so far."""
    out = []
    while not sub.queue.empty():
        event = sub.queue.get_nowait()
        assert event is not None
        out.append(event)
    return out


async def test_create_stores_job_and_first_event_in_one_commit(
    store: SqliteStore, repo: JobRepository, hub: EventHub
) -> None:
    """A new job and its 'submitted' event are written in one record by one commit, then
    published."""
    sub = hub.subscribe(lambda job: True)
    before = await store.revision()
    await repo.create([new_job("j1", "a", "b")])
    job_kv = await store.get(job_key("j1"))
    assert job_kv is not None
    assert job_kv.mod_revision == before + 1
    record = read_record(job_kv.value)
    assert record.job.last_event_sequence == 1
    (event,) = record.events
    assert (event.job_id, event.sequence, event.state, event.task, event.reason) == (
        "j1",
        1,
        P,
        "",
        "submitted",
    )
    assert event.job_state == P
    assert drain(sub) == [event]
    assert [j.id for j in repo.active()] == ["j1"]


async def test_create_writes_a_batch_in_one_commit(store: SqliteStore, repo: JobRepository) -> None:
    """Every job of a batch, with its first event and its index entries, lands in the same
    store revision."""
    revision = await store.revision()
    await repo.create([new_job("a"), new_job("b"), new_job("c")])
    kvs = await store.range("/jobs/")
    assert len(kvs) == 3
    assert {kv.mod_revision for kv in await store.range("/")} == {revision + 1}
    assert all(len(read_record(kv.value).events) == 1 for kv in kvs)
    assert await store.count("/index/") == 3


async def test_duplicate_id_is_an_invalid_argument_on_spec_id(
    store: SqliteStore, repo: JobRepository
) -> None:
    """Creating a job whose id exists fails on spec.id and leaves the store unchanged."""
    await repo.create([new_job("j1")])
    revision = await store.revision()
    with pytest.raises(InvalidArgumentError) as caught:
        await repo.create([new_job("j1", "other")])
    (violation,) = caught.value.violations
    assert violation.field == "spec.id"
    assert "'j1' already exists" in violation.description
    assert await store.revision() == revision
    assert [t.name for t in (await repo.get("j1")).tasks] == ["main"]


async def test_duplicate_in_a_batch_stores_nothing_of_the_batch(
    store: SqliteStore, repo: JobRepository, hub: EventHub
) -> None:
    """One existing id in a batch fails the whole batch, naming that job's index."""
    await repo.create([new_job("old")])
    sub = hub.subscribe(lambda job: True)
    revision = await store.revision()
    with pytest.raises(InvalidArgumentError) as caught:
        await repo.create([new_job("fresh"), new_job("old"), new_job("fresh-2")], batch=True)
    assert [v.field for v in caught.value.violations] == ["specs[1].id"]
    assert await store.revision() == revision
    assert await store.get(job_key("fresh")) is None
    assert await store.get(job_key("fresh-2")) is None
    assert [j.id for j in repo.active()] == ["old"]
    assert drain(sub) == []
    with pytest.raises(JobNotFoundError):
        await repo.get("fresh")


async def test_update_writes_events_with_increasing_sequence_and_job_state(
    repo: JobRepository,
) -> None:
    """Each recorded change becomes the next event, carrying the job state it produced."""
    await repo.create([new_job("j", "a", "b")])
    await repo.update("j", move(("a", SCH, "placing")))
    await repo.update("j", move(("a", DEL, "offered to s1")))
    job = await repo.update("j", move(("a", RUN, "started")))
    events = await repo.events("j")
    assert [e.sequence for e in events] == [1, 2, 3, 4]
    assert [(e.task, e.state) for e in events[1:]] == [("a", SCH), ("a", DEL), ("a", RUN)]
    assert [e.job_state for e in events] == [P, SCH, DEL, RUN]
    assert job.state == RUN
    assert job.last_event_sequence == 4
    assert job.reason == "started"
    assert (await repo.get("j")) == job


async def test_record_keeps_the_newest_events(
    store: SqliteStore, hub: EventHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job that moves more often than a record keeps events keeps the newest, in order, and
    a repository that reads the record afresh goes on from them."""
    monkeypatch.setattr(records, "MAX_EVENTS_KEPT", 3)
    repo = JobRepository(store, hub)
    await repo.create([new_job("j")])
    for i in range(3):
        await repo.update("j", move(("main", SCH, f"placing {i}"), ("main", P, f"back {i}")))
    assert [e.sequence for e in await repo.events("j")] == [5, 6, 7]
    fresh = JobRepository(store, hub)
    job = await fresh.update("j", move(("main", SCH, "again")))
    assert job.last_event_sequence == 8
    assert [(e.sequence, e.reason) for e in await fresh.events("j")] == [
        (6, "placing 2"),
        (7, "back 2"),
        (8, "again"),
    ]


async def test_large_job_record_reads_back_whole(store: SqliteStore, repo: JobRepository) -> None:
    """A record over 16 KiB (a length that takes three bytes to encode) reads back equal."""
    job = new_job("big")
    job.spec.tasks[0].command.extend(["x" * 1000] * 40)
    await repo.create([job])
    written = await repo.update("big", move(("main", SCH, "placing")))
    kv = await store.get(job_key("big"))
    assert kv is not None
    assert len(kv.value) > 1 << 14
    record = read_record(kv.value)
    assert record.job == written
    assert [e.reason for e in record.events] == ["submitted", "placing"]


async def test_one_update_may_record_several_changes(
    store: SqliteStore, repo: JobRepository, hub: EventHub
) -> None:
    """Changes returned together get consecutive sequences and are committed once."""
    await repo.create([new_job("j", "a", "b")])
    sub = hub.subscribe(lambda job: job.id == "j")
    revision = await store.revision()
    job = await repo.update("j", move(("a", SCH, "one"), ("b", SCH, "two")))
    assert await store.revision() == revision + 1
    published = drain(sub)
    assert [(e.sequence, e.task, e.reason) for e in published] == [
        (2, "a", "one"),
        (3, "b", "two"),
    ]
    assert published == (await repo.events("j"))[1:]
    assert job.reason == "two"


async def test_update_without_changes_writes_nothing(
    store: SqliteStore, repo: JobRepository
) -> None:
    """A mutation that changes nothing and records nothing does not touch the store."""
    await repo.create([new_job("j")])
    revision = await store.revision()
    job = await repo.update("j", lambda job: [])
    assert await store.revision() == revision
    assert job.last_event_sequence == 1


async def test_update_changing_fields_without_events_is_written(
    store: SqliteStore, repo: JobRepository
) -> None:
    """A mutation that edits the job but records no change is stored with no new event."""
    await repo.create([new_job("j")])

    def request_cancel(job: jobs_pb2.Job) -> list[Change]:
        job.cancel_requested = True
        return []

    await repo.update("j", request_cancel)
    kv = await store.get(job_key("j"))
    assert kv is not None
    assert read_record(kv.value).job.cancel_requested
    assert len(await repo.events("j")) == 1


async def test_illegal_transition_writes_nothing(store: SqliteStore, repo: JobRepository) -> None:
    """A mutation attempting an illegal transition raises and leaves job and cache as they were."""
    await repo.create([new_job("j")])
    revision = await store.revision()
    with pytest.raises(IllegalTransitionError):
        await repo.update("j", move(("main", RUN, "skipped ahead")))
    assert await store.revision() == revision
    assert (await repo.get("j")).tasks[0].state == P


async def test_update_of_unknown_job_is_not_found(repo: JobRepository) -> None:
    """Updating a job that does not exist raises JobNotFoundError."""
    with pytest.raises(JobNotFoundError):
        await repo.update("nope", lambda job: [])


async def test_terminal_job_leaves_the_active_cache(
    store: SqliteStore, repo: JobRepository
) -> None:
    """Once every task is terminal the job is dropped from active() but still readable."""
    await repo.create([new_job("done", "a", "b"), new_job("live")])
    for task in ("a", "b"):
        await repo.update("done", move((task, SCH, "p"), (task, DEL, "d")))
    job = await repo.update("done", move(("a", OK, "exit 0")))
    assert job.state == DEL
    assert {j.id for j in repo.active()} == {"done", "live"}
    job = await repo.update("done", move(("b", FAIL, "exit 1")))
    assert job.state == FAIL
    assert [j.id for j in repo.active()] == ["live"]
    stored = await repo.get("done")
    assert stored.state == FAIL
    assert stored.tasks[1].HasField("finished_at")
    assert (await repo.events("done"))[-1].job_state == FAIL


async def test_active_returns_copies(repo: JobRepository) -> None:
    """Editing a job returned by active() or get() does not change the cached job."""
    await repo.create([new_job("j")])
    repo.active()[0].reason = "tampered"
    (await repo.get("j")).reason = "tampered too"
    assert (await repo.get("j")).reason == "submitted"


async def test_reopened_store_loads_only_unfinished_jobs(tmp_path: Path) -> None:
    """After close and reopen, load() returns the unfinished jobs as last written."""
    path = tmp_path / "db"
    store = await SqliteStore.open(path)
    repo = JobRepository(store, EventHub())
    await repo.create([new_job("finished"), new_job("running"), new_job("waiting")])
    await repo.update("finished", move(("main", SCH, "p"), ("main", DEL, "d")))
    await repo.update("finished", move(("main", OK, "exit 0")))
    running = await repo.update(
        "running", move(("main", SCH, "p"), ("main", DEL, "d"), ("main", RUN, "r"))
    )
    await store.close()

    store = await SqliteStore.open(path)
    try:
        reopened = JobRepository(store, EventHub())
        loaded = await reopened.load()
        assert sorted(j.id for j in loaded) == ["running", "waiting"]
        assert next(j for j in loaded if j.id == "running") == running
        assert sorted(j.id for j in reopened.active()) == ["running", "waiting"]
        job = await reopened.update("running", move(("main", OK, "exit 0")))
        assert job.last_event_sequence == 5
        assert [e.sequence for e in await reopened.events("running")] == [1, 2, 3, 4, 5]
        assert (await reopened.get("finished")).state == OK
    finally:
        await store.close()


async def test_stale_cache_rereads_and_reapplies_after_a_lost_cas(
    store: SqliteStore,
) -> None:
    """A writer whose cached job is stale loses the CAS, re-reads, and re-applies its change."""
    first = JobRepository(store, EventHub())
    second = JobRepository(store, EventHub())
    await first.create([new_job("j", "a", "b")])
    await second.load()
    await first.update("j", move(("a", SCH, "first")))
    job = await second.update("j", move(("b", SCH, "second")))
    assert [t.state for t in job.tasks] == [SCH, SCH]
    assert [e.sequence for e in await second.events("j")] == [1, 2, 3]


async def test_updates_of_one_job_are_serialised(repo: JobRepository) -> None:
    """Concurrent updates of one job each see the previous one and never conflict."""
    await repo.create([new_job("j", *(f"t{i}" for i in range(8)))])
    await asyncio.gather(*(repo.update("j", move((f"t{i}", SCH, str(i)))) for i in range(8)))
    events = await repo.events("j")
    assert [e.sequence for e in events] == list(range(1, 10))
    assert {e.task for e in events[1:]} == {f"t{i}" for i in range(8)}
    assert all(t.state == SCH for t in (await repo.get("j")).tasks)


async def test_hub_only_delivers_to_subscribers_that_accept_the_job(
    repo: JobRepository, hub: EventHub
) -> None:
    """Events are published only to subscriptions whose filter accepts the job."""
    mine = hub.subscribe(lambda job: job.id == "mine")
    await repo.create([new_job("mine"), new_job("theirs")])
    await repo.update("theirs", move(("main", SCH, "p")))
    assert [e.job_id for e in drain(mine)] == ["mine"]


async def test_cancelled_update_still_lands_in_cache_and_watchers(
    repo: JobRepository, hub: EventHub
) -> None:
    """An update cancelled during its commit is still cached and published, not lost."""
    await repo.create([new_job("j", "a")])
    sub = hub.subscribe(lambda job: True)
    writer = asyncio.create_task(repo.update("j", move(("a", SCH, "offered"))))
    await asyncio.sleep(0)  # the writer is now inside its commit
    writer.cancel()
    event = await asyncio.wait_for(sub.next(), 5)
    assert (event.task, event.state) == ("a", SCH)
    (cached,) = repo.active()
    assert cached.tasks[0].state == SCH
    again = await repo.update("j", move(("a", P, "back")))
    assert again.last_event_sequence == 3


async def test_pending_lists_jobs_with_a_pending_task_not_held_oldest_first(
    repo: JobRepository,
) -> None:
    """The scheduler's view: held tasks (offers out) are left out until released, and a job
    with another PENDING task stays listed; the order is by id, also after a release."""
    await repo.create([new_job("j-1"), new_job("j-2", "a", "b"), new_job("j-3")])
    assert [j.id for j in repo.pending()] == ["j-1", "j-2", "j-3"]
    negotiating = Reservations()
    repo.counts(negotiating, out_of_line=True)

    negotiating.keep([(("j-1", "main"), {}), (("j-2", "a"), {})])
    assert [j.id for j in repo.pending()] == ["j-2", "j-3"]  # j-2 still has b

    await repo.update("j-3", move(("main", DEL, "x accepted")))  # no longer pending
    await repo.update("j-1", move(("main", P, "declined")))  # written while held: left out
    assert [j.id for j in repo.pending()] == ["j-2"]

    negotiating.let_go([("j-1", "main"), ("j-2", "a")])
    assert [j.id for j in repo.pending()] == ["j-1", "j-2"]


async def test_a_reservation_and_a_negotiation_hold_never_let_go_of_each_other(
    repo: JobRepository,
) -> None:
    """A change's reservation of a running task counts against its queue in place of what
    the task holds, whatever the scheduler holds or lets go of for the same task (a settled
    negotiation is let go after its task already runs); the scheduler's room for
    negotiations counts only its own."""
    job = new_job("j-1")
    job.spec.queue = "q"
    job.spec.tasks[0].resources.cpu = 1
    await repo.create([job])
    await repo.update("j-1", move(("main", DEL, "at x"), ("main", RUN, "runs")))
    assert repo.usage.of("q")["cpu"] == 1
    key = ("j-1", "main")
    negotiating, growing = Reservations(), Reservations()
    repo.counts(negotiating, out_of_line=True)
    repo.counts(growing)
    negotiating.keep([(key, {"cpu": 1.0})])  # the scheduler's negotiation, not let go yet
    assert repo.usage.of("q")["cpu"] == 1
    growing.keep([(key, {"cpu": 3.0})])  # a scale-up to 3 replicas under way
    assert repo.usage.of("q")["cpu"] == 3
    negotiating.let_go([key])  # the scheduler lets go of its negotiation
    assert repo.usage.of("q")["cpu"] == 3
    assert key not in negotiating
    growing.let_go([key])  # given up: what the stored spec holds
    assert repo.usage.of("q")["cpu"] == 1


async def test_store_of_an_earlier_layout_is_refused_by_name(store: SqliteStore) -> None:
    """A store holding jobs as earlier versions wrote them (the job alone, each event under
    /events/) is refused with a reason at load, not read as records."""
    old = new_job("j1")
    event = jobs_pb2.JobEvent(job_id="j1", sequence=1, state=P, reason="submitted")
    await store.commit(
        [
            Put(job_key("j1"), old.SerializeToString()),
            Put("/events/j1/0000000001", event.SerializeToString()),
        ]
    )
    with pytest.raises(StoreError, match="written by an earlier version"):
        await JobRepository(store, EventHub()).load()


async def test_a_list_call_reads_a_bounded_number_of_jobs(repo: JobRepository) -> None:
    """A filter that matches little gets short (even empty) pages with a token, never one
    call that reads every stored job; following the tokens finds every match once."""
    await repo.create([new_job(f"job-{i:03}") for i in range(250)])
    wanted = {"job-005", "job-180", "job-249"}
    found: list[str] = []
    pages = 0
    token = ""
    while True:
        page = job_service_pb2.ListJobsResponse().jobs
        token = await repo.list_page(
            lambda job: job.id in wanted, page, page_size=100, page_token=token, max_scanned=60
        )
        found += [job.id for job in page]
        pages += 1
        if not token:
            break
    assert found == sorted(wanted)
    assert pages == 5  # 250 jobs, 60 read per call


def test_a_page_takes_the_job_from_its_record_undecoded() -> None:
    """Listing decodes only the job of each stored record, never its events: the bytes it
    takes are the job's own, whatever the record's size."""
    job = new_job("j" * 300)  # a job over 127 bytes: a length of more than one byte
    events = [jobs_pb2.JobEvent(job_id=job.id, sequence=n) for n in range(1, 50)]
    record = records_pb2.JobRecord(job=job, events=events).SerializeToString()
    assert records.job_bytes(record) == job.SerializeToString()
    assert records.job_bytes(records_pb2.JobRecord(events=events).SerializeToString()) == b""


async def test_a_job_just_finished_is_read_without_the_store(
    store: SqliteStore, repo: JobRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients poll the job they saw finish: the newest finished jobs are answered from
    memory, as written; an older one comes from the store."""
    await repo.create([new_job("done"), new_job("old")])
    await repo.update("old", move(("main", DEL, "d"), ("main", RUN, "r"), ("main", OK, "ok")))
    monkeypatch.setattr(repository, "FINISHED_KEPT", 1)
    await repo.update("done", move(("main", DEL, "d"), ("main", RUN, "r"), ("main", OK, "ok")))

    async def no_reads(key: str) -> None:
        raise AssertionError(f"read {key} from the store")

    monkeypatch.setattr(store, "get", no_reads)
    finished = await repo.get("done")
    assert finished.state == OK
    with pytest.raises(AssertionError, match="read /jobs/old"):
        await repo.get("old")  # pushed out by the newer one
