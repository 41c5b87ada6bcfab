"""Secondary indexes of the stored jobs: which jobs are in a state, of a tenant, at a site,
in a queue, and when each finished, without decoding a record.

Each index entry is an empty value under ``/index/KIND/VALUE/JOB_ID`` (the value quoted, so
no value nests inside another), written in the same commit as the job record whose fields it
mirrors: the record's compare-and-swap guards both, so an entry exists exactly while the stored
record says so. Finished jobs also stand under ``/index/finished/NANOSECONDS/JOB_ID``, oldest
first, for retention. Within one value, entries sort by job id, as records do under ``/jobs/``,
so a listing walks an index in the order it would walk the records; several filters intersect
by leapfrogging their indexes, reading only entries and the matching records.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from urllib.parse import quote

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.store import Delete, Op, Put, Store

INDEX = "/index/"
STATE, TENANT, SITE, QUEUE = "state", "tenant", "site", "queue"
FINISHED = f"{INDEX}finished/"
"""Finished jobs by when they finished (``finished_ns``): what retention walks."""
STATE_NAMES = tuple(jobs_pb2.JobState.keys())
UNKNOWN_TIME = f"{FINISHED}{0:020d}0"
"""Above every entry of a job that finished at time 0 (none known), below every other."""


@functools.lru_cache(maxsize=4096)
def prefix(kind: str, value: str) -> str:
    """Where the entries of jobs whose ``kind`` is ``value`` stand (kept: every write of a
    job asks for its prefixes, of a few states, tenants, queues and sites, and quoting is
    not free)."""
    return f"{INDEX}{kind}/{quote(value, safe='')}/"


def finished_ns(job: jobs_pb2.Job) -> int:
    """When a finished job finished: its last task's finish, else its last write."""
    finished = max((t.finished_at.ToNanoseconds() for t in job.tasks), default=0)
    return finished or job.updated_at.ToNanoseconds()


def finished_key(when_ns: int, job_id: str) -> str:
    return f"{FINISHED}{when_ns:020d}/{job_id}"


_STATE_PREFIXES = {state: prefix(STATE, name) for name, state in jobs_pb2.JobState.items()}


def keys(job: jobs_pb2.Job) -> frozenset[str]:
    """Every index entry of ``job`` as stored."""
    out = {_STATE_PREFIXES[job.state] + job.id}
    if job.spec.tenant:
        out.add(prefix(TENANT, job.spec.tenant) + job.id)
    if job.spec.queue:
        out.add(prefix(QUEUE, job.spec.queue) + job.id)
    out.update(prefix(SITE, task.site) + job.id for task in job.tasks if task.site)
    if job_state.is_terminal(job.state):
        out.add(finished_key(finished_ns(job), job.id))
    return frozenset(out)


def ops(before: jobs_pb2.Job | None, after: jobs_pb2.Job | None) -> list[Op]:
    """The index writes that go with storing ``after`` over ``before`` (None: no record)."""
    old = keys(before) if before is not None else frozenset()
    new = keys(after) if after is not None else frozenset()
    return changes(old, new)


def changes(old: AbstractSet[str], new: AbstractSet[str]) -> list[Op]:
    """The index writes from entries ``old`` to entries ``new`` (``keys`` of each)."""
    if old == new:
        return []
    return [
        *(Delete(key) for key in sorted(old - new)),
        *(Put(key, b"") for key in sorted(new - old)),
    ]


def _below(job_id: str) -> str:
    """A string just below ``job_id``: nothing but ``job_id`` itself and a few strings below it
    lie between the two, so a range after it starts at ``job_id``."""
    last = ord(job_id[-1])
    if last == 0:
        return job_id[:-1]
    return job_id[:-1] + chr(last - 1 if last != 0xE000 else 0xD7FF)


@dataclass(slots=True)
class _Entries:
    """The job ids under one index prefix, read in batches as a seek passes them."""

    store: Store
    prefix: str
    batch: int
    ids: list[str] = field(default_factory=list)
    at: int = 0
    ended: bool = False
    """No entry lies beyond the last id read."""
    read: int = 0

    async def seek(self, target: str) -> str | None:
        """The first id at or after ``target`` (seeks only move forward), None past the end."""
        while True:
            while self.at < len(self.ids) and self.ids[self.at] < target:
                self.at += 1
            if self.at < len(self.ids):
                return self.ids[self.at]
            if self.ended:
                return None
            after = self.prefix + _below(target) if target else ""
            if self.ids and self.prefix + self.ids[-1] > after:
                after = self.prefix + self.ids[-1]
            page = await self.store.range(self.prefix, start_after=after, limit=self.batch)
            self.read += len(page)
            self.ids = [kv.key[len(self.prefix) :] for kv in page]
            self.at = 0
            self.ended = len(page) < self.batch


class Filter:
    """The jobs in every one of several sets, each a union of index prefixes."""

    def __init__(self, store: Store, sets: Sequence[Iterable[str]], batch: int = 100) -> None:
        self._sets = [[_Entries(store, p, batch) for p in prefixes] for prefixes in sets]

    @property
    def read(self) -> int:
        """Index entries read so far."""
        return sum(entries.read for union in self._sets for entries in union)

    async def _seek(self, union: list[_Entries], target: str) -> str | None:
        found = [found for e in union if (found := await e.seek(target)) is not None]
        return min(found, default=None)

    async def next(self, after: str) -> str | None:
        """The first job id after ``after`` in every set (leapfrogging), None when none is."""
        target = after + "\0" if after else ""
        agreed = 0
        while agreed < len(self._sets):
            for union in self._sets:
                found = await self._seek(union, target)
                if found is None:
                    return None
                if found == target:
                    agreed += 1
                else:
                    target, agreed = found, 1
                if agreed == len(self._sets):
                    break
        return target

    def resume_token(self, target: str) -> str:
        """A token to go on from ``target``, which is not yet decided."""
        return _below(target) if target else ""
