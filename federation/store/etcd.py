"""``Store`` on an etcd v3 cluster, for several coordinators sharing one durable state.

The store speaks etcd's gRPC API through the protocol layer of ``aetcd`` (its generated
``etcdserverpb`` stubs and messages) on a ``grpc.aio`` channel built here. aetcd's own
``Client`` is not used: it always dials in plaintext, takes one endpoint and cannot limit a
range, and this store needs mutual TLS, several endpoints and paging.

Every key lives under a prefix, so several federations can share one etcd: ``Put("/jobs/a")``
in a store opened with ``prefix="/federation"`` writes etcd key ``/federation/jobs/a``. Keys
are joined by plain concatenation, as etcd's own namespaces are, so two stores are kept apart
only when neither prefix is a prefix of the other's keys (``/federation/eu`` and
``/federation/us`` are; ``/federation`` and ``/federation2`` are not).

Where this store differs from ``SqliteStore``:

* Revisions are etcd's, counted across the whole cluster: a write by another store on the same
  etcd, under any prefix, advances ``revision()`` too, and a fresh etcd starts at 1.
* Watch history lasts until etcd compacts it (``--auto-compaction-*``), not for a fixed
  number of revisions; a watch from before that raises ``CompactedError``.
* ``watch(start_revision=0)`` starts after the newest revision this store has seen in any
  response from etcd. For a caller that uses only this store that is "after this call"; a
  change another client committed since this store last heard from etcd is replayed.
* Lease ttls are whole seconds: ``grant_lease`` rounds up, and etcd raises a ttl below its
  minimum (1.5 election timeouts, 2 s with etcd's defaults) to that minimum.
* etcd limits one transaction (``--max-txn-ops``, 128 by default) and one request
  (``--max-request-bytes``, 1.5 MiB by default); a larger commit raises ``StoreError``.
* A watch whose connection breaks raises ``StoreError``; watch again from the revision after
  the last event received.
* A write that fails because etcd became unreachable may or may not have been applied: read
  the keys back before repeating it. Reads are retried on the next endpoint; writes never are.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
import structlog
from aetcd import rpc  # type: ignore[import-untyped]

from federation.metrics import STORE_COMMIT_SECONDS
from federation.security.tls import TlsFiles, channel_credentials
from federation.store.base import (
    CasConflictError,
    CommitTooLargeError,
    CompactedError,
    Delete,
    KeyValue,
    LeaseNotFoundError,
    Op,
    Put,
    StoreError,
    StoreUnreachableError,
    WatchEvent,
    WatchEventType,
    check_ops,
)

if TYPE_CHECKING:
    from federation.store.base import Store

log = structlog.get_logger()

DEFAULT_PREFIX = "/federation"
"""Where a store keeps its keys unless told otherwise."""

_UNREACHABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_CHANNEL_OPTIONS = (
    # A long range can exceed gRPC's 4 MiB default; etcd's own client lifts the limit too.
    ("grpc.max_receive_message_length", -1),
    # Come back within seconds once etcd does, not after gRPC's default backoff of up to 2 min.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2_000),
    # Notice a dead connection under an idle watch. etcd refuses pings more often than 5 s.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
)
# What etcd says, and how to fix it, for refusals that come from its configuration.
_HINTS = {
    "too many operations in txn request": "commit fewer ops or raise etcd's --max-txn-ops",
    "request is too large": "commit less data or raise etcd's --max-request-bytes",
    "database space exceeded": "compact and defragment etcd, or raise --quota-backend-bytes",
}
_TOO_LARGE = ("too many operations in txn request", "request is too large")
"""Refusals of a commit for its size: the same commit never passes."""


@dataclass(frozen=True, slots=True)
class _Connection:
    """One endpoint's channel and the etcd services on it."""

    endpoint: str
    channel: grpc.aio.Channel
    kv: Any
    lease: Any
    watch: Any


def _target(endpoint: str, tls: TlsFiles | None) -> str:
    """The gRPC target for ``endpoint``, which may carry an etcd-style URL scheme."""
    scheme, sep, address = endpoint.rpartition("://")
    if not sep:
        return endpoint
    if scheme == "https" and tls is None:
        raise ValueError(f"etcd endpoint {endpoint} uses https: give tls files")
    if scheme == "http" and tls is not None:
        raise ValueError(f"etcd endpoint {endpoint} uses http but tls files were given")
    if scheme not in ("http", "https"):
        raise ValueError(f"etcd endpoint {endpoint}: scheme must be http or https")
    return address.rstrip("/")


def _connect(endpoint: str, tls: TlsFiles | None) -> _Connection:
    target = _target(endpoint, tls)
    if tls is None:
        channel = grpc.aio.insecure_channel(target, options=_CHANNEL_OPTIONS)
    else:
        channel = grpc.aio.secure_channel(target, channel_credentials(tls), _CHANNEL_OPTIONS)
    return _Connection(
        endpoint, channel, rpc.KVStub(channel), rpc.LeaseStub(channel), rpc.WatchStub(channel)
    )


def _prefix_end(prefix: bytes) -> bytes:
    """The end of etcd's range of keys starting with ``prefix``; ``b"\\0"`` means unbounded."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


def _is_unreachable(err: grpc.aio.AioRpcError) -> bool:
    return err.code() in _UNREACHABLE


class EtcdStore:
    """``Store`` on etcd v3; create it with ``await EtcdStore.open(endpoints)``.

    Args:
        connections: One connection per endpoint, in the order to try them.
        prefix: Prepended to every key in etcd.
        timeout_s: Deadline of each request to etcd.
    """

    def __init__(self, connections: Sequence[_Connection], prefix: str, timeout_s: float) -> None:
        self._connections = tuple(connections)
        self._current = 0  # the connection requests go to; moves on when it is unreachable
        self._namespace = prefix.encode()
        self._timeout_s = timeout_s
        self._revision = 0  # the newest revision seen in any response
        self._closed = False

    @classmethod
    async def open(
        cls,
        endpoints: Sequence[str],
        *,
        prefix: str = DEFAULT_PREFIX,
        tls: TlsFiles | None = None,
        timeout_s: float = 10.0,
    ) -> EtcdStore:
        """Connect to etcd, using the first endpoint that answers.

        Args:
            endpoints: Members of one etcd cluster, as ``host:port`` or etcd-style URLs
                (``http://host:port``, or ``https://host:port`` with ``tls``).
            prefix: Prepended to every key in etcd; see the module docstring.
            tls: Client certificate, key and the CA that etcd's certificate must chain to;
                ``None`` for plaintext.
            timeout_s: Deadline of each request to etcd, and of this first contact.

        Returns:
            The connected store.

        Raises:
            StoreError: No endpoint answered, or etcd refused the first request.
            ValueError: No endpoints, a non-positive timeout, or an endpoint's scheme that does
                not match ``tls``.
            OSError: A file in ``tls`` cannot be read.
        """
        if not endpoints:
            raise ValueError("give at least one etcd endpoint")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        store = cls([_connect(e, tls) for e in endpoints], prefix, timeout_s)
        try:
            await store._probe()
        except BaseException:
            await store.close()
            raise
        log.info(
            "etcd_store_opened",
            endpoint=store._connections[store._current].endpoint,
            prefix=prefix,
            revision=store._revision,
        )
        return store

    async def _probe(self) -> None:
        """Make the first endpoint that answers the current one."""
        failures = []
        for index, conn in enumerate(self._connections):
            try:
                await self._range_request(conn, rpc.RangeRequest(key=b"\0", count_only=True))
            except grpc.aio.AioRpcError as err:
                if not _is_unreachable(err):
                    raise self._translate(err, "the first request", conn.endpoint) from err
                failures.append(f"{conn.endpoint}: {err.details()}")
            else:
                self._current = index
                return
        raise StoreUnreachableError(
            f"cannot reach etcd ({'; '.join(failures)}). To fix: check that etcd is running "
            "and listening there, and that the TLS settings match its own"
        )

    async def _range_request(self, conn: _Connection, request: Any) -> Any:
        response = await conn.kv.Range(request, timeout=self._timeout_s)
        self._see(response.header)
        return response

    # Plumbing.

    def _see(self, header: Any) -> None:
        self._revision = max(self._revision, int(header.revision))

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("store is closed")

    async def _call(
        self, request: Callable[[_Connection], Awaitable[Any]], what: str, *, retry: bool = False
    ) -> Any:
        """Send ``request`` to the current endpoint and translate its errors.

        Args:
            request: Sends one request on the connection it is given.
            what: What the request does, for error messages.
            retry: The request may be repeated safely, so try the other endpoints when the
                current one is unreachable. A write is never repeated: it may have been applied
                before the connection broke.
        """
        self._check_open()
        attempts = len(self._connections) if retry else 1
        for attempt in range(attempts):
            index = self._current
            conn = self._connections[index]
            try:
                return await request(conn)
            except grpc.aio.AioRpcError as err:
                self._check_open()  # a call that closing the store cut short
                if _is_unreachable(err):
                    self._fail_over(index)
                    if attempt + 1 < attempts:
                        continue
                raise self._translate(err, what, conn.endpoint) from err
            except asyncio.CancelledError:
                self._raise_if_closed_under_us()
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _fail_over(self, index: int) -> None:
        """Send later requests to the next endpoint, unless another request already did."""
        if len(self._connections) > 1 and self._current == index:
            self._current = (index + 1) % len(self._connections)
            log.warning(
                "etcd_endpoint_failed",
                endpoint=self._connections[index].endpoint,
                next_endpoint=self._connections[self._current].endpoint,
            )

    def _raise_if_closed_under_us(self) -> None:
        """Closing the channels cancels their calls; report that as a closed store.

        A cancellation of the caller's own task is left alone.
        """
        task = asyncio.current_task()
        if self._closed and (task is None or not task.cancelling()):
            raise StoreError("store is closed") from None

    @staticmethod
    def _translate(err: grpc.aio.AioRpcError, what: str, endpoint: str) -> StoreError:
        """The store error for a request to ``endpoint`` that failed with ``err``."""
        code, details = err.code(), err.details() or ""
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in details:
            return LeaseNotFoundError(details.removeprefix("etcdserver: "))
        if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
            return CompactedError(details.removeprefix("etcdserver: "))
        if code in _UNREACHABLE:
            return StoreError(
                f"etcd is unreachable ({what}, {code.name}: {details}). To fix: check that etcd "
                f"runs at {endpoint} and has a quorum"
            )
        hint = next((fix for text, fix in _HINTS.items() if text in details), "")
        refused = f"etcd refused {what} ({code.name}: {details})" + (f": {hint}" if hint else "")
        if any(text in details for text in _TOO_LARGE):
            return CommitTooLargeError(refused)
        return StoreError(refused)

    def _key(self, key: str) -> bytes:
        return self._namespace + key.encode()

    def _range_bounds(self, prefix: str, start_after: str = "") -> tuple[bytes, bytes]:
        """etcd's ``[key, range_end)`` for keys under ``prefix`` and above ``start_after``."""
        base = self._key(prefix)
        low, end = base or b"\0", _prefix_end(base)  # b"\0" is the smallest etcd key
        if start_after:
            low = max(low, self._key(start_after) + b"\0")  # the smallest key above it
        return low, end

    def _key_value(self, kv: Any) -> KeyValue:
        return KeyValue(
            key=bytes(kv.key)[len(self._namespace) :].decode(),
            value=bytes(kv.value),
            create_revision=int(kv.create_revision),
            mod_revision=int(kv.mod_revision),
            lease=int(kv.lease),
        )

    def _event(self, event: Any) -> WatchEvent:
        if event.type == rpc.Event.DELETE:
            key = bytes(event.kv.key)[len(self._namespace) :].decode()
            return WatchEvent(
                WatchEventType.DELETE, KeyValue(key, b"", 0, int(event.kv.mod_revision))
            )
        return WatchEvent(WatchEventType.PUT, self._key_value(event.kv))

    # Reads.

    async def get(self, key: str) -> KeyValue | None:
        """The key, or ``None`` when it does not exist."""
        request = rpc.RangeRequest(key=self._key(key))
        response = await self._call(
            lambda c: self._range_request(c, request), f"reading {key!r}", retry=True
        )
        return self._key_value(response.kvs[0]) if response.kvs else None

    async def range(self, prefix: str, *, start_after: str = "", limit: int = 0) -> list[KeyValue]:
        """Keys starting with ``prefix`` after ``start_after``, sorted; ``limit`` 0 means all."""
        if limit < 0:
            raise ValueError("limit must not be negative")
        low, end = self._range_bounds(prefix, start_after)
        # etcd returns a range in key order when no other order is asked for.
        request = rpc.RangeRequest(key=low, range_end=end, limit=limit)
        response = await self._call(
            lambda c: self._range_request(c, request), f"listing {prefix!r}", retry=True
        )
        return [self._key_value(kv) for kv in response.kvs]

    async def count(self, prefix: str) -> int:
        """How many keys start with ``prefix``."""
        low, end = self._range_bounds(prefix)
        request = rpc.RangeRequest(key=low, range_end=end, count_only=True)
        response = await self._call(
            lambda c: self._range_request(c, request), f"counting {prefix!r}", retry=True
        )
        return int(response.count)

    async def revision(self) -> int:
        """etcd's current revision (shared by every prefix on the cluster)."""
        request = rpc.RangeRequest(key=b"\0", count_only=True)
        response = await self._call(
            lambda c: self._range_request(c, request), "reading the revision", retry=True
        )
        return int(response.header.revision)

    # Writes.

    async def commit(self, ops: Sequence[Op]) -> int:
        """Apply ``ops`` atomically as one etcd transaction; see ``Store.commit``."""
        check_ops(ops)
        if not ops:
            return await self.revision()
        compares: list[Any] = []
        success: list[Any] = []
        failure: list[Any] = []
        checked: list[Op] = []
        for op in ops:
            key = self._key(op.key)
            if op.expect_revision is not None:
                checked.append(op)
                compares.append(_compare(key, op.expect_revision))
                # Read back in the same transaction, so the conflict names the revision that
                # made the compare fail rather than whatever is there a moment later.
                failure.append(
                    rpc.RequestOp(request_range=rpc.RangeRequest(key=key, keys_only=True))
                )
            if isinstance(op, Put):
                put = rpc.PutRequest(key=key, value=op.value, lease=op.lease)
                success.append(rpc.RequestOp(request_put=put))
            elif isinstance(op, Delete):
                success.append(rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key)))
            # A Check is a compare only: it adds nothing to the success branch.
        request = rpc.TxnRequest(compare=compares, success=success, failure=failure)
        with STORE_COMMIT_SECONDS.labels("etcd").time():  # retries on another member included
            response = await self._call(
                lambda c: c.kv.Txn(request, timeout=self._timeout_s), f"a commit of {len(ops)} ops"
            )
        self._see(response.header)
        if not response.succeeded:
            raise _conflict(checked, response.responses)
        # A transaction that changed nothing does not advance the revision, as in SQLite.
        return int(response.header.revision)

    # Watches.

    def watch(self, prefix: str, *, start_revision: int = 0) -> AsyncIterator[WatchEvent]:
        """Changes under ``prefix`` from ``start_revision`` on; 0: after the newest seen."""
        if start_revision < 0:
            raise ValueError("start_revision must not be negative")
        # Fixed now rather than on first iteration, so that 0 means "after this call".
        return self._follow(prefix, start_revision or self._revision + 1)

    async def _follow(self, prefix: str, start_revision: int) -> AsyncIterator[WatchEvent]:
        self._check_open()
        low, end = self._range_bounds(prefix)
        create = rpc.WatchCreateRequest(key=low, range_end=end, start_revision=start_revision)
        conn = self._connections[self._current]
        call = conn.watch.Watch()
        try:
            await call.write(rpc.WatchRequest(create_request=create))
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    raise StoreError(f"etcd at {conn.endpoint} ended a watch on {prefix!r}")
                self._see(response.header)
                if response.compact_revision:
                    raise CompactedError(
                        f"revision {start_revision} was compacted; etcd keeps history from "
                        f"revision {response.compact_revision}"
                    )
                if response.canceled:
                    raise StoreError(f"etcd cancelled a watch: {response.cancel_reason}")
                for event in response.events:
                    self._check_open()  # nothing more after close, not even what is buffered
                    yield self._event(event)
        except grpc.aio.AioRpcError as err:
            self._check_open()
            if _is_unreachable(err):
                self._fail_over(self._connections.index(conn))
            raise self._translate(err, f"watching {prefix!r}", conn.endpoint) from err
        except asyncio.CancelledError:
            self._raise_if_closed_under_us()
            raise
        finally:
            call.cancel()

    # Leases.

    async def compact(self, revision: int) -> None:
        """Drop the history before ``revision`` (kept values stay); compacting a revision
        already compacted does nothing."""
        request = rpc.CompactionRequest(revision=revision)
        with contextlib.suppress(CompactedError):
            await self._call(
                lambda c: c.kv.Compact(request, timeout=self._timeout_s),
                "compacting history",
                retry=True,  # compacting twice is compacting once
            )

    async def grant_lease(self, ttl_s: float) -> int:
        """A new etcd lease of ``ttl_s`` rounded up to whole seconds (etcd may raise it more)."""
        if ttl_s <= 0:
            raise ValueError("lease ttl must be positive")
        request = rpc.LeaseGrantRequest(TTL=math.ceil(ttl_s))
        response = await self._call(
            lambda c: c.lease.LeaseGrant(request, timeout=self._timeout_s), "granting a lease"
        )
        self._see(response.header)
        if response.error:
            raise StoreError(f"etcd refused a lease: {response.error}")
        return int(response.ID)

    async def keepalive(self, lease: int) -> None:
        """Restart the lease's ttl; raises ``LeaseNotFoundError`` when it is gone."""

        async def refresh(conn: _Connection) -> Any:
            call = conn.lease.LeaseKeepAlive(timeout=self._timeout_s)
            try:
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease))
                return await call.read()
            finally:
                call.cancel()

        response = await self._call(refresh, f"keeping lease {lease} alive", retry=True)
        if response is grpc.aio.EOF:
            raise StoreError(f"etcd ended the keepalive of lease {lease} without an answer")
        self._see(response.header)
        if response.TTL <= 0:  # etcd's answer for a lease that expired or never existed
            raise LeaseNotFoundError(f"lease {lease} not found")

    async def revoke(self, lease: int) -> None:
        """End the lease and delete its keys; raises ``LeaseNotFoundError`` when it is gone."""
        request = rpc.LeaseRevokeRequest(ID=lease)
        response = await self._call(
            lambda c: c.lease.LeaseRevoke(request, timeout=self._timeout_s),
            f"revoking lease {lease}",
        )
        self._see(response.header)

    async def compact_history(self, keep_s: float) -> None:
        """Keep about ``keep_s`` of history: each period, compact to the revision the previous
        period ended at. Runs until cancelled; a failed round is logged and tried again."""
        previous = 0
        while True:
            try:
                current = await self.revision()
                if previous:
                    await self.compact(previous)
                previous = current
            except StoreError as err:
                log.warning("etcd_compaction_failed", error=str(err))
            await asyncio.sleep(keep_s)

    async def close(self) -> None:
        """Close the channels; open watches and later calls raise ``StoreError``."""
        if self._closed:
            return
        self._closed = True
        await asyncio.gather(*(conn.channel.close() for conn in self._connections))


def _compare(key: bytes, expect_revision: int) -> Any:
    """The etcd compare for one op's ``expect_revision``."""
    if expect_revision == 0:  # a key that does not exist has version 0
        return rpc.Compare(result=rpc.Compare.EQUAL, target=rpc.Compare.VERSION, key=key, version=0)
    return rpc.Compare(
        result=rpc.Compare.EQUAL, target=rpc.Compare.MOD, key=key, mod_revision=expect_revision
    )


def _conflict(checked: Sequence[Op], responses: Sequence[Any]) -> StoreError:
    """The error for a failed transaction, from the keys its failure branch read back."""
    for op, response in zip(checked, responses, strict=True):
        kvs = response.response_range.kvs
        actual = int(kvs[0].mod_revision) if kvs else 0
        if op.expect_revision != actual:
            return CasConflictError(op.key, op.expect_revision or 0, actual)
    return StoreError("etcd refused a commit although every expected revision matched")


if TYPE_CHECKING:
    _: type[Store] = EtcdStore
