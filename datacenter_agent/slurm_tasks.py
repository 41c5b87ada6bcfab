"""Following one committed task's Slurm job to its end.

Each reading of ``scontrol show job`` moves a task from DELEGATED (pending in Slurm) to RUNNING
(with the devices Slurm gave it) to a final state with its exit code and the tail of its
output file. A job Slurm no longer lists is looked up in ``sacct``; without accounting, it ends
FAILED with Slurm's own words for why it cannot be found.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from datacenter_agent.slurm_cli import Record, SlurmCli, SlurmError, expand_hostlist
from datacenter_agent.slurm_job import Outcome, State, TaskKey, job_devices, job_outcome
from federation.agent.core import task_report
from federation.agent.packing import Slot
from federation.api.v1 import jobs_pb2, site_link_service_pb2

log = structlog.get_logger()

OUTPUT_TAIL_CHARS = 2000
_READ_BYTES = 8 * OUTPUT_TAIL_CHARS


@dataclass(slots=True, eq=False)
class SlurmTask:
    """A committed task: its Slurm job and, once it has ended, its outcome."""

    key: TaskKey
    slurm_id: str
    reservation_id: str
    slots: tuple[Slot, ...]
    """Capacity the view counts while Slurm has not started the job."""
    state: State = jobs_pb2.JOB_STATE_DELEGATED
    exit_code: int = 0
    reason: str = ""
    output_tail: str = ""
    devices: list[str] = field(default_factory=list)
    nodes: list[str] = field(default_factory=list)
    """The nodes of the job's allocation, once it runs."""
    cancel_reason: str | None = None
    cancel_sent: bool = False
    """Whether ``scancel`` reached Slurm (if not, the next good reading sends it again)."""
    stopping: bool = False
    created: float = field(default_factory=time.monotonic)
    finished: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def is_active(self) -> bool:
        """Whether the task has not ended."""
        return not self.finished.is_set()

    def report(self) -> site_link_service_pb2.TaskReport:
        """The task's state as the coordinator hears it."""
        return task_report(
            self.key,
            self.state,
            exit_code=self.exit_code,
            output_tail=self.output_tail,
            reason=self.reason,
            devices=self.devices,
            nodes=self.nodes,
        )


Report = Callable[[SlurmTask], None]


async def follow(
    task: SlurmTask, record: Record | None, report: Report, *, cli: SlurmCli | None = None
) -> None:
    """Applies one reading of the task's job; ``record`` None means Slurm no longer lists it."""
    if not task.is_active:
        return
    if record is None:
        outcome, output = await _vanished(task, cli), ""
    else:
        outcome, output = job_outcome(record), record.value("StdOut")
    if outcome.state == jobs_pb2.JOB_STATE_RUNNING and task.state != jobs_pb2.JOB_STATE_RUNNING:
        task.state = jobs_pb2.JOB_STATE_RUNNING
        task.devices = job_devices(record) if record is not None else []
        task.nodes = expand_hostlist(record.value("NodeList")) if record is not None else []
        job_id, name, epoch = task.key
        log.info(
            "task_started",
            job_id=job_id,
            task=name,
            epoch=epoch,
            slurm_job=task.slurm_id,
            devices=task.devices,
        )
        report(task)
    elif outcome.is_final:
        tail = await asyncio.to_thread(read_tail, Path(output)) if output else ""
        finish(task, outcome, tail, report)


def finish(task: SlurmTask, outcome: Outcome, output_tail: str, report: Report) -> None:
    """Ends the task: CANCELLED with our reason when we stopped it, else as Slurm says."""
    if task.cancel_reason is not None:
        outcome = Outcome(jobs_pb2.JOB_STATE_CANCELLED, outcome.exit_code, task.cancel_reason)
    task.state, task.exit_code, task.reason = outcome.state, outcome.exit_code, outcome.reason
    task.output_tail = output_tail[-OUTPUT_TAIL_CHARS:]
    task.finished.set()
    job_id, name, epoch = task.key
    log.info(
        "task_finished",
        job_id=job_id,
        task=name,
        epoch=epoch,
        slurm_job=task.slurm_id,
        state=jobs_pb2.JobState.Name(outcome.state),
        exit_code=outcome.exit_code,
        reason=outcome.reason,
    )
    report(task)


async def _vanished(task: SlurmTask, cli: SlurmCli | None) -> Outcome:
    """What accounting says of a job ``scontrol`` no longer lists (after ``MinJobAge``)."""
    why = "no accounting to ask"
    if cli is not None:
        try:
            out = await cli.run(
                "sacct", "-j", task.slurm_id, "-X", "-n", "-P", "-o", "JobID,State,ExitCode"
            )
        except SlurmError as err:
            why = err.message
        else:
            for line in out.stdout.splitlines():
                job_id, _, rest = line.partition("|")
                state, _, code = rest.partition("|")
                if job_id.strip() == task.slurm_id:
                    pairs = (("JobId", job_id), ("JobState", state), ("ExitCode", code))
                    outcome = job_outcome(Record(pairs))
                    if outcome.is_final:
                        return outcome
            why = f"sacct does not list job {task.slurm_id} as ended"
    reason = f"Slurm no longer lists job {task.slurm_id} ({why})"
    return Outcome(jobs_pb2.JOB_STATE_FAILED, 0, reason)


def read_tail(path: Path) -> str:
    """The end of a job's output file; "" when it cannot be read (e.g. on another host)."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - _READ_BYTES))
            data = f.read()
    except OSError as err:
        log.warning("output_unreadable", path=str(path), error=err.strerror)
        return ""
    return data.decode("utf-8", errors="replace")[-OUTPUT_TAIL_CHARS:]
