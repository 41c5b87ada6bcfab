"""The agent's journal: final task statuses the coordinator has not acknowledged yet.

A site cut off from its coordinator keeps running its tasks and holds their statuses in
memory; the journal makes the final ones survive an agent restart too, so a task that finished
during a partition is reported on the next hello instead of being placed and run again.
Statuses of tasks that are still running are not kept here: the embedded core records its own
tasks to adopt them after a restart (``federation.agent.task_records``), and Slurm keeps its
jobs.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import structlog
from google.protobuf.message import DecodeError

from federation.api.v1 import site_link_service_pb2 as pb
from federation.common.job_state import is_terminal
from federation.common.keys import RunKey

log = structlog.get_logger()


class Journal:
    """Final task reports in a small SQLite file, until the coordinator acknowledges them."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Tiny and rare writes (one per finished task): done on the event loop's thread.
        self._conn = sqlite3.connect(path, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS reports (job_id TEXT, task TEXT, epoch INTEGER, "
            "report BLOB, PRIMARY KEY (job_id, task, epoch))"
        )

    def record(self, report: pb.TaskReport) -> None:
        """Keep ``report`` if it is final (written before it is sent)."""
        if not is_terminal(report.state):
            return
        self._conn.execute(
            "INSERT OR REPLACE INTO reports VALUES (?, ?, ?, ?)",
            (report.job_id, report.task, report.epoch, report.SerializeToString()),
        )

    def forget(self, job_id: str, task: str, epoch: int) -> None:
        """The coordinator recorded the final status: drop it."""
        self._conn.execute(
            "DELETE FROM reports WHERE job_id = ? AND task = ? AND epoch = ?",
            (job_id, task, epoch),
        )

    def pending(self) -> list[pb.TaskReport]:
        """Every kept report; a corrupted entry is logged and dropped, never replayed."""
        out: list[pb.TaskReport] = []
        rows = self._conn.execute("SELECT job_id, task, epoch, report FROM reports").fetchall()
        for job_id, task, epoch, blob in rows:
            try:
                report = pb.TaskReport.FromString(blob)
                if (report.job_id, report.task, report.epoch) != (job_id, task, epoch) or not (
                    is_terminal(report.state)
                ):
                    raise DecodeError("entry does not match its key")
            except (DecodeError, TypeError) as err:
                log.warning(
                    "journal_entry_dropped", job=job_id, task=task, epoch=epoch, error=str(err)
                )
                self.forget(job_id, task, epoch)
                continue
            out.append(report)
        return out

    def close(self) -> None:
        self._conn.close()


def merge(live: list[pb.TaskReport], journaled: list[pb.TaskReport]) -> list[pb.TaskReport]:
    """The core's reports, plus journaled ones for tasks the core no longer knows."""
    known: set[RunKey] = {(r.job_id, r.task, r.epoch) for r in live}
    return live + [r for r in journaled if (r.job_id, r.task, r.epoch) not in known]
