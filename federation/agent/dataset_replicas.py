"""Copies of registered datasets a site keeps in its own store after staging them for a task.

With ``[object_store] replica_bytes`` set, a dataset staged in from another site is uploaded
to this site's store as ``{prefix}/{tenant}/replicas/{dataset}``, checked against the
dataset's digest, and reported to the coordinator (``DatasetCopyReport``), which records it as
a copy: later tasks here, and at sites nearer here than the original, stage it from this copy.
The copies together stay within ``replica_bytes``: before one is added, the least recently
used ones are deleted (and reported removed). A copy is used when this site signs a URL for
it, and when a task here stages the dataset again. The index survives agent restarts
(``replicas.json`` in the agent's state).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

from federation.agent.object_store import DataError, SiteStore
from federation.agent.supervisor import write_atomically
from federation.api.v1 import site_link_service_pb2

log = structlog.get_logger()


@dataclass(slots=True)
class _Kept:
    tenant: str
    dataset: str
    key: str
    bytes: int
    sha256: str
    used: float
    """When it was last used (Unix time)."""


class DatasetReplicas:
    """The dataset copies this site keeps, within ``limit`` bytes, least recently used out."""

    def __init__(self, store: SiteStore, limit: int, index: Path) -> None:
        self._store = store
        self._limit = limit
        self._index = index
        self._kept: dict[str, _Kept] = {}
        """By key."""
        try:
            for entry in json.loads(index.read_text()):
                self._kept[entry["key"]] = _Kept(**entry)
        except FileNotFoundError:
            pass
        except (ValueError, TypeError, KeyError) as err:
            log.warning("replica_index_unreadable", path=str(index), error=str(err))

    def key(self, tenant: str, dataset: str) -> str:
        parts = (self._store.prefix, tenant or "_", "replicas", dataset)
        return "/".join(part for part in parts if part)

    @property
    def stored_bytes(self) -> int:
        return sum(k.bytes for k in self._kept.values())

    def touch(self, key: str) -> None:
        """``key`` was used (a URL for it was signed, or its dataset staged here again)."""
        if (kept := self._kept.get(key)) is not None:
            kept.used = time.time()
            self._save()

    def keep(
        self, tenant: str, dataset: str, source: Path, size: int, sha256: str, scratch: Path
    ) -> list[site_link_service_pb2.DatasetCopyReport]:
        """Store the dataset staged at ``source`` as a copy, evicting the least recently used
        ones first; what the coordinator must be told (copies removed, then the one added).
        Nothing when it is bigger than the limit, kept already, or its upload did not give
        the dataset's digest (the task changed the file meanwhile, say). Blocking."""
        key = self.key(tenant, dataset)
        if key in self._kept:
            self.touch(key)
            return []
        if size > self._limit:
            return []
        reports = []
        while self.stored_bytes + size > self._limit:
            oldest = min(self._kept.values(), key=lambda k: k.used)
            reports.append(self._evict(oldest))
        try:
            stored = self._store.upload(source, key, scratch)
        except DataError as err:
            log.warning("replica_not_kept", dataset=dataset, tenant=tenant, error=str(err))
            return reports
        if (stored.bytes, stored.sha256) != (size, sha256) or stored.folder:
            # A folder is stored as its tar, whose digest is not the dataset's: kept as files
            # only. A file changed while it was read is not the dataset either.
            self._store.delete([key])
            log.info("replica_not_kept", dataset=dataset, tenant=tenant, error="digest differs")
            return reports
        self._kept[key] = _Kept(tenant, dataset, key, size, sha256, time.time())
        self._save()
        log.info("replica_kept", dataset=dataset, tenant=tenant, bytes=size)
        reports.append(self._report(self._kept[key], removed=False))
        return reports

    def _evict(self, kept: _Kept) -> site_link_service_pb2.DatasetCopyReport:
        try:
            self._store.delete([kept.key])
        except DataError as err:  # forgotten all the same: the limit counts what is reported
            log.warning("replica_not_deleted", key=kept.key, error=str(err))
        del self._kept[kept.key]
        self._save()
        log.info("replica_evicted", dataset=kept.dataset, tenant=kept.tenant, bytes=kept.bytes)
        return self._report(kept, removed=True)

    def _report(self, kept: _Kept, *, removed: bool) -> site_link_service_pb2.DatasetCopyReport:
        return site_link_service_pb2.DatasetCopyReport(
            tenant=kept.tenant,
            dataset=kept.dataset,
            location=f"s3://{self._store.settings.bucket}/{kept.key}",
            bytes=kept.bytes,
            sha256=kept.sha256,
            removed=removed,
        )

    def reports(self) -> list[site_link_service_pb2.DatasetCopyReport]:
        """Every copy kept, for a coordinator that may have missed them (sent at each hello)."""
        return [self._report(k, removed=False) for k in self._kept.values()]

    def _save(self) -> None:
        entries = [asdict(k) for k in self._kept.values()]
        os.makedirs(self._index.parent, exist_ok=True)
        write_atomically(str(self._index), json.dumps(entries).encode())
