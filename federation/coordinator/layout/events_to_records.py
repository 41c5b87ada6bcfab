"""Layout 1 to 2: each job stored alone with its events under ``/events/``, into one
``JobRecord`` per job holding the job and its newest events.

Jobs are rewritten in key order, a bounded batch per commit with the last job id as the
progress mark; then the old event keys are deleted, a bounded batch per commit (a rerun
deletes what is left). A job's record keeps its newest ``MAX_EVENTS_KEPT`` events, as the
repository does.
"""

from __future__ import annotations

import structlog

from federation.api.v1 import jobs_pb2
from federation.coordinator.jobs.records import (
    JOBS,
    MAX_EVENTS_KEPT,
    OLD_EVENTS,
    encoded_events,
    record_value,
)
from federation.coordinator.layout import MAX_BYTES, MAX_OPS, Progress
from federation.store import Delete, Op, Put, Store

log = structlog.get_logger()


async def run(store: Store, progress: Progress) -> None:
    """Rewrite every job after ``progress.cursor`` as a record, then drop the event keys."""
    after = progress.cursor
    rewritten = 0
    while True:
        page = await store.range(JOBS, start_after=after, limit=MAX_OPS)
        if not page:
            break
        ops: list[Op] = []
        size = 0
        for kv in page:
            job = jobs_pb2.Job.FromString(kv.value)
            events = [
                jobs_pb2.JobEvent.FromString(e.value)
                for e in await store.range(f"{OLD_EVENTS}{job.id}/")
            ]
            value = record_value(job, encoded_events(events[-MAX_EVENTS_KEPT:]))
            if ops and size + len(value) > MAX_BYTES:
                break
            ops.append(Put(kv.key, value, expect_revision=kv.mod_revision))
            size += len(value)
            after = kv.key
        await store.commit([*ops, progress.put(after)])
        rewritten += len(ops)
    deleted = 0
    while keys := await store.range(OLD_EVENTS, limit=MAX_OPS):
        await store.commit([Delete(kv.key) for kv in keys])
        deleted += len(keys)
    log.info("jobs_rewritten_as_records", jobs=rewritten, event_keys_deleted=deleted)
