"""Layout 2 to 3: every stored job gets its index entries (``federation.coordinator.jobs.index``).

Jobs are read in key order, a bounded batch per commit with the last job id as the progress
mark; a rerun writes again what an interrupted one wrote (empty values, the same keys).
"""

from __future__ import annotations

import structlog

from federation.coordinator.jobs import index as job_index
from federation.coordinator.jobs.records import JOBS, read_record
from federation.coordinator.layout import MAX_OPS, Progress
from federation.store import Op, Store

log = structlog.get_logger()


async def run(store: Store, progress: Progress) -> None:
    """Write the index entries of every job after ``progress.cursor``."""
    after = progress.cursor
    indexed = 0
    while page := await store.range(JOBS, start_after=after, limit=MAX_OPS // 4):
        ops: list[Op] = []
        for kv in page:
            entries = job_index.ops(None, read_record(kv.value).job)
            if ops and len(ops) + len(entries) > MAX_OPS:
                break
            ops += entries
            after = kv.key
            indexed += 1
        await store.commit([*ops, progress.put(after)])
    log.info("jobs_indexed", jobs=indexed)
