"""A task's checkpoints in its site's object store: uploaded, pruned, copied out, staged in.

Each completed checkpoint is uploaded in the background, one upload at a time per task: while
one runs, only the newest checkpoint completed meanwhile waits (the ones between are never
uploaded, a later one supersedes them). Once uploaded, the checkpoint is reported with where it
is stored, and all but the task's ``keep`` newest objects in its folder are deleted. A task that
stops has its newest checkpoint uploaded before its stop is reported (``flush``).

Keys: ``{prefix}/{tenant}/{job}/{task}/_checkpoints/{epoch}.{done_ns}.{name}``, so the newest
sorts by (epoch, completion time) whichever site wrote it. A copy for another site goes
through a PUT URL that site signed (``replicate``): no site holds another's credentials.

Every function here but ``CheckpointUploads``'s blocks: call them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import structlog

from federation.agent.object_store import CHUNK, DataError, SiteStore
from federation.api.v1 import jobs_pb2, site_link_service_pb2

log = structlog.get_logger()

FOLDER = "_checkpoints"
DEFAULT_KEEP = 2
RESTORE_DIR = ".restore"
"""Where in the task's work folder a checkpoint from a store is staged."""
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")

Uploaded = Callable[[jobs_pb2.CheckpointRecord], None]
"""Called with a checkpoint once it is uploaded (``stored`` set), or as it was when its upload
failed (unset)."""


def keep(policy: jobs_pb2.Checkpoint) -> int:
    return policy.keep or DEFAULT_KEEP


def safe_name(name: str) -> str:
    """``name`` as one harmless key part and file name."""
    cleaned = _UNSAFE.sub("_", name).lstrip(".")
    return cleaned or "checkpoint"


def folder_of(store: SiteStore, tenant: str, job_id: str, task: str) -> str:
    parts = (store.prefix, tenant or "_", job_id, task, FOLDER)
    return "/".join(part for part in parts if part) + "/"


def _order(key: str) -> tuple[int, int]:
    """(epoch, completion ns) of a checkpoint key; (-1, -1) for a stranger in the folder."""
    epoch, _, rest = key.rsplit("/", 1)[-1].partition(".")
    done_ns = rest.partition(".")[0]
    if epoch.isdigit() and done_ns.isdigit():
        return int(epoch), int(done_ns)
    return -1, -1


def prune(store: SiteStore, folder: str, keep: int) -> list[str]:
    """Delete all but the ``keep`` newest checkpoints in ``folder``; returns the deleted keys."""
    keys = sorted(store.keys(folder), key=_order)
    old = keys[: max(0, len(keys) - keep)]
    store.delete(old)
    return old


class CheckpointUploads:
    """Uploads one task's completed checkpoints to its site's store.

    Args:
        store: The site's store.
        key: The task's (job, task, epoch).
        tenant: Whose task it is: its checkpoints go in that tenant's folder.
        policy: The task's checkpoint policy (how many to keep).
        scratch: An agent-only folder for a folder checkpoint's tar.
        uploaded: Called with each checkpoint once uploaded (or when its upload failed).
    """

    def __init__(
        self,
        store: SiteStore,
        key: tuple[str, str, int],
        tenant: str,
        policy: jobs_pb2.Checkpoint,
        scratch: Path,
        uploaded: Uploaded,
    ) -> None:
        self._store, self._key, self._tenant = store, key, tenant
        self._keep = keep(policy)
        self._scratch = scratch
        self._uploaded = uploaded
        self._waiting: jobs_pb2.CheckpointRecord | None = None
        self._worker: asyncio.Task[None] | None = None

    def submit(self, record: jobs_pb2.CheckpointRecord) -> None:
        """Upload ``record`` after the upload under way, superseding one waiting."""
        self._waiting = record
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._run())

    async def flush(self) -> None:
        """Wait until every checkpoint submitted is uploaded (or failed)."""
        while self._worker is not None and not self._worker.done():
            await asyncio.shield(self._worker)

    def cancel(self) -> None:
        if self._worker is not None:
            self._worker.cancel()

    async def settle(self, succeeded: bool) -> None:
        """As the task ends: its newest checkpoint uploaded, unless it succeeded (then never
        restored from: not worth the wait)."""
        if succeeded:
            self.cancel()
        else:
            await self.flush()

    async def _run(self) -> None:
        while (record := self._waiting) is not None:
            self._waiting = None
            stored = jobs_pb2.CheckpointRecord()
            stored.CopyFrom(record)
            try:
                stored.stored.CopyFrom(await asyncio.to_thread(self._upload, record))
            except DataError as err:
                job_id, task, _ = self._key
                log.warning("checkpoint_not_stored", job_id=job_id, task=task, error=str(err))
                stored.ClearField("stored")
            self._uploaded(stored)

    def _upload(self, record: jobs_pb2.CheckpointRecord) -> jobs_pb2.Artifact:
        job_id, task, epoch = self._key
        name = Path(record.path).name
        folder = folder_of(self._store, self._tenant, job_id, task)
        object_key = f"{folder}{epoch}.{record.time.ToNanoseconds()}.{safe_name(name)}"
        stored = self._store.upload(Path(record.path), object_key, self._scratch)
        deleted = prune(self._store, folder, self._keep)
        log.info(
            "checkpoint_stored",
            job_id=job_id,
            task=task,
            key=stored.key,
            bytes=stored.bytes,
            pruned=len(deleted),
        )
        return jobs_pb2.Artifact(
            name=name,
            bytes=stored.bytes,
            sha256=stored.sha256,
            key=stored.key,
            folder=stored.folder,
        )


def replicate(
    store: SiteStore, request: site_link_service_pb2.ReplicateCheckpoint, scratch: Path
) -> None:
    """Copy an object of ``store`` to another site through its PUT URL, after checking it is
    the size and digest reported. Raises DataError (no URL in its message)."""
    store.check_tenant_key(request.key, request.tenant)
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch) as work:
        copy = Path(work) / "checkpoint"
        store.fetch(request.key, copy)
        digest = hashlib.sha256()
        with copy.open("rb") as handle:
            while block := handle.read(CHUNK):
                digest.update(block)
        size = copy.stat().st_size
        if size != request.bytes or digest.hexdigest() != request.sha256:
            raise DataError(f"{request.key} in this store is not the checkpoint reported")
        with copy.open("rb") as handle:
            put = urllib.request.Request(
                request.url,
                data=handle,
                method="PUT",
                headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
            )
            try:
                with urllib.request.urlopen(put, timeout=60) as answer:
                    answer.read()
            except urllib.error.HTTPError as err:
                raise DataError(f"the other site's store answered HTTP {err.code}") from None
            except (urllib.error.URLError, OSError) as err:
                reason = getattr(err, "reason", err)
                raise DataError(f"the other site's store cannot be reached: {reason}") from None


def restore_path(task_dir: Path, item: site_link_service_pb2.StagedInput) -> Path:
    """Where a checkpoint staged from a store goes in the task's work folder."""
    return task_dir / RESTORE_DIR / safe_name(item.dataset)
