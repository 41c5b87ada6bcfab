"""The store copy the coordinator streams: whole, one revision, checked by its SHA-256, and
recorded in the audit trail; refused on etcd, which takes its own snapshots."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import pytest
from store.etcd_server import LocalEtcd

from federation.api.v1 import audit_service_pb2
from federation.coordinator import audit
from federation.coordinator.ha.backup import CHUNK_BYTES, backup_chunks
from federation.errors import FailedPreconditionError
from federation.store import Put, SqliteStore
from federation.store.backup_file import inspect
from federation.store.etcd import EtcdStore


async def test_the_copy_arrives_whole_and_is_audited(store: SqliteStore, tmp_path: Path) -> None:
    big = b"x" * (CHUNK_BYTES // 2)
    for i in range(5):  # more than one chunk of copy
        await store.commit([Put(f"/jobs/j{i}", big)])
    revision = await store.revision()
    chunks = [c async for c in backup_chunks(store, "operator:admin")]
    assert chunks[0].revision == revision
    assert len(chunks) > 2
    data = b"".join(c.data for c in chunks)
    assert chunks[0].size_bytes == len(data)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    copy = tmp_path / "copy.db"
    copy.write_bytes(data)
    held = inspect(copy)
    assert (held.revision, held.jobs) == (revision, 5)
    trail = await audit.list_events(store, audit_service_pb2.ListAuditEventsRequest())
    assert [(e.identity, e.action) for e in trail.events] == [("operator:admin", "store.backup")]
    leftovers = [p.name for p in store.path.parent.iterdir() if p.name.startswith(".backup-")]
    assert leftovers == []  # the copy beside the store is gone


async def test_a_store_on_etcd_is_refused(etcd: LocalEtcd) -> None:
    store = await EtcdStore.open([etcd.endpoint], prefix=f"/backup-{uuid.uuid4().hex}")
    try:
        with pytest.raises(FailedPreconditionError, match="etcdctl snapshot save"):
            async for _ in backup_chunks(store, "operator:admin"):
                pass
    finally:
        await store.close()
