"""Durable jobs: every transition is written to the store before anyone is told."""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Iterator,
    Sequence,
)
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeAlias

import structlog
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from federation.api.v1 import jobs_pb2, records_pb2
from federation.common import job_state
from federation.coordinator.jobs import index as job_index
from federation.coordinator.jobs import records
from federation.coordinator.jobs.events import EventHub
from federation.coordinator.jobs.listing import (
    MAX_REPLY_BYTES,
    MAX_SCANNED,
    SCAN_BATCH,
    ListFilter,
    Page,
)
from federation.coordinator.jobs.records import (
    JOBS,
    OLD_EVENTS,
    Change,
    LineKey,
    Mutation,
    encoded_events,
    job_bytes,
    job_key,
    line_order,
    new_event,
    now_timestamp,
    read_record,
    record_value,
)
from federation.coordinator.policy.reservations import Reservations, merged
from federation.coordinator.policy.usage import QueueUsage
from federation.errors import (
    ConflictError,
    FederationError,
    FieldViolation,
    InvalidArgumentError,
    JobNotFoundError,
    UnavailableError,
)
from federation.metrics import JOBS_REMOVED, SUBMIT_COMMITS, TASK_TRANSITIONS
from federation.store import CasConflictError, Delete, Op, Put, Store, StoreError
from federation.timeslice import TimeSlice

log = structlog.get_logger()


class JobRepository:
    """Jobs in the store, with active jobs cached and one writer per job at a time."""

    def __init__(
        self, store: Store, hub: EventHub, domain_of: Callable[[str], str] = lambda site: ""
    ) -> None:
        """``domain_of`` names a site's domain, for quotas scoped to a domain."""
        self._store = store
        self._hub = hub
        self._active: dict[str, _Cached] = {}
        self._unfinished: Counter[str] = Counter()
        """Cached (unfinished) jobs per tenant: what a tenant's limit is checked against."""
        self._locks: dict[str, asyncio.Lock] = {}
        # Jobs with a PENDING task: what the scheduler looks at, without walking every job.
        # Kept in line order (``line_order``) without sorting on every look: jobs of one
        # priority arrive in order, and only one that goes ahead marks the line unsorted.
        self._pending: dict[str, LineKey] = {}
        self._pending_in_order = True
        self._kept: list[Reservations] = []
        """Reservations counted against their queues in place of what their tasks' stored
        state holds (``counts``), the ones that hold tasks out of the line last."""
        self._out_of_line: list[Reservations] = []
        """Of those, the ones whose PENDING tasks ``pending`` leaves out."""
        self._finished: OrderedDict[str, jobs_pb2.Job] = OrderedDict()
        """The newest jobs seen finishing (``FINISHED_KEPT``), as written."""
        self.usage = QueueUsage(domain_of)
        """What each queue's tasks hold (placed, running, or with offers out)."""
        self._by_state: Counter[jobs_pb2.JobState.ValueType] | None = None
        """Stored jobs per state: counted from the state index at ``load``, then kept with
        every write (each one's compare-and-swap names the state it replaces)."""
        self._joining: list[_Joining] = []
        """New jobs of ``create_one`` waiting for the next group commit, in arrival order."""
        self._grouping: asyncio.Task[None] | None = None
        """Commits the groups while jobs wait (``_commit_groups``)."""

    def _cache(
        self,
        job: jobs_pb2.Job,
        revision: int,
        events: list[bytes],
        index_keys: frozenset[str] | None = None,
    ) -> None:
        """Keep an unfinished job as written (``index_keys``: its index entries, if known)."""
        if job_state.is_terminal(job.state):
            self._forget(job.id)
            # Clients poll a job they just saw finish: answer them without a store read.
            self._finished[job.id] = job
            self._finished.move_to_end(job.id)
            if len(self._finished) > FINISHED_KEPT:
                self._finished.popitem(last=False)
            return
        if job.id not in self._active:
            self._unfinished[job.spec.tenant] += 1
        if index_keys is None:
            index_keys = job_index.keys(job)
        self._active[job.id] = (job, revision, events, index_keys)
        self._index(job)

    @property
    def store(self) -> Store:
        return self._store

    def unfinished(self, tenant: str) -> int:
        """How many of the tenant's jobs have not finished."""
        return self._unfinished[tenant]

    def _index(self, job: jobs_pb2.Job) -> None:
        """Keep ``job`` in the pending index exactly while it has a PENDING task not held out
        of the line, and what it holds counted against its queue."""
        self.usage.update(job, merged(self._kept))
        out = self._out_of_line
        if any(
            t.state == job_state.PENDING and not any((job.id, t.name) in r for r in out)
            for t in job.tasks
        ):
            if job.id not in self._pending:
                key = line_order(job)
                if self._pending and key < self._pending[next(reversed(self._pending))]:
                    self._pending_in_order = False
                self._pending[job.id] = key
        else:
            self._pending.pop(job.id, None)

    def counts(self, reservations: Reservations, *, out_of_line: bool = False) -> None:
        """Count ``reservations`` against their queues from now on, in place of what their
        tasks' stored state holds; ``out_of_line``: their PENDING tasks are left out of
        ``pending`` too (offers are out for them, which needs no write). Where both kinds
        keep one task, the other kind counts: a running task's change is newer than a
        negotiation that settled it and is not yet let go."""
        if out_of_line:
            self._kept.append(reservations)
            self._out_of_line.append(reservations)
        else:
            self._kept.insert(0, reservations)
        reservations.watch(self._reindex)

    def _reindex(self, job_id: str) -> None:
        if cached := self._active.get(job_id):
            self._index(cached[0])

    def pending(self) -> Iterator[jobs_pb2.Job]:
        """The jobs that have a PENDING task not held out of the line, in line order
        (``line_order``): the cached messages themselves, not copies (a hot path), so callers
        read them and never change them. Lazily, as a caller often needs only the first few;
        a caller may await between jobs (the ids are taken at the start, and a job no longer
        pending when reached is skipped)."""
        for job_id in self.pending_ids():
            if (job := self.pending_job(job_id)) is not None:
                yield job

    def pending_ids(self) -> list[str]:
        """The ids of the jobs ``pending`` yields, in line order, as they are now: a caller
        that passes most of them by need not read their messages."""
        if not self._pending_in_order:
            self._pending = dict(sorted(self._pending.items(), key=lambda item: item[1]))
            self._pending_in_order = True
        return list(self._pending)

    def pending_job(self, job_id: str) -> jobs_pb2.Job | None:
        """The job as cached (as ``pending`` yields it), or None if it is no longer pending."""
        if job_id in self._pending and (cached := self._active.get(job_id)) is not None:
            return cached[0]
        return None

    def cached(self, job_id: str) -> jobs_pb2.Job | None:
        """An unfinished job as cached (the message itself: read it, never change it)."""
        cached = self._active.get(job_id)
        return cached[0] if cached is not None else None

    async def load(self) -> list[jobs_pb2.Job]:
        """Cache every unfinished job from the store; returns them (for recovery).

        Raises:
            StoreError: The store holds jobs laid out otherwise (by an earlier version).
        """
        if await self._store.count(OLD_EVENTS):
            raise StoreError(
                "the store holds jobs written by an earlier version (each event under "
                f"{OLD_EVENTS}), which this version reads only once migrated (key layout 1 "
                "to 2, which a leading coordinator does before it loads jobs)"
            )
        by_state: Counter[jobs_pb2.JobState.ValueType] = Counter()
        for state in jobs_pb2.JobState.values():
            name = job_index.prefix(job_index.STATE, jobs_pb2.JobState.Name(state))
            by_state[state] = await self._store.count(name)
            if job_state.is_terminal(state):
                continue
            start = name
            while page := await self._store.range(name, start_after=start, limit=1000):
                for entry in page:
                    await self._load_one(entry.key.removeprefix(name))
                start = page[-1].key
        self._by_state = by_state
        return [cached[0] for cached in self._active.values()]

    async def _load_one(self, job_id: str) -> None:
        kv = await self._store.get(job_key(job_id))
        if kv is not None:
            record = read_record(kv.value)
            self._cache(record.job, kv.mod_revision, encoded_events(record.events))

    def active(self) -> list[jobs_pb2.Job]:
        """Copies of the cached unfinished jobs."""
        return [_copy(cached[0]) for cached in self._active.values()]

    def at_site(self) -> Iterator[jobs_pb2.Job]:
        """The cached unfinished jobs with a task delegated to or running at a site (the
        messages themselves: read them, never change them)."""
        for job, *_ in self._active.values():
            if any(t.state in job_state.AT_SITE for t in job.tasks):
                yield job

    def at_sites(self, sites: Collection[str]) -> list[jobs_pb2.Job]:
        """Copies of the unfinished jobs with a task delegated to or running at one of ``sites``."""
        return [
            _copy(job)
            for job, *_ in self._active.values()
            if any(t.site in sites and t.state in job_state.AT_SITE for t in job.tasks)
        ]

    def at_any_site(self) -> Iterator[jobs_pb2.Job]:
        """The unfinished jobs with a task delegated to or running at some site, as cached
        (the messages themselves: read them at once, never change them)."""
        for job, *_ in list(self._active.values()):
            if any(t.state in job_state.AT_SITE for t in job.tasks):
                yield job

    async def get(self, job_id: str) -> jobs_pb2.Job:
        if cached := self._active.get(job_id):
            return _copy(cached[0])
        if (finished := self._finished.get(job_id)) is not None:
            return _copy(finished)
        kv = await self._store.get(job_key(job_id))
        if kv is None:
            raise JobNotFoundError(job_id)
        return read_record(kv.value).job

    async def list_page(
        self,
        accepts: Callable[[jobs_pb2.Job], bool],
        into: RepeatedCompositeFieldContainer[jobs_pb2.Job],
        page_size: int,
        page_token: str,
        max_bytes: int = MAX_REPLY_BYTES,
        max_scanned: int = MAX_SCANNED,
        where: ListFilter | None = None,
    ) -> str:
        """Add to ``into`` (a reply's repeated field: jobs are decoded straight into it) up to
        ``page_size`` jobs after ``page_token`` that ``accepts``, in id order, and fewer if
        they would take more than ``max_bytes`` (but always at least one); returns the next
        page's token.

        ``where`` narrows the jobs read to those its indexes name (``accepts`` still has the
        last word): only their records are read. At most ``max_scanned`` stored jobs (or
        index entries) are read per call, in batches that give the event loop back between
        them: a filter that matches little must not cost a scan of every job. A page cut short
        so has a next token though it may hold no jobs; otherwise the next token is set only
        when another matching job exists.
        """
        reply = Page(into, accepts, page_size, max_bytes)
        if where is not None and where.sets:
            return await self._list_indexed(where, reply, page_token, max_scanned)
        scanned = 0
        timeslice = TimeSlice()
        start = job_key(page_token) if page_token else ""
        while True:
            page = await self._store.range(JOBS, start_after=start, limit=SCAN_BATCH)
            for kv in page:
                await timeslice.share()
                if (full := reply.offer(job_bytes(kv.value))) is not None:
                    return full
                scanned += 1
                if scanned >= max_scanned:
                    return kv.key.removeprefix(JOBS)
            if len(page) < SCAN_BATCH:
                return ""
            start = page[-1].key

    async def _list_indexed(
        self, where: ListFilter, reply: Page, page_token: str, max_scanned: int
    ) -> str:
        """``list_page`` over the jobs in every set of ``where``, leapfrogging their indexes."""
        found = job_index.Filter(self._store, where.sets, SCAN_BATCH)
        timeslice = TimeSlice()
        after = page_token
        while True:
            await timeslice.share()
            job_id = await found.next(after)
            if job_id is None:
                return ""
            after = job_id
            kv = await self._store.get(job_key(job_id))
            if kv is not None and (full := reply.offer(job_bytes(kv.value))) is not None:
                return full
            if found.read >= max_scanned:
                return job_id

    async def create(self, jobs: list[jobs_pb2.Job], *, batch: bool = False) -> None:
        """Store new jobs, each with its first event, in one atomic commit.

        ``batch``: they came as SubmitJobs' ``specs`` (even one alone), not SubmitJob's ``spec``,
        which a refusal's field path names.
        """
        staged: list[_Staged] = []
        timeslice = TimeSlice()
        for job in jobs:
            await timeslice.share()
            staged.append(_new_stage(job))
        try:
            revision = await asyncio.shield(self._commit_new(staged))
        except CasConflictError as err:
            job_id = err.key.removeprefix(JOBS)
            index = next(i for i, j in enumerate(jobs) if j.id == job_id)
            raise _exists(job_id, f"specs[{index}].id" if batch else "spec.id") from None
        log.debug("jobs_created", count=len(jobs), revision=revision)

    async def create_one(self, job: jobs_pb2.Job) -> None:
        """Store one new job (SubmitJob's), with its first event, in a commit it may share.

        Group commit: jobs that arrive while a commit of jobs from this method is under way
        wait for it to end and then go in the next one together, so concurrent callers cost
        one store commit (one revision, one fsync, one watcher wake-up), not one each. Each
        caller still gets its own outcome: a job whose id exists already is refused alone (the
        others go in the commit after), while a failure of the commit itself (the store, the
        leadership) is every caller's in it. A caller that stops waiting before its group is
        formed is left out of it; once formed, its job is written all the same, as ``create``'s
        are once their commit is under way.
        """
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._joining.append((_new_stage(job), future))
        if self._grouping is None or self._grouping.done():
            self._grouping = asyncio.create_task(self._commit_groups())
        await future

    async def _commit_groups(self) -> None:
        """Commit the jobs waiting in ``_joining``, a group at a time, until none waits."""
        while self._joining:
            group, self._joining = _group(self._joining)
            group = [(stage, future) for stage, future in group if not future.done()]
            if not group:
                continue
            try:
                await self._commit_new([stage for stage, _ in group])
            except CasConflictError as err:
                # Only a new job's put expects a revision (0: not there): that job's id is
                # taken. Nothing was written; the others try again in the next commit.
                job_id = err.key.removeprefix(JOBS)
                taken = [(s, f) for s, f in group if s.job.id == job_id]
                if not taken:
                    _fail(group, err)
                    continue
                _fail(taken, _exists(job_id, "spec.id"))
                self._joining[:0] = [(s, f) for s, f in group if s.job.id != job_id]
            except BaseException as err:
                _fail(group, err)
                if not isinstance(err, Exception):
                    raise  # cancelled: the loop is closing
            else:
                for _, future in group:
                    if not future.done():
                        future.set_result(None)

    async def _commit_new(self, staged: list[_Staged]) -> int:
        """Commit new jobs, then cache and publish them (run shielded from cancellation)."""
        revision = await self._store.commit([op for stage in staged for op in stage.ops()])
        SUBMIT_COMMITS.inc()
        self._counted(staged)
        timeslice = TimeSlice()
        for stage in staged:
            await timeslice.share()
            self._cache(_copy(stage.job), revision, stage.encoded, stage.index_keys)
            self._hub.publish(stage.job, stage.events)
        return revision

    @asynccontextmanager
    async def _locked(self, job_id: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(job_id, asyncio.Lock())
        async with lock:
            yield

    async def _current(self, job_id: str) -> tuple[jobs_pb2.Job, _Cached]:
        """A copy of the job to change, and the job as it is (not to be changed) with its
        store revision and encoded events: from the cache, else from the store."""
        cached = self._active.get(job_id)
        if cached is not None:
            return _copy(cached[0]), cached
        kv = await self._store.get(job_key(job_id))
        if kv is None:
            raise JobNotFoundError(job_id)
        record = read_record(kv.value)
        stored = (record.job, kv.mod_revision, encoded_events(record.events))
        return _copy(record.job), (*stored, job_index.keys(record.job))

    async def update(self, job_id: str, mutate: Mutation) -> jobs_pb2.Job:
        """Apply ``mutate`` to a copy of the job, write it with its events, then publish.

        ``mutate`` changes the job in place and returns the task changes to record; when it
        returns none and changes nothing, nothing is written. Read the job returned, never change
        it: once written, it is the message now cached. Mutations are pure functions of the job,
        so after a lost compare-and-swap the job is re-read and the mutation re-run.
        """
        async with self._locked(job_id):
            return await self._update_locked(job_id, mutate)

    async def update_many(
        self, mutations: Sequence[tuple[str, Mutation]]
    ) -> dict[str, jobs_pb2.Job | FederationError]:
        """``update`` for many jobs at once, in as few store commits as the store allows.

        A job named more than once gets its mutations in order. Each job succeeds or fails on
        its own: the result maps every job id to the job as written, or to why it was not.
        """
        steps: dict[str, list[Mutation]] = {}
        for job_id, mutate in mutations:
            steps.setdefault(job_id, []).append(mutate)
        composed = {job_id: _compose(each) for job_id, each in steps.items()}
        results: dict[str, jobs_pb2.Job | FederationError] = {}
        held: list[asyncio.Lock] = []
        try:
            for job_id in sorted(composed):  # in id order, so two callers never deadlock
                lock = self._locks.setdefault(job_id, asyncio.Lock())
                await lock.acquire()
                held.append(lock)
            staged: list[_Staged] = []
            timeslice = TimeSlice()
            for job_id, mutate in composed.items():
                await timeslice.share()
                try:
                    job, stage = await self._mutated(job_id, mutate)
                except FederationError as err:
                    results[job_id] = err
                    continue
                results[job_id] = job
                if stage is not None:
                    staged.append(stage)
            chunks = _chunks(staged)
            # Shielded: once a commit is under way, the cache and the watchers must hear of
            # it even if the caller is cancelled meanwhile.
            outcomes = await asyncio.gather(
                *(asyncio.shield(self._write(chunk)) for chunk in chunks), return_exceptions=True
            )
            for chunk, outcome in zip(chunks, outcomes, strict=True):
                if isinstance(outcome, CasConflictError):
                    # Another writer got to one of these jobs (that one is re-read); the commit
                    # wrote none of them, so each tries again on its own.
                    self._forget(outcome.key.removeprefix(JOBS))
                    for stage in chunk:
                        job_id = stage.job.id
                        try:
                            results[job_id] = await self._update_locked(job_id, composed[job_id])
                        except (FederationError, StoreError) as err:
                            results[job_id] = _failed(job_id, err)
                elif isinstance(outcome, Exception):
                    # Nothing of this chunk was written; other chunks may have been.
                    for stage in chunk:
                        results[stage.job.id] = _failed(stage.job.id, outcome)
                elif isinstance(outcome, BaseException):
                    raise outcome
        finally:
            for lock in held:
                lock.release()
        return results

    async def _update_locked(self, job_id: str, mutate: Mutation) -> jobs_pb2.Job:
        for attempt in range(2):
            job, stage = await self._mutated(job_id, mutate)
            if stage is None:
                return job
            try:
                # Shielded, as in update_many.
                await asyncio.shield(self._write([stage]))
                return job
            except CasConflictError:
                self._forget(job_id)
                if attempt:
                    raise ConflictError(f"job {job_id} changed concurrently; retry") from None
        raise AssertionError("unreachable")

    async def _mutated(self, job_id: str, mutate: Mutation) -> tuple[jobs_pb2.Job, _Staged | None]:
        """The job after ``mutate``, and what to write (None when nothing changed)."""
        job, (original, revision, encoded, index_keys) = await self._current(job_id)
        states = {t.name: t.state for t in job.tasks}
        changes = mutate(job)
        if not changes and job == original:
            return job, None
        job.state = job_state.job_state(t.state for t in job.tasks)
        now = now_timestamp()
        events: list[jobs_pb2.JobEvent] = []
        for change in changes:
            # Each event carries the job's state just after its own change.
            states[change.task] = change.state
            job.last_event_sequence += 1
            state_after = job_state.job_state(states.values())
            events.append(new_event(job, job.last_event_sequence, change, state_after, now))
        if events:
            job.reason = events[-1].reason
        job.updated_at.CopyFrom(now)
        encoded = [*encoded, *encoded_events(events)][-records.MAX_EVENTS_KEPT :]
        put = Put(job_key(job.id), record_value(job, encoded), expect_revision=revision)
        new_keys = job_index.keys(job)
        index_ops = job_index.changes(index_keys, new_keys)
        return job, _Staged(job, put, events, encoded, original, index_ops, new_keys)

    def _forget(self, job_id: str) -> None:
        """Drop a job from the cache: it finished, or the store holds a newer version."""
        if (cached := self._active.pop(job_id, None)) is not None:
            self._unfinished[cached[0].spec.tenant] -= 1
        self._pending.pop(job_id, None)
        self.usage.remove(job_id)

    async def _write(self, staged: list[_Staged]) -> None:
        """Write jobs and their events in one commit, then cache and publish them."""
        new_revision = await self._store.commit([op for stage in staged for op in stage.ops()])
        self._counted(staged)
        states = Counter(event.state for stage in staged for event in stage.events)
        for state, count in states.items():
            TASK_TRANSITIONS.labels(jobs_pb2.JobState.Name(state)).inc(count)
        timeslice = TimeSlice()
        for stage in staged:
            await timeslice.share()
            job = stage.job
            # The caller gets it too: read-only.
            self._cache(job, new_revision, stage.encoded, stage.index_keys)
            if job_state.is_terminal(job.state):
                self._locks.pop(job.id, None)
            if stage.before is None or job.state != stage.before.state:
                log.debug("job_state_changed", job=job.id, state=jobs_pb2.JobState.Name(job.state))
            self._hub.publish(job, stage.events)

    async def events(self, job_id: str) -> list[jobs_pb2.JobEvent]:
        """The job's recorded events (the newest MAX_EVENTS_KEPT), oldest first."""
        kv = await self._store.get(job_key(job_id))
        return [] if kv is None else list(read_record(kv.value).events)

    def _counted(self, staged: Iterable[_Staged]) -> None:
        """Count jobs just written in their new states, and out of their old ones."""
        if self._by_state is not None:
            for stage in staged:
                if stage.before is not None:
                    self._by_state[stage.before.state] -= 1
                self._by_state[stage.job.state] += 1

    async def count_by_state(self) -> dict[str, int]:
        """Stored jobs per state (states with none left out): kept since ``load``, else
        counted from the state index; never by reading records."""
        counts = self._by_state
        if counts is None:
            counts = Counter()
            for state in jobs_pb2.JobState.values():
                name = jobs_pb2.JobState.Name(state)
                counts[state] = await self._store.count(job_index.prefix(job_index.STATE, name))
        return {jobs_pb2.JobState.Name(state): n for state, n in counts.items() if n}

    async def remove_finished(
        self,
        before_ns: int,
        archive: Callable[[list[records_pb2.JobRecord]], Awaitable[None]] | None = None,
    ) -> int:
        """Delete the jobs that finished before ``before_ns`` (epoch nanoseconds), record and
        index entries, a bounded batch per commit, the oldest first; returns how many.

        ``archive`` gets each batch's records before the commit that deletes them (and must
        have them safely written when it returns). Each delete expects the record's revision
        as read, so a job written meanwhile stays (a later pass looks again), and a job not
        finished by its record is never removed, nor one with no time at all (``finished_ns``
        0: written so by hand, or by a release before the times): its age is unknown.
        """
        removed = 0
        bound = job_index.finished_key(before_ns, "")
        while True:
            entries = await self._store.range(
                job_index.FINISHED, start_after=job_index.UNKNOWN_TIME, limit=SCAN_BATCH
            )
            entries = [kv for kv in entries if kv.key < bound]
            if not entries:
                return removed
            batch: list[tuple[jobs_pb2.Job, records_pb2.JobRecord, list[Op]]] = []
            stale: list[Op] = []
            size = 0
            for entry in entries:
                job_id = entry.key.rsplit("/", 1)[1]
                kv = await self._store.get(job_key(job_id))
                record = read_record(kv.value) if kv is not None else None
                if kv is None or record is None or not job_state.is_terminal(record.job.state):
                    stale.append(Delete(entry.key))  # an entry its record no longer backs
                    continue
                ops: list[Op] = [Delete(kv.key, expect_revision=kv.mod_revision)]
                ops += job_index.ops(record.job, None)
                if batch and size + len(ops) > MAX_OPS_PER_COMMIT:
                    break
                batch.append((record.job, record, ops))
                size += len(ops)
            if stale:
                await self._store.commit(stale)
            if not batch:
                continue
            if archive is not None:
                await archive([record for _, record, _ in batch])
            try:
                await self._store.commit([op for _, _, ops in batch for op in ops])
            except CasConflictError as err:
                log.info("job_removal_deferred", job=err.key.removeprefix(JOBS))
                return removed  # written meanwhile: the next pass reads it afresh
            for job, _, _ in batch:
                self._finished.pop(job.id, None)
                self._locks.pop(job.id, None)
                if self._by_state is not None:
                    self._by_state[job.state] -= 1
            removed += len(batch)
            JOBS_REMOVED.labels(str(archive is not None).lower()).inc(len(batch))


MAX_OPS_PER_COMMIT = 100
"""etcd refuses a transaction of more than --max-txn-ops (128 by default) operations, and a
coordinator's fenced store adds one; larger batches of updates go in several commits."""
MAX_BYTES_PER_COMMIT = 1 << 20
"""etcd refuses a request over --max-request-bytes (1.5 MiB by default)."""


_Cached: TypeAlias = tuple[jobs_pb2.Job, int, list[bytes], frozenset[str]]
"""An unfinished job as written, its store revision, its events as encoded for a record, and
its index entries (``job_index.keys``): what the next write of it compares with."""


@dataclass(slots=True)
class _Staged:
    """A mutated job ready to write: its put (the record, at the revision it must still
    have), the new events to publish once written, every event it keeps, encoded, and its
    state before."""

    job: jobs_pb2.Job
    put: Put
    events: list[jobs_pb2.JobEvent]
    encoded: list[bytes]
    before: jobs_pb2.Job | None
    """The job as stored before (None: a new job)."""
    index_ops: list[Op]
    """The index entries that change with it (``job_index.ops``)."""
    index_keys: frozenset[str]
    """Its index entries once written (``job_index.keys``)."""

    def ops(self) -> list[Op]:
        return [self.put, *self.index_ops]


_Joining: TypeAlias = tuple[_Staged, "asyncio.Future[None]"]
"""A new job waiting for a group commit, and its caller's future."""


def _new_stage(job: jobs_pb2.Job) -> _Staged:
    """A new job ready to write, with its first event (it must not exist yet)."""
    events = [new_event(job, 1, Change("", job_state.PENDING, "submitted"))]
    job.last_event_sequence = 1
    encoded = encoded_events(events)
    put = Put(job_key(job.id), record_value(job, encoded), expect_revision=0)
    index_keys = job_index.keys(job)
    return _Staged(
        job, put, events, encoded, None, job_index.changes(frozenset(), index_keys), index_keys
    )


def _group(joining: list[_Joining]) -> tuple[list[_Joining], list[_Joining]]:
    """The next group commit's jobs, in arrival order, and those left for the ones after:
    within what one commit may hold (``_chunks``' bounds; a larger job goes alone), and an id
    at most once (a store refuses a key twice in one commit; the second caller finds the
    first's job once it is written, as it would one by one)."""
    unique: list[_Staged] = []
    ids: set[str] = set()
    for stage, _ in joining:
        if stage.job.id in ids:
            break
        ids.add(stage.job.id)
        unique.append(stage)
    taken = len(_chunks(unique)[0]) if unique else 0
    return joining[:taken], joining[taken:]


def _fail(group: Iterable[_Joining], err: BaseException) -> None:
    """Tell each caller still waiting in ``group`` that its job was not written."""
    for _, future in group:
        if not future.done():
            future.set_exception(err)


def _exists(job_id: str, field: str) -> InvalidArgumentError:
    return InvalidArgumentError([FieldViolation(field, f"a job with id {job_id!r} already exists")])


def _chunks(staged: list[_Staged]) -> list[list[_Staged]]:
    """Jobs grouped so that no commit exceeds MAX_OPS_PER_COMMIT operations (a job's put and
    its index entries) or about MAX_BYTES_PER_COMMIT bytes (one larger job goes alone)."""
    chunks: list[list[_Staged]] = []
    size = ops = 0
    for stage in staged:
        stage_size = len(stage.put.key) + len(stage.put.value)
        stage_ops = 1 + len(stage.index_ops)
        if (
            not chunks
            or ops + stage_ops > MAX_OPS_PER_COMMIT
            or size + stage_size > MAX_BYTES_PER_COMMIT
        ):
            chunks.append([])
            size = ops = 0
        chunks[-1].append(stage)
        size += stage_size
        ops += stage_ops
    return chunks


def _failed(job_id: str, err: Exception) -> FederationError:
    """A job's failed write as a per-job result."""
    if isinstance(err, FederationError):
        return err
    return UnavailableError(f"job {job_id} was not written: {err}")


def _compose(mutations: list[Mutation]) -> Mutation:
    if len(mutations) == 1:
        return mutations[0]

    def mutate(job: jobs_pb2.Job) -> list[Change]:
        return [change for step in mutations for change in step(job)]

    return mutate


def _copy(job: jobs_pb2.Job) -> jobs_pb2.Job:
    out = jobs_pb2.Job()
    out.CopyFrom(job)
    return out


FINISHED_KEPT = 1024
"""How many of the jobs that finished last are kept in memory, for GetJob."""
