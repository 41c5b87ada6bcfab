"""Following one committed task's Slurm job to its end.

Each reading of ``scontrol show job`` moves a task from DELEGATED (pending in Slurm) to RUNNING
(with the devices Slurm gave it) to a final state with its exit code and the tail of its
output file. A job Slurm no longer lists is looked up in ``sacct``; without accounting, it ends
FAILED with Slurm's own words for why it cannot be found.

A job Slurm requeues (preempted, or its node failed) goes back to DELEGATED and is followed on;
one that Slurm ended for such a reason instead (``PREEMPTED``, ``NODE_FAIL``) is requeued with
``scontrol requeue``. Either way the coordinator never hears that it ended, and the next run
restores from the newest checkpoint the last one completed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from datacenter_agent.slurm.checkpoints import save_restored
from datacenter_agent.slurm.cli import Record, SlurmCli, SlurmError, expand_hostlist, parse_time
from datacenter_agent.slurm.containers import CONTAINER_ENV, CONTAINER_FAILED, PULL_AUTH
from datacenter_agent.slurm.job import (
    Outcome,
    State,
    job_devices,
    job_outcome,
    slurm_state,
)
from federation.agent.checkpoints import TaskCheckpoints
from federation.agent.core import task_report
from federation.agent.packing import Slot
from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.common.keys import RunKey

log = structlog.get_logger()

OUTPUT_TAIL_CHARS = 2000
_READ_BYTES = 8 * OUTPUT_TAIL_CHARS


@dataclass(slots=True, eq=False)
class SlurmTask:
    """A committed task: its Slurm job and, once it has ended, its outcome."""

    key: RunKey
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
    checkpoints: TaskCheckpoints | None = None
    """Its checkpoint folder and watcher, when the task declares a checkpoint policy."""
    restore_file: Path | None = None
    """Where the batch script finds the checkpoint a requeued job restarts from."""
    restarts: int = 0
    """How many times Slurm had requeued the job when it was last seen starting."""
    stop_after_s: float = 0.0
    """Cut off from every coordinator this long, the site stops the task; 0: it does not.
    Not known for a job adopted after a restart (the offer is gone): that one runs on."""
    interrupted: bool = False
    """Stopped because the site was cut off (``SlurmCore.stop_cut_off``)."""
    folder: Path | None = None
    """The job's folder, where a container that could not start says why."""

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
            checkpoint=self.checkpoints.latest if self.checkpoints is not None else None,
            interrupted=self.interrupted and self.state == jobs_pb2.JOB_STATE_CANCELLED,
        )


Report = Callable[[SlurmTask], None]


async def follow(task: SlurmTask, record: Record | None, cli: SlurmCli, report: Report) -> None:
    """Applies one reading of the task's job; ``record`` None means Slurm no longer lists it."""
    if not task.is_active:
        return
    if record is None:
        outcome, output, started_at = await _vanished(task, cli), "", time.time()
    else:
        outcome, output = job_outcome(record), record.value("StdOut")
        started_at = _started_at(record)
        # Requeued: waiting again, or (read too rarely to see it wait) started again. While
        # its processes end on SIGTERM it shows COMPLETING, already counted: not yet.
        requeued = outcome.state == jobs_pb2.JOB_STATE_DELEGATED or (
            _restarts(record) > task.restarts and slurm_state(record) != "COMPLETING"
        )
        if task.state == jobs_pb2.JOB_STATE_RUNNING and requeued:
            await _before_restart(task, started_at)
            _back_in_queue(task, f"Slurm requeued job {task.slurm_id}", report)
    if outcome.state == jobs_pb2.JOB_STATE_RUNNING and task.state != jobs_pb2.JOB_STATE_RUNNING:
        assert record is not None  # a vanished job has ended
        _started(task, record, started_at, report)
    elif outcome.is_final:
        await _ended(task, outcome, output, cli, started_at, report)


def _started(task: SlurmTask, record: Record, started_at: float, report: Report) -> None:
    task.state = jobs_pb2.JOB_STATE_RUNNING
    task.devices = job_devices(record)
    task.nodes = expand_hostlist(record.value("NodeList"))
    task.restarts = _restarts(record)
    if task.checkpoints is not None:
        task.checkpoints.start(started_at)
    job_id, name, epoch = task.key
    log.info(
        "task_started",
        job_id=job_id,
        task=name,
        epoch=epoch,
        slurm_job=task.slurm_id,
        devices=task.devices,
        restarts=task.restarts,
    )
    report(task)


async def _ended(
    task: SlurmTask,
    outcome: Outcome,
    output: str,
    cli: SlurmCli,
    started_at: float,
    report: Report,
) -> None:
    """Ends the task, unless Slurm ended its job for reasons not the task's own: then the job
    is requeued (``scontrol requeue``), and only if Slurm refuses does the task end FAILED."""
    if outcome.interrupted and task.cancel_reason is None:
        await _before_restart(task, started_at)
        try:
            await cli.run("scontrol", "requeue", task.slurm_id)
        except SlurmError as err:
            why = f"{outcome.reason}; Slurm would not requeue it: {err.message}"
            outcome = dataclasses.replace(outcome, reason=why)
        else:
            _back_in_queue(task, f"{outcome.reason}; requeued", report)
            return
    if task.checkpoints is not None:
        await task.checkpoints.last_look(started_at)
    tail = await asyncio.to_thread(read_tail, Path(output)) if output else ""
    if task.folder is not None:
        why = await asyncio.to_thread(_container_ended, task.folder)
        if why and outcome.state == jobs_pb2.JOB_STATE_FAILED:
            outcome = dataclasses.replace(outcome, reason=why)
    finish(task, outcome, tail, report)


def _container_ended(folder: Path) -> str:
    """Why the job's container could not start ("" if it did, or the job runs no image);
    its environment and login files go, now that no run of the job needs them."""
    (folder / CONTAINER_ENV).unlink(missing_ok=True)
    (folder / PULL_AUTH).unlink(missing_ok=True)
    try:
        return (folder / CONTAINER_FAILED).read_text(errors="replace").strip()
    except OSError:
        return ""


async def _before_restart(task: SlurmTask, started_at: float) -> None:
    """The job will run again: report what its run checkpointed; the next run restores from
    the newest checkpoint (the batch script reads it from ``restore_file``)."""
    if task.checkpoints is None:
        return
    await task.checkpoints.last_look(started_at)
    task.checkpoints.restarted()
    latest = task.checkpoints.latest
    if latest is not None and task.restore_file is not None:
        await asyncio.to_thread(_replace_file, task.restore_file, latest.path)
        # for an agent that adopts the job later: the progress that checkpoint holds
        await asyncio.to_thread(save_restored, task.restore_file.parent, latest)


def _back_in_queue(task: SlurmTask, reason: str, report: Report) -> None:
    task.state, task.reason = jobs_pb2.JOB_STATE_DELEGATED, reason
    task.devices, task.nodes = [], []  # it holds none while it waits
    job_id, name, epoch = task.key
    log.info(
        "task_requeued", job_id=job_id, task=name, epoch=epoch, slurm_job=task.slurm_id, why=reason
    )
    report(task)


def _restarts(record: Record) -> int:
    """How many times Slurm has requeued the job."""
    value = record.value("Restarts")
    return int(value) if value.isdigit() else 0


def _started_at(record: Record | None) -> float:
    """When the job's run started (wall clock), as Slurm says; now if it does not say."""
    started = parse_time(record.value("StartTime")) if record is not None else None
    return started if started is not None else time.time()


def _replace_file(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` at once: a job starting meanwhile reads the old or the new."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


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


async def _vanished(task: SlurmTask, cli: SlurmCli) -> Outcome:
    """What accounting says of a job ``scontrol`` no longer lists (after ``MinJobAge``)."""
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
