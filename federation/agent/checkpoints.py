"""Finding the checkpoints a task completes, so the agent can report them.

The rule a task follows: it writes a checkpoint as a file or folder ``NAME`` in
``FEDERATION_CHECKPOINT_DIR``, then creates an empty marker ``NAME.done``. A checkpoint is
complete once its marker exists and ``NAME`` does; writing ``NAME`` again and touching its
marker completes it again. The agent scans the folder at the task's declared interval (a
bounded scan: at most ``MAX_ENTRIES`` names, at most ``MAX_FILES`` files counted per folder
checkpoint), never reads what the task wrote, and reports each new completion oldest first.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path

import structlog
from google.protobuf import timestamp_pb2

from federation.agent.accounts import Account, agent_folder, private_folder
from federation.api.v1 import jobs_pb2

log = structlog.get_logger()

MARKER_SUFFIX = ".done"
DEFAULT_DIR = "checkpoints"
DEFAULT_INTERVAL_S = 60.0
MIN_INTERVAL_S = 0.1
MAX_ENTRIES = 10_000
MAX_FILES = 100_000

CheckpointCallback = Callable[[jobs_pb2.CheckpointRecord], None]
"""Called with each newly completed checkpoint."""


def checkpoint_dir(task_dir: Path, policy: jobs_pb2.Checkpoint) -> Path:
    """The folder a task writes its checkpoints in, under its work folder at this site."""
    return task_dir / (policy.dir or DEFAULT_DIR)


def interval_s(policy: jobs_pb2.Checkpoint) -> float:
    """How often to look for new checkpoints: the declared interval, within sane bounds."""
    return max(MIN_INTERVAL_S, policy.interval_s or DEFAULT_INTERVAL_S)


def size_bytes(path: Path) -> int:
    """A file's size, or the total size of the files under a folder (bounded)."""
    if not path.is_dir():
        return path.stat().st_size
    total, seen = 0, 0
    for root, _, files in os.walk(path):
        for name in files:
            seen += 1
            if seen > MAX_FILES:
                return total
            try:
                total += (Path(root) / name).lstat().st_size
            except OSError:
                continue  # removed meanwhile
    return total


class CheckpointScanner:
    """Remembers which checkpoints it has seen in one folder and finds the new ones.

    Args:
        directory: The task's checkpoint folder.
        base_progress_s: Progress held by the checkpoint the task restarted from (0 if none).
        started_at: Wall-clock time (seconds) the task started at this site.
    """

    def __init__(self, directory: Path, base_progress_s: float, started_at: float) -> None:
        self.directory = directory
        self._base_progress_s = base_progress_s
        self._started_at = started_at
        self._seen: dict[str, int] = {}

    def scan(self) -> list[jobs_pb2.CheckpointRecord]:
        """Checkpoints completed since the last scan, oldest first (blocking: run in a thread)."""
        try:
            with os.scandir(self.directory) as entries:
                markers = [
                    entry
                    for _, entry in zip(range(MAX_ENTRIES), entries, strict=False)
                    if entry.name.endswith(MARKER_SUFFIX) and entry.is_file()
                ]
        except FileNotFoundError:
            return []
        found: list[tuple[int, jobs_pb2.CheckpointRecord]] = []
        for marker in markers:
            name = marker.name.removesuffix(MARKER_SUFFIX)
            try:
                done_ns = marker.stat().st_mtime_ns
                if not name or self._seen.get(name) == done_ns:
                    continue
                target = self.directory / name
                size = size_bytes(target)
            except OSError:
                continue  # no NAME beside its marker (yet), or it went away
            self._seen[name] = done_ns
            found.append((done_ns, self._record(target, size, done_ns)))
        return [record for _, record in sorted(found, key=lambda item: item[0])]

    def rebase(self, base_progress_s: float, started_at: float) -> None:
        """The task starts again in this folder (from ``base_progress_s`` of work, at
        ``started_at``); checkpoints already found are not found again."""
        self._base_progress_s, self._started_at = base_progress_s, started_at

    def _record(self, target: Path, size: int, done_ns: int) -> jobs_pb2.CheckpointRecord:
        time = timestamp_pb2.Timestamp()
        time.FromNanoseconds(done_ns)
        progress = self._base_progress_s + max(0.0, done_ns / 1e9 - self._started_at)
        return jobs_pb2.CheckpointRecord(
            path=str(target.absolute()), bytes=size, time=time, progress_s=progress
        )


class TaskCheckpoints:
    """One task's checkpoints at this site: its folder, its environment, the watcher.

    Args:
        policy: The task's declared checkpoint policy.
        task_dir: The task's work folder at this site (its epoch's folder).
        restore: The checkpoint the task restarts from, or None for a fresh start.
        on_checkpoint: Called with each newly completed checkpoint.
    """

    def __init__(
        self,
        policy: jobs_pb2.Checkpoint,
        task_dir: Path,
        restore: jobs_pb2.CheckpointRecord | None,
        on_checkpoint: CheckpointCallback,
    ) -> None:
        self.directory = checkpoint_dir(task_dir, policy)
        self._every_s = interval_s(policy)
        self._restore = restore
        self._on_checkpoint = on_checkpoint
        self._scanner: CheckpointScanner | None = None
        self._scanning = asyncio.Lock()
        self._watcher: asyncio.Task[None] | None = None
        self.latest: jobs_pb2.CheckpointRecord | None = None
        """The newest checkpoint completed here, once there is one."""

    def env(self) -> dict[str, str]:
        """``FEDERATION_CHECKPOINT_DIR``, and ``FEDERATION_RESTORE_FROM`` for a restart.

        Both are absolute (against the agent's working folder) whatever the configured
        folders are: a task runs in its own working folder, where a relative one is wrong.
        """
        env = {"FEDERATION_CHECKPOINT_DIR": os.path.abspath(self.directory)}
        if self._restore is not None and self._restore.path:
            env["FEDERATION_RESTORE_FROM"] = os.path.abspath(self._restore.path)
        return env

    @property
    def restore_from(self) -> Path | None:
        """The checkpoint this task restarts from, if any."""
        if self._restore is None or not self._restore.path:
            return None
        return Path(self._restore.path)

    def prepare(self, account: Account | None) -> None:
        """Create the folder, only ``account`` may enter it; blocking: run in a thread."""
        agent_folder(self.directory.parent)
        private_folder(self.directory, account)
        if self._restore is not None and not Path(self._restore.path).exists():
            # Another machine holds it: the task must fetch it from there (not done here).
            log.warning(
                "checkpoint_not_reachable", path=self._restore.path, site=self._restore.site
            )

    def start(self, started_at: float) -> None:
        """Watch the folder from now; ``started_at`` is when the task started (wall clock).

        A task started again in the same folder (``restarted``) keeps its scanner, so the
        checkpoints already reported are not reported again.
        """
        self._watcher = asyncio.create_task(self._watch(self._scanner_from(started_at)))

    def stop(self) -> None:
        """Stop watching (the task ended)."""
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None

    async def last_look(self, started_at: float) -> None:
        """Stop watching after one more look, so a checkpoint completed as the task ended (in
        its SIGTERM grace) is reported; a look under way reports first.

        Args:
            started_at: When the task started, for a task that was never watched (it ended
                before it was seen running).
        """
        async with self._scanning:
            self.stop()
        await self._scan(self._scanner or self._scanner_from(started_at))

    def restarted(self) -> None:
        """The task will start again in this folder (its Slurm job was requeued): it restores
        from the newest checkpoint completed here, if any; ``start`` it again when it runs."""
        self.stop()
        if self.latest is not None:
            self._restore = self.latest

    def restore_from_copy(self, record: jobs_pb2.CheckpointRecord) -> None:
        """The task restores from ``record``, a copy staged at this site (before it starts)."""
        self._restore = record

    def _scanner_from(self, started_at: float) -> CheckpointScanner:
        """The folder's scanner, counting work from the restored checkpoint's on at
        ``started_at``."""
        base = self._restore.progress_s if self._restore is not None else 0.0
        if self._scanner is None:
            self._scanner = CheckpointScanner(self.directory, base, started_at)
        else:
            self._scanner.rebase(base, started_at)
        return self._scanner

    async def _watch(self, scanner: CheckpointScanner) -> None:
        """Scan every interval until cancelled, reporting each new checkpoint."""
        while True:
            await asyncio.sleep(self._every_s)
            await self._scan(scanner)

    async def _scan(self, scanner: CheckpointScanner) -> None:
        async with self._scanning:
            try:
                found = await asyncio.to_thread(scanner.scan)
            except OSError as exc:
                log.warning("checkpoint_scan_failed", dir=str(scanner.directory), error=str(exc))
                return
            for record in found:
                self._found(record)

    def _found(self, record: jobs_pb2.CheckpointRecord) -> None:
        self.latest = record
        log.info("checkpoint_completed", path=record.path, bytes=record.bytes)
        self._on_checkpoint(record)
