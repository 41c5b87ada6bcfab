"""One task's data at a Ray site: inputs staged in, its checkpoints, outputs stored.

The Ray nodes see the site's work folder (``work_dir``, as the nodes of a Slurm site see
theirs), so the agent does here what the embedded core does on its own machine, with the same
parts: ``federation.agent.task_data`` stages each input into every replica's folder before
the task's Ray job is submitted (the task DELEGATED meanwhile, the coordinator told of long
stage-ins) and stores its outputs, read from replica 0's folder, once it succeeded;
``federation.agent.checkpoints`` watches its checkpoint folder from its start and
``checkpoint_store`` uploads each checkpoint to the site's store. A restart restores from its
previous checkpoint: the one in an earlier epoch's folder here, or a stored one staged from
whichever store holds it (``Commit.restore``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import structlog

from datacenter_agent.ray_cluster.record import TaskRecord
from federation.agent.checkpoint_store import CheckpointUploads
from federation.agent.checkpoints import TaskCheckpoints
from federation.agent.object_store import DataError
from federation.agent.task_data import TaskData, staging_problem
from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.common.keys import RunKey

log = structlog.get_logger()

_SUCCEEDED = jobs_pb2.JOB_STATE_SUCCEEDED
_FAILED = jobs_pb2.JOB_STATE_FAILED


def task_folder(work_dir: Path, key: RunKey) -> Path:
    """The folder of one epoch of a task (``JOB/TASK/EPOCH``, a divided task's ``/`` as
    ``~``); each replica runs in its ``replica-N``."""
    return work_dir / key[0] / key[1].replace("/", "~") / str(key[2])


def replica_folder(folder: Path, replica: int) -> Path:
    return folder / f"replica-{replica}"


def has_data(spec: jobs_pb2.TaskSpec, commit: site_link_service_pb2.Commit) -> bool:
    """Whether the task stages inputs, stores outputs or keeps checkpoints."""
    return bool(commit.inputs or spec.outputs or spec.HasField("checkpoint"))


class RayTaskData:
    """One task's inputs, checkpoints and outputs; ``stage`` before it is submitted,
    ``started`` once it runs, ``settle`` once it has ended.

    Args:
        data: The site's stage-in and store (shared by its tasks).
        key: The task's (job, task, epoch).
        spec: What the task declared.
        tenant: Whose task it is (its objects go in that tenant's folder).
        folder: The task's epoch folder, seen by the agent and the Ray nodes alike.
        replicas: How many replicas run (one folder each).
        restore: The checkpoint the offer named to restart from, if any.
        commit: Its commit: the inputs and the stored checkpoint to stage in.
        on_checkpoint: Called once a checkpoint is reported (``checkpoint`` is the newest).
    """

    def __init__(
        self,
        data: TaskData,
        key: RunKey,
        spec: jobs_pb2.TaskSpec,
        *,
        tenant: str,
        folder: Path,
        replicas: int,
        restore: jobs_pb2.CheckpointRecord | None,
        commit: site_link_service_pb2.Commit,
        on_checkpoint: Callable[[], None],
    ) -> None:
        self.data, self.key, self.spec, self.tenant = data, key, spec, tenant
        self.folder, self.replicas = folder, replicas
        self._restore = restore
        self._on_checkpoint = on_checkpoint
        self.checkpoint: jobs_pb2.CheckpointRecord | None = None
        """The newest checkpoint reported: at a site with a store, the newest uploaded."""
        self.artifacts: list[jobs_pb2.Artifact] = []
        """Its outputs as stored, once it ended."""
        self.note = ""
        """Why it started fresh though it was to restore a checkpoint; "" otherwise."""
        self.started_at = 0.0
        """Wall-clock time the task was seen running."""
        self.inputs = list(commit.inputs)
        self.restored = restore
        """The checkpoint its replicas restore from, where they read it; None: none (yet)."""
        self.restore_input: site_link_service_pb2.StagedInput | None = None
        if restore is not None and restore.HasField("stored"):
            # Uploaded: the task restores from a copy staged here, or starts fresh.
            self.restore_input = site_link_service_pb2.StagedInput(
                dataset=restore.stored.name,
                error="the commit carried no copy of the checkpoint to restore",
            )
            if commit.HasField("restore"):
                self.restore_input.CopyFrom(commit.restore)
            restore = self.restored = None
        self.checkpoints: TaskCheckpoints | None = None
        self.uploads: CheckpointUploads | None = None
        if spec.HasField("checkpoint"):
            self.checkpoints = TaskCheckpoints(spec.checkpoint, folder, restore, self._found)
            if data.store is not None:
                self.uploads = CheckpointUploads(
                    data.store, key, tenant, spec.checkpoint, self.scratch, self._report
                )

    @classmethod
    def adopted(
        cls,
        data: TaskData,
        key: RunKey,
        record: TaskRecord,
        *,
        folder: Path,
        started_at: float,
        on_checkpoint: Callable[[], None],
    ) -> RayTaskData:
        """The data of a task whose job an earlier agent submitted, from its ``record``:
        its inputs are in place, its checkpoints are counted from ``started_at`` (when its job
        started) and the checkpoint it restored from, as its submitter counted them."""
        restore = None
        if record.restore is not None:
            restore = jobs_pb2.CheckpointRecord()
            restore.CopyFrom(record.restore)
            restore.ClearField("stored")  # staged already: read where its path says
        adopted = cls(
            data,
            key,
            record.spec,
            tenant=record.tenant,
            folder=folder,
            replicas=record.spec.replicas or 1,
            restore=restore,
            commit=site_link_service_pb2.Commit(),
            on_checkpoint=on_checkpoint,
        )
        adopted.started_at = started_at
        return adopted

    @property
    def scratch(self) -> Path:
        """Beside the epoch's folder: a folder output's or checkpoint's tar while uploaded."""
        return self.folder.with_name(f"{self.key[2]}.run")

    @property
    def stages(self) -> bool:
        """Whether there is anything to stage in before the task starts."""
        return bool(self.inputs) or self.restore_input is not None

    def replica_folders(self) -> list[Path]:
        return [replica_folder(self.folder, i) for i in range(self.replicas)]

    async def stage(self) -> str | None:
        """Creates the task's folders and puts each input in every replica's, and the stored
        checkpoint it restores from in its ``.restore``; why not, or None."""
        return await staging_problem(self.key, self._stage())

    async def _stage(self) -> None:
        await asyncio.to_thread(self.make_folders)
        await self.data.stage(self.inputs, self.replica_folders(), None, self.key, self.tenant)
        if self.restore_input is not None:
            await self._stage_restore(self.restore_input)

    def make_folders(self) -> None:
        """The replicas' folders and the checkpoint folder, as the nodes' account may use
        them (the Ray nodes write there as the account they run as). Blocking."""
        for folder in self.replica_folders():
            folder.mkdir(parents=True, exist_ok=True)
        self.scratch.mkdir(mode=0o700, exist_ok=True)
        if self.checkpoints is not None:
            self.checkpoints.directory.mkdir(parents=True, exist_ok=True)

    async def _stage_restore(self, item: site_link_service_pb2.StagedInput) -> None:
        """Stages the stored checkpoint the task restores from, or says why it starts fresh."""
        record, why = await self.data.restore(self.key, item, self.folder, None, self._restore)
        if record is None:
            self.note = why
            return
        self.restored = record
        if self.checkpoints is not None:
            self.checkpoints.restore_from_copy(record)

    def env(self) -> dict[str, str]:
        """``FEDERATION_CHECKPOINT_DIR`` (and ``FEDERATION_RESTORE_FROM``) for every replica."""
        if self.checkpoints is None:
            return {}
        return self.checkpoints.env()

    def started(self, at: float) -> None:
        """The task runs (since ``at``, wall clock; an adopted task since its job started):
        its checkpoint folder is watched."""
        self.started_at = self.started_at or at
        if self.checkpoints is not None:
            self.checkpoints.start(self.started_at)

    async def settle(self, state: int, reason: str) -> tuple[int, str]:
        """Before the task's end is reported: one more look for a checkpoint (one saved in
        its stop's grace) and, unless it succeeded, the newest one uploaded; its outputs
        stored once it succeeded (one that cannot be fails it), or those to keep of a task
        that did not. Returns its final state and reason."""
        if self.checkpoints is not None:
            await self.checkpoints.last_look(self.started_at)
        if self.uploads is not None:
            await self.uploads.settle(state == _SUCCEEDED)
        outputs = self.spec.outputs
        if state == _SUCCEEDED and outputs:
            try:
                self.artifacts, note = await self.data.publish(
                    self.key, self.tenant, outputs, replica_folder(self.folder, 0), self.scratch
                )
            except DataError as exc:
                job_id, task, _ = self.key
                log.warning("outputs_not_stored", job_id=job_id, task=task, error=str(exc))
                return _FAILED, str(exc)
            return state, note or reason
        if state != _SUCCEEDED and outputs:
            self.artifacts = await self.data.keep_partial(
                self.key, self.tenant, outputs, replica_folder(self.folder, 0), self.scratch
            )
        return state, reason

    def stop(self) -> None:
        """Stops watching and uploading (the task ended, or the agent lets go of it)."""
        if self.checkpoints is not None:
            self.checkpoints.stop()
        if self.uploads is not None:
            self.uploads.cancel()

    def _found(self, record: jobs_pb2.CheckpointRecord) -> None:
        """A checkpoint completed: reported now, or once uploaded where there is a store."""
        if self.uploads is not None:
            self.uploads.submit(record)
        else:
            self._report(record)

    def _report(self, record: jobs_pb2.CheckpointRecord) -> None:
        self.checkpoint = record
        self._on_checkpoint()
