"""Retention: finished jobs and audit entries past their time leave the store.

The leader looks every ``SWEEP_INTERVAL_S``. A job that finished more than
``finished_job_retention_s`` ago is deleted with its index entries, in bounded commits
(``JobRepository.remove_finished``); with ``archive_dir`` set, each is first appended to that
day's archive, ``jobs-YYYY-MM-DD.jsonl`` (one ``JobRecord`` as JSON per line, the job and its
newest events), written and fsynced before the commit that deletes it. A removal retried after
a failed commit may archive a job twice; the later line is the same job. Audit entries older
than ``audit_retention_s`` go the same way, unarchived. A retention of 0 keeps for ever.

The deletes are history like any write: etcd's history is compacted as it goes
(``etcd_history_s``), and the embedded store keeps a bounded history of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import structlog
from google.protobuf import json_format

from federation.api.v1 import records_pb2
from federation.coordinator import audit
from federation.coordinator.jobs.redaction import has_env, has_pull_secrets, redact_all
from federation.coordinator.jobs.repository import JobRepository
from federation.durable import sync_dir
from federation.errors import FederationError
from federation.store import Store, StoreError

log = structlog.get_logger()

SWEEP_INTERVAL_S = 60.0
DAY_S = 86400.0


def archive_path(archive_dir: Path, when_s: float) -> Path:
    """The archive file of the (UTC) day of ``when_s``."""
    day = datetime.fromtimestamp(when_s, UTC).strftime("%Y-%m-%d")
    return archive_dir / f"jobs-{day}.jsonl"


def _archived(record: records_pb2.JobRecord) -> str:
    """One archive line: the record with its env values and registry passwords redacted (an
    archive outlives the job and is read by whoever keeps history, not by the job's tenant)."""
    if has_env(record.job) or has_pull_secrets(record.job):
        copy = records_pb2.JobRecord()
        copy.CopyFrom(record)
        redact_all(copy.job)
        record = copy
    return json.dumps(json_format.MessageToDict(record), separators=(",", ":")) + "\n"


def _append(path: Path, records: list[records_pb2.JobRecord]) -> None:
    lines = "".join(_archived(record) for record in records)
    new = not path.exists()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if new:
        path.parent.chmod(0o700)  # a folder made by hand keeps its mode otherwise
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a", encoding="utf-8") as out:
        out.write(lines)
        out.flush()
        os.fsync(out.fileno())
    if new:  # the file's name must survive a crash too
        sync_dir(path.parent)


def read_archive(path: Path) -> list[records_pb2.JobRecord]:
    """The records of one archive file, in the order they were removed."""
    with path.open(encoding="utf-8") as lines:
        return [json_format.ParseDict(json.loads(line), records_pb2.JobRecord()) for line in lines]


class Retention:
    """Removes finished jobs and audit entries past their retention (see the module).

    Args:
        jobs: The repository, whose writes keep the indexes and counts.
        store: Where the audit trail is (the term's fenced store).
        finished_job_retention_s: How long a finished job is kept; 0: for ever.
        audit_retention_s: How long an audit entry is kept; 0: for ever.
        archive_dir: Where removed jobs are archived; None: they are not.
        clock: Seconds since the epoch (tests move it).
    """

    def __init__(
        self,
        jobs: JobRepository,
        store: Store,
        *,
        finished_job_retention_s: float,
        audit_retention_s: float,
        archive_dir: Path | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._jobs = jobs
        self._store = store
        self._job_retention_s = finished_job_retention_s
        self._audit_retention_s = audit_retention_s
        self._archive_dir = archive_dir
        self._clock = clock

    async def _archive(self, records: list[records_pb2.JobRecord]) -> None:
        assert self._archive_dir is not None
        path = archive_path(self._archive_dir, self._clock())
        await asyncio.to_thread(_append, path, records)

    async def sweep(self) -> tuple[int, int]:
        """Remove what is past its time now; returns (jobs, audit entries) removed."""
        now = self._clock()
        jobs = entries = 0
        if self._job_retention_s > 0:
            archive = self._archive if self._archive_dir is not None else None
            before_ns = int((now - self._job_retention_s) * 1e9)
            jobs = await self._jobs.remove_finished(before_ns, archive)
        if self._audit_retention_s > 0:
            entries = await audit.remove_older(
                self._store, int((now - self._audit_retention_s) * 1e9)
            )
        if jobs or entries:
            log.info(
                "retention_removed",
                jobs=jobs,
                audit_entries=entries,
                archived_to=str(self._archive_dir) if jobs and self._archive_dir else None,
            )
        return jobs, entries

    async def run(self, interval_s: float = SWEEP_INTERVAL_S) -> None:
        """Sweep every ``interval_s`` until cancelled; a failed sweep is retried next time."""
        while True:
            try:
                await self.sweep()
            except (StoreError, OSError, FederationError) as err:
                log.warning("retention_sweep_failed", error=str(err))
            await asyncio.sleep(interval_s)
