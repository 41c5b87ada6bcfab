"""The coordinator's durable, etcd-like key-value store."""

from __future__ import annotations

from federation.store.base import (
    CasConflictError,
    Check,
    CommitTooLargeError,
    CompactedError,
    Delete,
    KeyValue,
    LeaseNotFoundError,
    Op,
    Put,
    Store,
    StoreError,
    StoreUnreachableError,
    WatchEvent,
    WatchEventType,
    check_ops,
)
from federation.store.sqlite import SqliteStore

__all__ = [
    "CasConflictError",
    "Check",
    "CommitTooLargeError",
    "CompactedError",
    "Delete",
    "KeyValue",
    "LeaseNotFoundError",
    "Op",
    "Put",
    "SqliteStore",
    "Store",
    "StoreError",
    "StoreUnreachableError",
    "WatchEvent",
    "WatchEventType",
    "check_ops",
]
