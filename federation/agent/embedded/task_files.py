"""A task's files that move: its inputs and the checkpoint it restores from staged into its
folders before it starts, and its checkpoints watched, uploaded and settled as it ends."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from federation.agent.checkpoint_store import CheckpointUploads
from federation.agent.checkpoints import TaskCheckpoints
from federation.agent.embedded.folders import TaskFolders
from federation.agent.embedded.launching import ReplicaLauncher
from federation.agent.embedded.task import State, Task
from federation.agent.object_store import DataError
from federation.agent.process import ReplicaStartError
from federation.agent.task_data import TaskData, staging_problem
from federation.api.v1 import jobs_pb2, site_link_service_pb2

log = structlog.get_logger()


class TaskFiles:
    """Stages tasks' inputs and follows their checkpoints.

    Args:
        data: Stages inputs and holds the site's store, if it has one.
        folders: Where each task's files go.
        launcher: Makes a task's folders and says which account owns them.
        report: Reports a task (a checkpoint it saved).
    """

    def __init__(
        self,
        data: TaskData,
        folders: TaskFolders,
        launcher: ReplicaLauncher,
        report: Callable[[Task], None],
    ) -> None:
        self._data = data
        self._folders = folders
        self._launcher = launcher
        self._report = report

    async def stage(self, task: Task) -> str | None:
        """Puts the inputs in every replica's folder; why not, or None."""
        return await staging_problem(task.key, self._stage(task), (DataError, ReplicaStartError))

    async def _stage(self, task: Task) -> None:
        await asyncio.to_thread(self._launcher.make_dirs, task)
        await self._data.stage(
            task.inputs,
            [self._folders.task_dir(task.key) / str(i) for i in range(len(task.slots))],
            self._launcher.account(task),
            task.key,
            task.tenant,
        )
        if task.restore_input is not None:
            await self._stage_restore(task, task.restore_input)

    async def _stage_restore(self, task: Task, item: site_link_service_pb2.StagedInput) -> None:
        """Stages the uploaded checkpoint the task restores from, or says why it starts
        fresh."""
        task_dir, account = self._folders.task_dir(task.key), self._launcher.account(task)
        record, why = await self._data.restore(task.key, item, task_dir, account, task.restore_of)
        if record is None:
            task.reason = why
            return
        task.restore = record
        if task.checkpoints is not None:
            task.checkpoints.restore_from_copy(record)

    def watch_checkpoints(
        self, task: Task, restore: jobs_pb2.CheckpointRecord | None
    ) -> TaskCheckpoints:
        """The task's checkpoint folder and watcher; at a site with a store, its uploads."""
        policy = task.spec.checkpoint
        task.checkpoints = TaskCheckpoints(
            policy,
            self._folders.task_dir(task.key),
            restore,
            lambda found: self._found(task, found),
        )
        if self._data.store is not None:
            task.uploads = CheckpointUploads(
                self._data.store,
                task.key,
                task.tenant,
                policy,
                self._folders.run_dir(task.key, 0).parent,
                lambda stored: self._checkpoint_stored(task, stored),
            )
        return task.checkpoints

    def _found(self, task: Task, record: jobs_pb2.CheckpointRecord) -> None:
        """A checkpoint completed: reported now, or once uploaded where there is a store."""
        if task.uploads is not None:
            task.uploads.submit(record)
        else:
            task.checkpoint = record
            self._report(task)

    def _checkpoint_stored(self, task: Task, record: jobs_pb2.CheckpointRecord) -> None:
        if task.final is None:
            task.checkpoint = record
            self._report(task)

    async def settle_checkpoints(self, task: Task, state: State) -> None:
        """Before a task's end is reported: one more look for a checkpoint (one saved in its
        stop's grace) and, unless it succeeded, its newest one uploaded."""
        if task.checkpoints is not None:
            await task.checkpoints.last_look(task.started_at)
        if task.uploads is not None:
            await task.uploads.settle(state == jobs_pb2.JOB_STATE_SUCCEEDED)
