"""The embedded core's book of tasks: every task not yet forgotten, each recorded in
state_dir for a later agent (``federation.agent.task_records``) and reported as it moves."""

from __future__ import annotations

import structlog

from federation.agent.embedded.folders import TaskFolders
from federation.agent.embedded.task import State, Task
from federation.agent.reports import Reports
from federation.agent.task_records import ReplicaRecord, TaskRecord, TaskRecords
from federation.api.v1 import jobs_pb2
from federation.common.keys import RunKey

log = structlog.get_logger()

OUTPUT_TAIL_CHARS = 2000


class TaskBook:
    """The core's tasks by key, their records and their reports.

    Args:
        records: Where tasks are recorded for a restarted agent; None: they are not.
        reports: Sends each task's report and each change of the view.
        folders: The tasks' folders, locked as each task ends.
    """

    def __init__(self, records: TaskRecords | None, reports: Reports, folders: TaskFolders) -> None:
        self.tasks: dict[RunKey, Task] = {}
        self.records = records
        self._reports = reports
        self._folders = folders

    def finish(
        self, task: Task, state: State, exit_code: int, reason: str, output_tail: str
    ) -> None:
        """Ends the task: its final report recorded, its folder locked, then reported."""
        task.state, task.exit_code, task.reason = state, exit_code, reason
        task.output_tail = output_tail[-OUTPUT_TAIL_CHARS:]
        if task.checkpoints is not None:
            task.checkpoints.stop()
        if task.uploads is not None:
            task.uploads.cancel()
        task.final = task.report()
        self.save(task)  # before it is reported: a restarted agent reports it again
        self._folders.lock(task.key)
        task.finished.set()
        log.info(
            "task_finished",
            job_id=task.key[0],
            task=task.key[1],
            epoch=task.key[2],
            state=jobs_pb2.JobState.Name(state),
            exit_code=exit_code,
            reason=reason,
        )
        self.report(task)
        self.changed()

    def report(self, task: Task) -> None:
        """Sends the task's report as it stands (its state, endpoints, checkpoint)."""
        task.moved.set()
        self._reports.status(task.report())

    def changed(self) -> None:
        """Tells the agent that allocations or the queue changed."""
        self._reports.changed()

    def save(self, task: Task) -> None:
        """Records the task for a later agent; a failure costs its adoption, not the task."""
        if self.records is None:
            return
        record = TaskRecord(
            task.key,
            task.reservation_id,
            task.spec,
            task.slots,
            task.devices,
            task.tenant,
            task.started_at,
            task.restore,
            tuple(ReplicaRecord(p.pid, p.start_ticks) for p in task.replicas),
            task.final,
            tuple((r.port, r.restarts, r.revision) for r in task.service or ()),
            task.revision,
        )
        try:
            self.records.save(record)
        except OSError as exc:
            log.error("task_record_failed", job_id=task.key[0], task=task.key[1], error=str(exc))
