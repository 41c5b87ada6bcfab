"""A committed task's run, from the commit to its end: its nodes launched and its inputs
staged, its replicas started, then watched until the task ends (a batch task) or is
cancelled (a service, which ``service_changes`` supervises)."""

from __future__ import annotations

import asyncio
import time

import structlog

from federation.agent.commits import commit_key, settled, started
from federation.agent.elastic import Elastic, LaunchError
from federation.agent.embedded.folders import TaskFolders
from federation.agent.embedded.launching import ReplicaLauncher
from federation.agent.embedded.reservations import Reservations
from federation.agent.embedded.room import Room
from federation.agent.embedded.service_changes import ServiceChanges
from federation.agent.embedded.task import State, Task
from federation.agent.embedded.task_book import TaskBook
from federation.agent.embedded.task_files import TaskFiles
from federation.agent.object_store import DataError
from federation.agent.process import ReplicaStartError, describe_exit
from federation.agent.service import ReplicaService, is_service
from federation.agent.task_data import TaskData
from federation.api.v1 import jobs_pb2, site_link_service_pb2

log = structlog.get_logger()


class TaskRuns:
    """Starts committed tasks and sees each to its end.

    Args:
        reservations: The reservations a commit takes.
        book: The tasks; records, reports and ends each one.
        room: Names a task's devices and the nodes an elastic site has yet to launch.
        launcher: Starts the replicas.
        files: Stages inputs, and watches and settles checkpoints.
        services: Supervises service tasks.
        folders: Where each task runs.
        data: Stores a task's outputs as it ends.
        elastic: The site's launchable nodes, if it has any.
        kill_grace_s: Time between SIGTERM and SIGKILL when a task is stopped.
        site: Site name, in a service's endpoints.
        address: Where clients reach a service's replicas.
    """

    def __init__(
        self,
        reservations: Reservations,
        book: TaskBook,
        room: Room,
        launcher: ReplicaLauncher,
        files: TaskFiles,
        services: ServiceChanges,
        *,
        folders: TaskFolders,
        data: TaskData,
        elastic: Elastic | None,
        kill_grace_s: float,
        site: str,
        address: str,
    ) -> None:
        self._reservations = reservations
        self._book = book
        self._tasks = book.tasks
        self._room = room
        self._launcher = launcher
        self._files = files
        self._services = services
        self._folders = folders
        self._data = data
        self._elastic = elastic
        self._kill_grace_s = kill_grace_s
        self._site = site
        self._address = address

    async def commit(
        self, commit: site_link_service_pb2.Commit
    ) -> site_link_service_pb2.CommitAnswer:
        """Starts every replica of a reserved task.

        A replica that cannot be started (a missing program, say) does not refuse the commit:
        the task was taken, and it ends FAILED with the reason, reported through ``on_status``.
        """
        key = commit_key(commit)
        held = self._reservations.get(commit.reservation_id)
        reservation = settled(commit, self._tasks.get(key), held)
        if isinstance(reservation, site_link_service_pb2.CommitAnswer):
            return reservation
        self._reservations.drop(reservation.id)
        devices = self._room.device_labels(reservation.slots)
        task = Task(
            key, reservation.id, reservation.spec, reservation.slots, devices, self._kill_grace_s
        )
        task.tenant, task.restore = reservation.tenant, reservation.restore
        task.stop_after_s, task.revision = reservation.stop_after_s, reservation.revision
        task.site, task.address = self._site, self._address
        task.inputs = list(commit.inputs)
        task.gang_peers, task.gang_rank = list(commit.gang_peers), commit.gang_rank
        restore = reservation.restore
        if restore is not None and restore.HasField("stored"):
            # Uploaded: the task restores from a copy staged here, or starts fresh.
            task.restore_input = site_link_service_pb2.StagedInput(
                dataset=restore.stored.name,
                error="the commit carried no copy of the checkpoint to restore",
            )
            if commit.HasField("restore"):
                task.restore_input.CopyFrom(commit.restore)
            task.restore_of, task.restore = restore, None
            restore = None
        if is_service(reservation.spec):
            task.service = [
                ReplicaService.new(reservation.spec, task.revision) for _ in reservation.slots
            ]
        if reservation.spec.HasField("checkpoint"):
            self._files.watch_checkpoints(task, restore)
        self._tasks[key] = task
        self._book.changed()
        if task.inputs or task.restore_input is not None or self._room.to_launch(task):
            # Downloads and launches may take long: the commit is answered now, and the task
            # stays DELEGATED (not RUNNING) until its nodes run and every input is in place.
            task.supervisor = asyncio.create_task(self._stage_then_launch(task))
        else:
            await self._launch(task)
        return started()

    async def _stage_then_launch(self, task: Task) -> None:
        """Launches the task's nodes that do not run yet and stages its inputs, then starts
        it; a cancel meanwhile ends it CANCELLED, a node that cannot be launched or an input
        that cannot be had FAILED, before any replica ran."""
        staging = asyncio.ensure_future(self._provision_and_stage(task))
        cancelled = asyncio.ensure_future(task.cancelled.wait())
        try:
            await asyncio.wait({staging, cancelled}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelled.cancel()
        if not staging.done():
            staging.cancel()
            await asyncio.gather(staging, return_exceptions=True)
            self._book.finish(task, jobs_pb2.JOB_STATE_CANCELLED, 0, task.cancel_reason or "", "")
            return
        if (problem := staging.result()) is not None:
            self._book.finish(task, jobs_pb2.JOB_STATE_FAILED, 0, problem, "")
            return
        await self._launch(task)

    async def _provision_and_stage(self, task: Task) -> str | None:
        if self._elastic is not None and (nodes := self._room.to_launch(task)):
            try:
                await self._elastic.ensure_running(nodes, self._book.changed)
            except LaunchError as exc:
                return str(exc)
        if not task.inputs and task.restore_input is None:
            return None
        return await self._files.stage(task)

    async def _launch(self, task: Task) -> None:
        """Starts every replica and supervises the task (or ends it, if one cannot start)."""
        key = task.key
        devices = task.devices
        try:
            await self._launcher.start_replicas(task)
        except asyncio.CancelledError:  # the agent is going: no record, so no adoption
            for replica in task.replicas:
                replica.kill()
            raise
        except ReplicaStartError as exc:
            await asyncio.gather(*(p.terminate(task.grace_s) for p in task.replicas))
            if task.cancel_reason is not None:
                self._book.finish(task, jobs_pb2.JOB_STATE_CANCELLED, 0, task.cancel_reason, "")
            else:
                self._book.finish(task, jobs_pb2.JOB_STATE_FAILED, exc.exit_code, str(exc), "")
            return
        task.state, task.started_at = jobs_pb2.JOB_STATE_RUNNING, time.time()
        self._book.save(task)
        if task.checkpoints is not None:
            task.checkpoints.start(task.started_at)
        log.info("task_started", job_id=key[0], task=key[1], epoch=key[2], devices=devices)
        self._book.report(task)
        # Held so the supervisor is not garbage-collected while it runs.
        task.supervisor = asyncio.create_task(self.supervise(task))

    async def supervise(self, task: Task) -> None:
        """Runs the task to its end; a bug here must not leave it (and cancel) hanging."""
        try:
            await (
                self._services.watch_service(task)
                if task.service is not None
                else self._watch(task)
            )
        except Exception as exc:
            log.exception("task_supervision_failed", job_id=task.key[0], task=task.key[1])
            await asyncio.gather(
                *(p.terminate(task.grace_s) for p in task.replicas), return_exceptions=True
            )
            self._book.finish(task, jobs_pb2.JOB_STATE_FAILED, 0, f"supervision failed: {exc}", "")

    async def _watch(self, task: Task) -> None:
        """Waits for every replica, the first failure, the timeout or a cancel; ends the task."""
        loop = asyncio.get_running_loop()
        waits = {asyncio.ensure_future(p.wait()): i for i, p in enumerate(task.replicas)}
        cancelled = asyncio.ensure_future(task.cancelled.wait())
        timeout_s = task.spec.timeout_s
        # From its start, which an adopted task had before this agent did.
        ran_s = max(0.0, time.time() - task.started_at)
        deadline = loop.time() + timeout_s - ran_s if timeout_s > 0 else None
        state: State = jobs_pb2.JOB_STATE_SUCCEEDED
        exit_code, reason, tail_of = 0, "", 0
        try:
            while waits:
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                done, _ = await asyncio.wait(
                    {*waits, cancelled}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED
                )
                if cancelled in done:
                    state, reason = jobs_pb2.JOB_STATE_CANCELLED, task.cancel_reason or "cancelled"
                    break
                if not done:
                    state, reason = jobs_pb2.JOB_STATE_FAILED, f"timed out after {timeout_s:g}s"
                    break
                exits = sorted((waits.pop(future), future.result()) for future in done)
                failures = [(replica, code) for replica, code in exits if code != 0]
                if failures:
                    tail_of, exit_code = failures[0]
                    ended = task.replicas[tail_of].ended
                    why = ended.why if ended is not None else ""
                    reason = (
                        f"replica {tail_of}: {why}"
                        if why
                        else f"replica {tail_of} {describe_exit(exit_code)}"
                    )
                    state = jobs_pb2.JOB_STATE_FAILED
                    break
        finally:
            for future in [*waits, cancelled]:
                future.cancel()
        stopped = await asyncio.gather(*(p.terminate(task.grace_s) for p in task.replicas))
        ended_by_itself = not any(stopped) and all(p.returncode == 0 for p in task.replicas)
        if state == jobs_pb2.JOB_STATE_CANCELLED and ended_by_itself:
            # Every replica had ended by itself, with 0, before the stop could reach it: the
            # work is done, and a preempted task must not run again. (One that exits 0 once
            # signalled has not said so: it may have saved a checkpoint and quit.)
            state, reason = jobs_pb2.JOB_STATE_SUCCEEDED, ""
        await self._files.settle_checkpoints(task, state)
        if state == jobs_pb2.JOB_STATE_SUCCEEDED and task.spec.outputs:
            try:
                task.artifacts, reason = await self._data.publish(
                    task.key,
                    task.tenant,
                    task.spec.outputs,
                    self._folders.task_dir(task.key) / "0",
                    self._folders.run_dir(task.key, 0).parent,
                )
            except DataError as exc:
                job_id, name, _ = task.key
                log.warning("outputs_not_stored", job_id=job_id, task=name, error=str(exc))
                state, reason = jobs_pb2.JOB_STATE_FAILED, str(exc)
        elif state != jobs_pb2.JOB_STATE_SUCCEEDED and task.spec.outputs:
            task.artifacts = await self._data.keep_partial(
                task.key,
                task.tenant,
                task.spec.outputs,
                self._folders.task_dir(task.key) / "0",
                self._folders.run_dir(task.key, 0).parent,
            )
        self._book.finish(task, state, exit_code, reason, task.replicas[tail_of].output_tail)
