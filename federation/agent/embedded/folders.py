"""Where the embedded core's tasks run: a work folder per epoch of a task, the agent's own
folder beside it for each replica's supervisor files, locked once the task has ended."""

from __future__ import annotations

from pathlib import Path

import structlog

from federation.common.keys import RunKey

log = structlog.get_logger()


class TaskFolders:
    """The folders of the tasks under ``work_dir`` (absolute: tasks run elsewhere)."""

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir

    def task_dir(self, key: RunKey) -> Path:
        """The work folder of one epoch of a task; its replicas run in subfolders."""
        job_id, name, epoch = key
        return self.work_dir / job_id / name / str(epoch)

    def run_dir(self, key: RunKey, replica: int) -> Path:
        """The agent's own folder for a replica's supervisor files (output tail, exit status):
        beside the epoch's folder, where no task can reach."""
        job_id, name, epoch = key
        return self.work_dir / job_id / name / f"{epoch}.run" / str(replica)

    def lock(self, key: RunKey) -> None:
        """Once a task has ended only the agent may enter its folder: a task that opened its
        own folder to others while it ran leaves nothing reachable. (One chmod: no walk.)"""
        try:
            self.task_dir(key).chmod(0o700)
        except FileNotFoundError:
            pass  # it never started
        except OSError as exc:
            log.warning("work_folder_not_locked", job_id=key[0], task=key[1], error=str(exc))

    def reopen(self, key: RunKey, checkpoint: Path | None) -> None:
        """A restart from a checkpoint of an ended epoch here passes through that epoch's
        folder again (locked by ``lock``); the checkpoint's own folder stays its account's.
        Blocking: run it in a thread."""
        if checkpoint is None or not checkpoint.is_relative_to(self.work_dir):
            return
        parts = checkpoint.relative_to(self.work_dir).parts
        # A part of a divided task ("train/1") has a folder per level of its name.
        task = (key[0], *Path(key[1]).parts)
        if len(parts) < len(task) + 2 or ".." in parts or parts[: len(task)] != task:
            return  # only an earlier epoch of this same task is opened again
        epoch_dir = self.work_dir.joinpath(*parts[: len(task) + 1])  # <job>/<task>/<epoch>
        if epoch_dir.is_dir() and not epoch_dir.is_symlink():
            epoch_dir.chmod(0o711)


def safe_part(name: str) -> bool:
    """Whether ``name`` (a job id or task name from the coordinator) is one path part."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name
