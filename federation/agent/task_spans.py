"""The site's spans of a job's path (see ``federation.tracing``): ``task.run`` from the
task's start to its end, and ``task.report`` from its final report to the coordinator's ack.

Both cores report through the session layer, which feeds this: a Slurm site's tasks are
traced as the embedded core's are. Only used while tracing is on.
"""

from __future__ import annotations

from federation import tracing
from federation.api.v1 import jobs_pb2
from federation.api.v1 import site_link_service_pb2 as pb
from federation.common.job_state import is_terminal
from federation.common.keys import RunKey

"""(job id, task, epoch): one delegation of a task."""


class TaskSpans:
    def __init__(self, site: str) -> None:
        self._site = site
        self._committed: dict[RunKey, int] = {}
        """When each commit arrived: a task's run starts there if no RUNNING report came."""
        self._running: dict[RunKey, int] = {}
        """When each task was reported RUNNING."""
        self._reported: dict[RunKey, int] = {}
        """When each final report was first sent, until its ack."""

    def committed(self, commit: pb.Commit) -> None:
        self._committed[(commit.job_id, commit.task, commit.epoch)] = tracing.now_ns()

    def not_started(self, commit: pb.Commit) -> None:
        """The core refused the commit: no run follows."""
        self._committed.pop((commit.job_id, commit.task, commit.epoch), None)

    def status(self, report: pb.TaskReport) -> None:
        """A report leaves: RUNNING starts the run, a final state ends it (once)."""
        key = (report.job_id, report.task, report.epoch)
        now = tracing.now_ns()
        if not is_terminal(report.state):
            self._running.setdefault(key, now)
            return
        if key in self._reported:
            return  # sent again (a new session): the run ended already
        committed = self._committed.pop(key, now)
        started = self._running.pop(key, committed)  # adopted after a restart: unknown
        self._reported[key] = now
        state = jobs_pb2.JobState.Name(report.state)
        attributes: dict[str, tracing.Value] = {
            "federation.state": state,
            "federation.exit_code": report.exit_code,
            "federation.devices": list(report.devices),
            "federation.nodes": list(report.nodes),
        }
        if report.reason:
            attributes["federation.reason"] = report.reason
        if report.interrupted:
            attributes["federation.interrupted"] = True
        failed = report.state != jobs_pb2.JOB_STATE_SUCCEEDED
        tracing.record(
            "task.run",
            report.job_id,
            started,
            now,
            task=report.task,
            site=self._site,
            epoch=report.epoch,
            error=(report.reason or state) if failed else "",
            attributes=attributes,
        )

    def acked(self, ack: pb.TaskStatusAck) -> None:
        """The coordinator recorded a final report: ``task.report`` ends."""
        key = (ack.job_id, ack.task, ack.epoch)
        self._committed.pop(key, None)
        self._running.pop(key, None)
        sent = self._reported.pop(key, None)
        if sent is None:
            return  # reported by the agent before this one
        tracing.record(
            "task.report", ack.job_id, sent, task=ack.task, site=self._site, epoch=ack.epoch
        )
