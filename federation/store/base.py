"""The coordinator's key-value store: values, operations, errors and the ``Store`` protocol.

The model follows etcd v3 so that an etcd-backed store can implement the same protocol: one
store-wide revision counter that every change advances, per-key ``create_revision`` and
``mod_revision``, atomic multi-key commits guarded by revision compares, a history of changes
for watches, and leases whose expiry deletes the keys attached to them.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeAlias


@dataclass(frozen=True, slots=True)
class KeyValue:
    """A stored key with the revisions that created and last modified it.

    Attributes:
        key: The key.
        value: The value.
        create_revision: Store revision of the commit that created the key (reset when a deleted
            key is written again).
        mod_revision: Store revision of the commit that last wrote the key.
        lease: Lease the key is attached to, or 0 for none.
    """

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Put:
    """Write ``value`` at ``key``.

    Attributes:
        key: The key to write; must not be empty.
        value: The value to write.
        expect_revision: ``None`` writes unconditionally; 0 requires that the key does not
            exist; any other number requires that the key's ``mod_revision`` equals it.
        lease: Lease to attach the key to, or 0 to detach it from any lease.
    """

    key: str
    value: bytes
    expect_revision: int | None = None
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Delete:
    """Delete ``key``; deleting a missing key unconditionally is a no-op.

    Attributes:
        key: The key to delete; must not be empty.
        expect_revision: Same meaning as for ``Put``.
    """

    key: str
    expect_revision: int | None = None


@dataclass(frozen=True, slots=True)
class Check:
    """Require that ``key`` is at ``expect_revision``, and write nothing to it.

    A guard for the rest of a commit: the commit applies only while the key is unchanged, as
    a coordinator's writes apply only while it still holds the leader key it wrote.

    Attributes:
        key: The key to compare; must not be empty.
        expect_revision: 0 requires that the key does not exist; any other number requires
            that the key's ``mod_revision`` equals it.
    """

    key: str
    expect_revision: int


Op: TypeAlias = Put | Delete | Check


class WatchEventType(enum.Enum):
    """What happened to a key; values match etcd's ``mvccpb.Event.EventType``."""

    PUT = 0
    DELETE = 1


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change to one key.

    Attributes:
        type: Whether the key was written or deleted.
        kv: The key after the change. For ``DELETE`` only ``key`` and ``mod_revision`` (the
            revision of the delete) are meaningful; ``value`` is empty and the other fields 0.
    """

    type: WatchEventType
    kv: KeyValue


class StoreError(Exception):
    """Base class of every store failure."""


class StoreUnreachableError(StoreError):
    """No endpoint of the store answered: it may be starting, so trying again can help."""


class CommitTooLargeError(StoreError):
    """The store refused a commit for its size (etcd's --max-txn-ops or --max-request-bytes):
    it wrote nothing, and the same commit will never pass."""


class CasConflictError(StoreError):
    """A commit's revision expectation did not hold, so the commit wrote nothing.

    Attributes:
        key: The first key (in op order) whose expectation failed.
        expected: The revision the op expected.
        actual: The key's current ``mod_revision``, or 0 when it does not exist.
    """

    def __init__(self, key: str, expected: int, actual: int) -> None:
        super().__init__(key, expected, actual)
        self.key = key
        self.expected = expected
        self.actual = actual

    def __str__(self) -> str:
        return f"{self.key!r}: expected revision {self.expected}, found {self.actual}"


class LeaseNotFoundError(StoreError):
    """The lease does not exist: it was never granted, expired or was revoked."""


class CompactedError(StoreError):
    """The requested revision is older than the history the store keeps."""


class Store(Protocol):
    """An etcd-like transactional key-value store with watches and leases."""

    async def get(self, key: str) -> KeyValue | None:
        """The key, or ``None`` when it does not exist."""
        ...

    async def range(self, prefix: str, *, start_after: str = "", limit: int = 0) -> list[KeyValue]:
        """Keys starting with ``prefix``, sorted by key.

        Args:
            prefix: Key prefix; ``""`` selects every key.
            start_after: Only keys strictly greater than this (for paging).
            limit: At most this many keys; 0 means no limit.
        """
        ...

    async def count(self, prefix: str) -> int:
        """How many keys start with ``prefix``."""
        ...

    async def commit(self, ops: Sequence[Op]) -> int:
        """Apply ``ops`` atomically as one new store revision.

        Every expectation is checked before anything is written; if one fails nothing is.
        A commit that changes nothing (no ops, only checks, or only deletes of missing keys)
        does not advance the revision, as in etcd.

        Returns:
            The store revision after the commit.

        Raises:
            CasConflictError: An op's ``expect_revision`` (a ``Check``'s included) did not hold.
            LeaseNotFoundError: A ``Put`` names a lease that does not exist.
            ValueError: An op has an empty key, or two ops name the same key.
        """
        ...

    async def revision(self) -> int:
        """The current store revision (0 before the first change)."""
        ...

    def watch(self, prefix: str, *, start_revision: int = 0) -> AsyncIterator[WatchEvent]:
        """Changes to keys starting with ``prefix``, in revision order, until the caller stops.

        Args:
            prefix: Key prefix; ``""`` watches every key.
            start_revision: Replay history from this revision on, then follow new changes;
                0 means only changes committed after this call.

        Raises:
            CompactedError: On iteration, when history from ``start_revision`` (or from where a
                slow watcher got to) has been compacted away.
        """
        ...

    async def grant_lease(self, ttl_s: float) -> int:
        """Create a lease that expires ``ttl_s`` seconds from now unless kept alive."""
        ...

    async def keepalive(self, lease: int) -> None:
        """Restart the lease's ttl; raises ``LeaseNotFoundError`` when it is gone."""
        ...

    async def revoke(self, lease: int) -> None:
        """End the lease now, deleting its keys; raises ``LeaseNotFoundError`` when it is gone."""
        ...

    async def close(self) -> None:
        """Release resources; later calls and open watches raise ``StoreError``."""
        ...


def check_ops(ops: Sequence[Op]) -> None:
    """Reject ops that etcd would refuse, so that every implementation behaves alike.

    Raises:
        ValueError: An op has an empty key, a negative revision or lease, or two ops name the
            same key (etcd rejects duplicate keys in one transaction; a ``Check`` counts too,
            as a ``Put`` or ``Delete`` with ``expect_revision`` already compares its key).
    """
    seen: set[str] = set()
    for op in ops:
        if not op.key:
            raise ValueError("store keys must not be empty")
        if op.key in seen:
            raise ValueError(f"key {op.key!r} appears twice in one commit")
        seen.add(op.key)
        if op.expect_revision is not None and op.expect_revision < 0:
            raise ValueError(f"negative expect_revision for {op.key!r}")
        if isinstance(op, Put) and op.lease < 0:
            raise ValueError(f"negative lease for {op.key!r}")
