"""A copy of the embedded store for operators, taken and streamed while the coordinator serves.

The copy is SQLite's online backup of the database, made on the store's own thread, so it is
one revision whole; it goes to a file beside the database (the same disk, never /tmp) and is
streamed from there in chunks, then removed.
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import structlog

from federation.api.v1 import store_service_pb2
from federation.coordinator import audit
from federation.errors import FailedPreconditionError
from federation.store import SqliteStore, Store

log = structlog.get_logger()

CHUNK_BYTES = 1 << 20
"""Bytes of the copy per message: well under gRPC's 4 MiB default for what a client receives."""


async def backup_chunks(
    store: Store, caller: str
) -> AsyncIterator[store_service_pb2.BackupStoreResponse]:
    """The store copied now, in messages: revision and size first, the SHA-256 last."""
    if not isinstance(store, SqliteStore):
        raise FailedPreconditionError(
            "this coordinator keeps its state in etcd, which takes its own snapshots. To fix: "
            "'etcdctl snapshot save FILE' against the etcd cluster"
        )
    folder = Path(tempfile.mkdtemp(prefix=".backup-", dir=store.path.parent))
    try:
        copy = folder / "federation.db"
        revision = await store.backup(copy)
        size = (await asyncio.to_thread(copy.stat)).st_size
        await store.commit([audit.entry(caller, "store.backup", f"revision {revision}")])
        log.info("store_backup", by=caller, revision=revision, bytes=size)
        digest = hashlib.sha256()
        first = store_service_pb2.BackupStoreResponse(revision=revision, size_bytes=size)
        with copy.open("rb") as source:
            while chunk := await asyncio.to_thread(source.read, CHUNK_BYTES):
                digest.update(chunk)
                first.data = chunk
                yield first
                first = store_service_pb2.BackupStoreResponse()
        yield store_service_pb2.BackupStoreResponse(sha256=digest.hexdigest())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
