"""Listing stored jobs a page at a time: the caller's filter, and the page that stops before a
reply grows too big for gRPC."""

from __future__ import annotations

from collections.abc import (
    Callable,
    Collection,
)
from dataclasses import dataclass

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from federation.api.v1 import jobs_pb2
from federation.coordinator.jobs import index as job_index

MAX_REPLY_BYTES = 3 << 20
"""Most a page of jobs may take: gRPC clients refuse a reply over 4 MiB by default."""


MAX_SCANNED = 10_000
"""Most stored jobs one ListJobs call reads, matching or not."""


SCAN_BATCH = 100
"""Jobs read from the store at a time."""


@dataclass(slots=True)
class Page:
    """A ``ListJobs`` reply being filled: jobs are decoded straight into its repeated field."""

    into: RepeatedCompositeFieldContainer[jobs_pb2.Job]
    accepts: Callable[[jobs_pb2.Job], bool]
    page_size: int
    max_bytes: int
    size: int = 0
    taken: int = 0

    def offer(self, encoded: bytes) -> str | None:
        """Add the job if it is accepted; when the page is full, leave it out and return the
        next page's token (the id of the last job in)."""
        job = self.into.add()
        job.ParseFromString(encoded)
        if not self.accepts(job):
            del self.into[-1]
            return None
        self.size += len(encoded) + 8  # its size plus a few bytes of framing in the reply
        if self.taken == self.page_size or (self.taken and self.size > self.max_bytes):
            del self.into[-1]
            return self.into[-1].id
        self.taken += 1
        return None


@dataclass(frozen=True, slots=True)
class ListFilter:
    """What a listing is narrowed to: the jobs in every one of ``sets``, each set the union
    of some index prefixes (``job_index.prefix``); no sets: every job."""

    sets: tuple[tuple[str, ...], ...] = ()

    @classmethod
    def of(
        cls,
        states: Collection[jobs_pb2.JobState.ValueType] = (),
        tenant: str = "",
        site: str = "",
        queue: str = "",
    ) -> ListFilter:
        """Jobs in one of ``states`` (none: any) and of the tenant, site and queue given."""
        sets = []
        if states:
            names = sorted(jobs_pb2.JobState.Name(s) for s in set(states))
            sets.append(tuple(job_index.prefix(job_index.STATE, name) for name in names))
        for kind, value in (
            (job_index.TENANT, tenant),
            (job_index.SITE, site),
            (job_index.QUEUE, queue),
        ):
            if value:
                sets.append((job_index.prefix(kind, value),))
        return cls(tuple(sets))
