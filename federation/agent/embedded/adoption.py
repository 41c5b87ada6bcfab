"""Adoption after an agent restart: the tasks the agent before this one recorded in
state_dir, taken over with their epochs when it left them on purpose, stopped and forgotten
when it crashed (unless they had all ended by themselves)."""

from __future__ import annotations

import asyncio

import structlog

from federation.agent.containers import Containers, container_name
from federation.agent.embedded.folders import TaskFolders
from federation.agent.embedded.launching import ReplicaLauncher
from federation.agent.embedded.task import Task, ended_by_themselves
from federation.agent.embedded.task_book import TaskBook
from federation.agent.embedded.task_files import TaskFiles
from federation.agent.embedded.task_runs import TaskRuns
from federation.agent.process import ReplicaProcess
from federation.agent.service import ReplicaService, free_port, is_service
from federation.agent.supervisor import LEAVING
from federation.agent.task_records import TaskRecord, TaskRecords
from federation.api.v1 import jobs_pb2

log = structlog.get_logger()


class Adoption:
    """Takes over the tasks recorded by the agent before this one.

    Args:
        records: The tasks recorded in state_dir.
        book: Where adopted tasks go.
        launcher: Binds a container replica's clean-up to its process.
        files: Watches an adopted task's checkpoints again.
        runs: Supervises an adopted task to its end.
        folders: Where each task ran.
        containers: Removes the container of a replica that ended meanwhile.
        kill_grace_s: Time between SIGTERM and SIGKILL when an adopted task is stopped.
        site: Site name, in a service's endpoints.
        address: Where clients reach a service's replicas.
    """

    def __init__(
        self,
        records: TaskRecords,
        book: TaskBook,
        launcher: ReplicaLauncher,
        files: TaskFiles,
        runs: TaskRuns,
        *,
        folders: TaskFolders,
        containers: Containers,
        kill_grace_s: float,
        site: str,
        address: str,
    ) -> None:
        self._records = records
        self._book = book
        self._tasks = book.tasks
        self._launcher = launcher
        self._files = files
        self._runs = runs
        self._folders = folders
        self._containers = containers
        self._kill_grace_s = kill_grace_s
        self._site = site
        self._address = address

    async def adopt(self) -> None:
        """Takes over the tasks recorded in state_dir by the agent before this one.

        Tasks it left on purpose (its core closed) are adopted with their epochs: a replica
        whose supervisor still runs (the same pid and start time) is watched again, one that
        ended meanwhile reports how; a task that had ended keeps its final report. Tasks of an
        agent that crashed are stopped, if any process is left, and forgotten: the coordinator
        places them again, as it does for every task a site no longer reports; but one whose
        replicas had all ended by themselves is reported as they ended.
        """
        previous = self._records.claim()
        handed_over = previous is not None and previous[2] == LEAVING
        for record in self._records.load():
            if record.final is not None:
                self._adopt_final(record)
                continue
            replicas = [
                ReplicaProcess.adopt(r.pid, r.start_ticks, self._folders.run_dir(record.key, i))
                for i, r in enumerate(record.replicas)
            ]
            for i, replica in enumerate(replicas):
                self._launcher.bind_container(record.key, record.spec, i, replica)
                if replica.exited and record.spec.image:
                    # Ended meanwhile: its supervisor may have had to leave the container.
                    await self._containers.remove(
                        container_name(self._folders.work_dir, record.key, i)
                    )
            ended_alone = ended_by_themselves(replicas)
            died = any(p.ended and p.ended.why == "agent_died" for p in replicas)
            # A task whose every replica had ended by itself is reported as it ended, crash or
            # not: its end was only not reported yet, and placed again it would run twice.
            if not ended_alone and (not handed_over or died):
                for replica in replicas:
                    replica.kill()
                await asyncio.gather(*(replica.wait() for replica in replicas))
                if ended_by_themselves(replicas):
                    # Each ended by itself while being stopped (its supervisor says it was not
                    # stopped): the work is done, and placed again it would run twice.
                    self._adopt_running(record, replicas)
                    continue
                self._records.drop(record.reservation_id)
                job_id, name, epoch = record.key
                log.warning("task_not_adopted", job_id=job_id, task=name, epoch=epoch)
                continue
            for replica in replicas:
                replica.claim()
            self._adopt_running(record, replicas)

    def _adopted(self, record: TaskRecord) -> Task:
        task = Task(
            record.key,
            record.reservation_id,
            record.spec,
            record.slots,
            record.devices,
            self._kill_grace_s,
        )
        task.tenant, task.restore, task.started_at = (
            record.tenant,
            record.restore,
            record.started_at,
        )
        task.site, task.address, task.revision = self._site, self._address, record.revision
        if is_service(record.spec):
            kept = record.service or tuple((free_port(), 0, 0) for _ in record.slots)
            task.service = [
                ReplicaService(port, restarts, revision=revision)
                for port, restarts, revision in kept
            ]
        self._tasks[record.key] = task
        return task

    def _adopt_final(self, record: TaskRecord) -> None:
        """A task that ended before the restart: its final report, until acknowledged."""
        assert record.final is not None
        task = self._adopted(record)
        task.final, task.state = record.final, record.final.state
        task.finished.set()

    def _adopt_running(self, record: TaskRecord, replicas: list[ReplicaProcess]) -> None:
        task = self._adopted(record)
        task.replicas, task.state = replicas, jobs_pb2.JOB_STATE_RUNNING
        if record.spec.HasField("checkpoint"):
            checkpoints = self._files.watch_checkpoints(task, record.restore)
            checkpoints.start(record.started_at)
        job_id, name, epoch = record.key
        log.info(
            "task_adopted",
            job_id=job_id,
            task=name,
            epoch=epoch,
            supervisors=[p.pid for p in replicas],
            ended=[p.exited for p in replicas],
        )
        task.supervisor = asyncio.create_task(self._runs.supervise(task))
