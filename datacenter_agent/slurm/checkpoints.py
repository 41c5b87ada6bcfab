"""What a restarted agent needs to watch an adopted Slurm job's checkpoints, in its folder.

The offer that declared the task's checkpoint policy is gone once the agent restarts, and
Slurm keeps only the batch script. So the job's folder (``work_dir/JOB/TASK/EPOCH``) also holds
the policy (``POLICY_FILE``) from the submission on, and the checkpoint the job restores from
(``RESTORED_FILE``) beside the path the batch script reads (``RESTORE_FILE``): an agent that
adopts the job watches its checkpoint folder as the agent that submitted it did, counting
progress from the same checkpoint, and a job Slurm requeues later restores from the newest.
"""

from __future__ import annotations

from pathlib import Path

import structlog
from google.protobuf.message import DecodeError

from federation.agent.checkpoints import CheckpointCallback, TaskCheckpoints
from federation.api.v1 import jobs_pb2

log = structlog.get_logger()

POLICY_FILE = "checkpoint-policy.pb"
"""The task's checkpoint policy (``Checkpoint``, binary); absent when it declares none."""
RESTORED_FILE = "restore-from.pb"
"""The checkpoint the job restores from (``CheckpointRecord``, binary); absent for none."""


def save_policy(
    folder: Path, policy: jobs_pb2.Checkpoint, restore: jobs_pb2.CheckpointRecord | None
) -> None:
    """Keeps the policy and the checkpoint restored from; blocking: run in a thread."""
    _replace(folder / POLICY_FILE, policy.SerializeToString())
    if restore is not None:
        save_restored(folder, restore)


def save_restored(folder: Path, record: jobs_pb2.CheckpointRecord) -> None:
    """Keeps the checkpoint the job's next run restores from; blocking: run in a thread."""
    _replace(folder / RESTORED_FILE, record.SerializeToString())


def adopted_checkpoints(folder: Path, on_checkpoint: CheckpointCallback) -> TaskCheckpoints | None:
    """The adopted job's checkpoints as its submitter kept them; None when the task declares
    no policy or the folder is not readable here (blocking: run in a thread)."""
    try:
        policy = jobs_pb2.Checkpoint.FromString((folder / POLICY_FILE).read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, DecodeError) as err:
        log.warning("checkpoint_policy_unreadable", folder=str(folder), error=str(err))
        return None
    restore: jobs_pb2.CheckpointRecord | None = None
    try:
        restore = jobs_pb2.CheckpointRecord.FromString((folder / RESTORED_FILE).read_bytes())
    except FileNotFoundError:
        pass
    except (OSError, DecodeError) as err:
        log.warning("restored_checkpoint_unreadable", folder=str(folder), error=str(err))
    return TaskCheckpoints(policy, folder, restore, on_checkpoint)


def _replace(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` at once: a reader sees the old or the new."""
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    partial.replace(path)
