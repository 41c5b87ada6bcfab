"""``Store`` on a local SQLite file, for a coordinator that runs as a single process.

Every SQLite call runs on one worker thread that owns the only connection, so the event loop
never blocks on disk and commits are serialised without further locking. Writes use
``BEGIN IMMEDIATE`` transactions in WAL mode with ``synchronous=FULL``: once ``commit`` returns,
the change survives a killed process or a power loss.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sqlite3
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

import structlog

from federation.metrics import STORE_COMMIT_SECONDS
from federation.store.base import (
    CasConflictError,
    CompactedError,
    Delete,
    KeyValue,
    LeaseNotFoundError,
    Op,
    Put,
    StoreError,
    WatchEvent,
    WatchEventType,
    check_ops,
)

if TYPE_CHECKING:
    from federation.store.base import Store

log = structlog.get_logger()

_P = ParamSpec("_P")
_T = TypeVar("_T")

SCHEMA_VERSION = 1
_LOCK_TIMEOUT_S = 1.0  # how long opening waits for a file another process holds
HISTORY_BYTES = 64 << 20
"""Default for the bytes of values the history keeps for watches."""
_WATCH_BATCH = 1_000  # revisions per watch query, so a lagging watcher reads in bounded chunks
_SWEEP_RETRY_S = 1.0
_WRITTEN_KEPT = 1024
"""Commits whose changed keys' heads the store remembers, for watchers (``_untouched``)."""

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS kv (
        key TEXT PRIMARY KEY,
        value BLOB NOT NULL,
        create_revision INTEGER NOT NULL,
        mod_revision INTEGER NOT NULL,
        lease INTEGER NOT NULL DEFAULT 0
    )""",
    "CREATE INDEX IF NOT EXISTS kv_by_lease ON kv (lease) WHERE lease != 0",
    "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL)",
    # seq orders the changes within one revision as the commit listed them.
    """CREATE TABLE IF NOT EXISTS changes (
        revision INTEGER NOT NULL,
        seq INTEGER NOT NULL,
        key TEXT NOT NULL,
        type INTEGER NOT NULL,
        value BLOB NOT NULL,
        create_revision INTEGER NOT NULL,
        lease INTEGER NOT NULL,
        PRIMARY KEY (revision, seq)
    )""",
    """CREATE TABLE IF NOT EXISTS leases (
        id INTEGER PRIMARY KEY,
        ttl_s REAL NOT NULL,
        expires_at REAL NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS leases_by_expiry ON leases (expires_at)",
    # revision: the store revision; compacted: newest revision dropped from `changes`;
    # last_lease: the newest lease id, so ids are never reused.
    "INSERT OR IGNORE INTO meta VALUES ('revision', 0), ('compacted', 0), ('last_lease', 0)",
    f"PRAGMA user_version = {SCHEMA_VERSION}",
)

_KV_COLUMNS = "key, value, create_revision, mod_revision, lease"
_UPSERT = (
    f"INSERT INTO kv ({_KV_COLUMNS}) VALUES (?, ?, ?, ?, ?) ON CONFLICT (key) DO UPDATE SET"
    " value = excluded.value, mod_revision = excluded.mod_revision, lease = excluded.lease"
)
_KEYS_PER_READ = 500
"""Keys a revision read names at most (SQLite limits a statement's parameters)."""
_Change = tuple[int, int, str, int, bytes, int, int]
"""A row of the changes table: revision, seq, key, kind, value, create_revision, lease."""
_PUT, _DELETE = WatchEventType.PUT.value, WatchEventType.DELETE.value
# An expired lease's keys stay in `kv` until the sweeper deletes them but must already be
# invisible to readers.
_LIVE = "(lease = 0 OR EXISTS (SELECT 1 FROM leases WHERE id = kv.lease AND expires_at > :now))"


def _now() -> float:
    """Wall-clock time for lease expiry (a function so tests can move the clock)."""
    return time.time()


def _prefix_end(prefix: str) -> str | None:
    """The smallest key above every key starting with ``prefix``; ``None`` when unbounded."""
    chars = list(prefix)
    while chars:
        code = ord(chars.pop()) + 1
        if code == 0xD800:  # surrogates cannot be stored, so skip past them
            code = 0xE000
        if code <= 0x10FFFF:
            return "".join(chars) + chr(code)
    return None


def _prefix_filter(prefix: str, start_after: str = "") -> tuple[str, dict[str, Any]]:
    """An SQL condition on ``key`` for keys under ``prefix`` and above ``start_after``."""
    # One lower bound only: given two, SQLite may seek with the looser one and scan from there,
    # which makes every page of a long listing start at the first key.
    if start_after >= prefix:
        lower, params = "key > :lo", {"lo": start_after}
    else:
        lower, params = "key >= :lo", {"lo": prefix}
    end = _prefix_end(prefix)
    if end is None:
        return lower, params
    return f"{lower} AND key < :hi", params | {"hi": end}


def head(key: str) -> str:
    """The key up to the end of its first segment (``/jobs/`` of ``/jobs/j-1``; a key of one
    segment whole): a key is under a prefix only if the one of its head and the prefix starts
    with the other."""
    end = key.find("/", 1)
    return key if end < 0 else key[: end + 1]


def _may_hold(heads: frozenset[str], prefix: str) -> bool:
    """Whether keys whose heads (``head``) are ``heads`` may lie under ``prefix``."""
    return any(h.startswith(prefix) or prefix.startswith(h) for h in heads)


def _deletion(revision: int, seq: int, key: str) -> _Change:
    """The change that records deleting ``key``, ``seq``-th in its revision."""
    return (revision, seq, key, _DELETE, b"", 0, 0)


def _event(row: Any) -> WatchEvent:
    revision, key, kind, value, create_revision, lease = row
    return WatchEvent(WatchEventType(kind), KeyValue(key, value, create_revision, revision, lease))


class _Database:
    """Synchronous access to the SQLite file; used only on the store's worker thread.

    Args:
        path: The database file.
        history: How many of the newest revisions ``changes`` keeps for watches.
        history_bytes: The most value bytes ``changes`` keeps: past it, the oldest revisions
            go even within ``history``, so large values are not kept thousands of times over.
        on_change: Called after each commit that advanced the store revision, with the first
            and the last revision it made and the ``head`` of every key they changed.
    """

    def __init__(
        self,
        path: Path,
        history: int,
        history_bytes: int,
        on_change: Callable[[int, int, frozenset[str]], None],
    ) -> None:
        self._history = history
        self._history_bytes = history_bytes
        self._kept_bytes = 0  # value bytes in `changes`, kept in step with it
        self._on_change = on_change
        self._heads: set[str] = set()  # of the keys the transaction under way changed
        self._revision = self._compacted = 0  # loaded from `meta` once the schema exists
        self._conn = sqlite3.connect(path, timeout=_LOCK_TIMEOUT_S, isolation_level=None)
        try:
            self._setup(path)
        except BaseException:
            self._conn.close()
            raise
        self._revision = self._meta("revision")
        self._compacted = self._meta("compacted")
        (self._kept_bytes,) = self._conn.execute(
            "SELECT COALESCE(SUM(LENGTH(value)), 0) FROM changes"
        ).fetchone()

    def _setup(self, path: Path) -> None:
        conn = self._conn
        # Exclusive locking keeps a second process (a second coordinator) off the file; set
        # before WAL, it also keeps the WAL index in private memory instead of a -shm file.
        conn.execute("PRAGMA locking_mode=EXCLUSIVE")
        mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if mode != "wal":
            raise StoreError(f"{path}: cannot use WAL journaling (got {mode!r})")
        # FULL syncs the WAL on every commit; NORMAL could lose the last commits on power loss.
        conn.execute("PRAGMA synchronous=FULL")
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise StoreError(f"{path}: schema version {version} is newer than this code")

        def create_schema() -> None:
            for statement in _SCHEMA:
                conn.execute(statement)

        self._transaction(create_schema)

    def close(self) -> None:
        self._conn.close()

    def revision(self) -> int:
        return self._revision

    def backup(self, path: Path) -> int:
        """Copy the database to ``path`` (a new file) as it is now; returns its revision.
        On the worker thread, so no commit lands halfway through the copy."""
        if path.exists():
            raise StoreError(f"{path} exists: a backup goes to a new file")
        target = sqlite3.connect(path)
        try:
            self._conn.backup(target)
        finally:
            target.close()
        return self._revision

    # Reads.

    def get(self, key: str) -> KeyValue | None:
        row = self._conn.execute(
            f"SELECT {_KV_COLUMNS} FROM kv WHERE key = :key AND {_LIVE}",
            {"key": key, "now": _now()},
        ).fetchone()
        return None if row is None else KeyValue(*row)

    def range(self, prefix: str, start_after: str, limit: int) -> list[KeyValue]:
        where, params = _prefix_filter(prefix, start_after)
        rows = self._conn.execute(
            f"SELECT {_KV_COLUMNS} FROM kv WHERE {where} AND {_LIVE} ORDER BY key LIMIT :limit",
            params | {"now": _now(), "limit": limit or -1},
        )
        return [KeyValue(*row) for row in rows]

    def count(self, prefix: str) -> int:
        where, params = _prefix_filter(prefix)
        row = self._conn.execute(
            f"SELECT COUNT(*) FROM kv WHERE {where} AND {_LIVE}", params | {"now": _now()}
        ).fetchone()
        return int(row[0])

    def changes(
        self, prefix: str, from_revision: int, max_revisions: int
    ) -> tuple[list[WatchEvent], int]:
        """Changes under ``prefix`` from ``from_revision`` on, and the last revision examined."""
        if from_revision <= self._compacted:
            raise CompactedError(
                f"revision {from_revision} was compacted; history starts at {self._compacted + 1}"
            )
        through = min(self._revision, from_revision + max_revisions - 1)
        where, params = _prefix_filter(prefix)
        rows = self._conn.execute(
            "SELECT revision, key, type, value, create_revision, lease FROM changes"
            f" WHERE revision BETWEEN :first AND :last AND {where} ORDER BY revision, seq",
            params | {"first": from_revision, "last": through},
        )
        return [_event(row) for row in rows], through

    # Writes.

    def commit(self, ops: Sequence[Op]) -> int:
        self._expire_due(_now())
        return self._transaction(lambda: self._apply(ops))

    def commit_many(self, batch: Sequence[Sequence[Op]]) -> list[int | StoreError]:
        """Group commit: each op list is its own atomic commit with its own revision, but all
        share one SQLite transaction (one fsync). A lost compare-and-swap undoes only its own
        commit (a savepoint); any other failure fails them all."""
        self._expire_due(_now())

        def body() -> list[int | StoreError]:
            results: list[int | StoreError] = []
            for ops in batch:
                revision = self._revision
                self._conn.execute("SAVEPOINT one_commit")
                try:
                    results.append(self._apply(ops))
                except (CasConflictError, LeaseNotFoundError) as err:
                    self._conn.execute("ROLLBACK TO one_commit")
                    self._revision = revision
                    results.append(err)
                self._conn.execute("RELEASE one_commit")
            return results

        return self._transaction(body)

    def grant_lease(self, ttl_s: float) -> int:
        now = _now()
        self._expire_due(now)
        return self._transaction(lambda: self._grant(ttl_s, now))

    def keepalive(self, lease: int) -> None:
        now = _now()
        self._expire_due(now)  # so that an expired lease cannot be revived
        self._transaction(lambda: self._extend(lease, now))

    def revoke(self, lease: int) -> None:
        self._expire_due(_now())
        self._transaction(lambda: self._revoke(lease))

    def expire_leases(self) -> float | None:
        """Drop every due lease with its keys; returns when the next lease is due, if any."""
        self._expire_due(_now())
        row = self._conn.execute("SELECT MIN(expires_at) FROM leases").fetchone()
        return None if row[0] is None else float(row[0])

    def _transaction(self, body: Callable[[], _T]) -> _T:
        """Run ``body`` in one write transaction that commits only if it returns."""
        before = self._revision, self._compacted, self._kept_bytes
        self._heads = set()
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            result = body()
            if self._revision != before[0]:
                self._set_meta("revision", self._revision)
                self._compact()
            self._conn.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            self._revision, self._compacted, self._kept_bytes = before
            raise
        if self._revision != before[0]:
            self._on_change(before[0] + 1, self._revision, frozenset(self._heads))
        return result

    def _apply(self, ops: Sequence[Op]) -> int:
        # Every compare before any write, as an etcd transaction does. The keys' revisions
        # are read together and the writes made together: a statement per key cost more than
        # the rows themselves.
        current = self._revisions([op.key for op in ops])
        for op in ops:
            if op.expect_revision is not None:
                found = current.get(op.key, (0, 0))[0]
                if op.expect_revision != found:
                    raise CasConflictError(op.key, op.expect_revision, found)
        for op in ops:
            if isinstance(op, Put) and op.lease and not self._lease_exists(op.lease):
                raise LeaseNotFoundError(f"lease {op.lease} not found")
        revision = self._revision + 1
        changes: list[_Change] = []
        puts: list[tuple[str, bytes, int, int, int]] = []
        deletes: list[str] = []
        for op in ops:
            if isinstance(op, Put):
                # An existing key keeps its create_revision.
                created = current[op.key][1] if op.key in current else revision
                puts.append((op.key, op.value, created, revision, op.lease))
                changes.append((revision, len(changes), op.key, _PUT, op.value, created, op.lease))
            elif isinstance(op, Delete) and op.key in current:
                deletes.append(op.key)
                changes.append(_deletion(revision, len(changes), op.key))
            # else: a check, or deleting a missing key, changes nothing
        if puts:
            self._conn.executemany(_UPSERT, puts)
        self._delete_keys(deletes)
        if changes:
            self._record(changes)
            self._revision = revision
        return self._revision

    def _revisions(self, keys: Sequence[str]) -> dict[str, tuple[int, int]]:
        """(mod_revision, create_revision) of each of ``keys`` that exists."""
        found: dict[str, tuple[int, int]] = {}
        for at in range(0, len(keys), _KEYS_PER_READ):
            chunk = keys[at : at + _KEYS_PER_READ]
            rows = self._conn.execute(
                "SELECT key, mod_revision, create_revision FROM kv"
                f" WHERE key IN ({', '.join('?' * len(chunk))})",
                chunk,
            )
            found.update((key, (mod, created)) for key, mod, created in rows)
        return found

    def _grant(self, ttl_s: float, now: float) -> int:
        lease = self._meta("last_lease") + 1
        self._set_meta("last_lease", lease)
        self._conn.execute("INSERT INTO leases VALUES (?, ?, ?)", (lease, ttl_s, now + ttl_s))
        return lease

    def _extend(self, lease: int, now: float) -> None:
        cursor = self._conn.execute(
            "UPDATE leases SET expires_at = ? + ttl_s WHERE id = ?", (now, lease)
        )
        if cursor.rowcount == 0:
            raise LeaseNotFoundError(f"lease {lease} not found")

    def _revoke(self, lease: int) -> None:
        if not self._lease_exists(lease):
            raise LeaseNotFoundError(f"lease {lease} not found")
        self._drop_lease(lease)

    def _expire_due(self, now: float) -> None:
        """Drop due leases in a transaction of their own, before the caller's transaction."""
        rows = self._conn.execute(
            "SELECT id FROM leases WHERE expires_at <= ? ORDER BY expires_at, id", (now,)
        )
        due = [row[0] for row in rows]

        def drop_due() -> None:
            for lease in due:
                self._drop_lease(lease)

        if due:
            self._transaction(drop_due)

    def _drop_lease(self, lease: int) -> None:
        """Delete the lease and, as one new revision, the keys attached to it."""
        rows = self._conn.execute("SELECT key FROM kv WHERE lease = ? ORDER BY key", (lease,))
        keys = [row[0] for row in rows]
        self._conn.execute("DELETE FROM leases WHERE id = ?", (lease,))
        if keys:
            revision = self._revision + 1
            self._delete_keys(keys)
            self._record([_deletion(revision, seq, key) for seq, key in enumerate(keys)])
            self._revision = revision

    def _delete_keys(self, keys: Sequence[str]) -> None:
        self._conn.executemany("DELETE FROM kv WHERE key = ?", [(key,) for key in keys])

    def _record(self, changes: list[_Change]) -> None:
        """Keep changes in the history that watches replay."""
        self._conn.executemany("INSERT INTO changes VALUES (?, ?, ?, ?, ?, ?, ?)", changes)
        self._kept_bytes += sum(len(change[4]) for change in changes)
        self._heads.update(head(change[2]) for change in changes)

    def _compact(self) -> None:
        floor = self._revision - self._history
        if self._kept_bytes > self._history_bytes:
            floor = max(floor, self._bytes_floor())
        if floor > self._compacted:
            (dropped,) = self._conn.execute(
                "SELECT COALESCE(SUM(LENGTH(value)), 0) FROM changes WHERE revision <= ?",
                (floor,),
            ).fetchone()
            self._conn.execute("DELETE FROM changes WHERE revision <= ?", (floor,))
            self._kept_bytes -= dropped
            self._set_meta("compacted", floor)
            self._compacted = floor

    def _bytes_floor(self) -> int:
        """The oldest revisions to drop so the history keeps at most 3/4 of its byte limit
        (a margin, so the scan below runs once per quarter of the limit written, not at every
        commit); the newest revision always stays."""
        excess = self._kept_bytes - self._history_bytes * 3 // 4
        rows = self._conn.execute(
            "SELECT revision, SUM(LENGTH(value)) FROM changes WHERE revision < ?"
            " GROUP BY revision ORDER BY revision",
            (self._revision,),
        )
        floor = self._compacted
        for revision, size in rows:
            if excess <= 0:
                break
            floor, excess = revision, excess - size
        return floor

    def _lease_exists(self, lease: int) -> bool:
        row = self._conn.execute("SELECT 1 FROM leases WHERE id = ?", (lease,)).fetchone()
        return row is not None

    def _meta(self, name: str) -> int:
        row = self._conn.execute("SELECT value FROM meta WHERE name = ?", (name,)).fetchone()
        return int(row[0])

    def _set_meta(self, name: str, value: int) -> None:
        self._conn.execute("UPDATE meta SET value = ? WHERE name = ?", (value, name))


class SqliteStore:
    """``Store`` backed by one SQLite file; create it with ``await SqliteStore.open(path)``.

    Only one store (in one process) may have the file open at a time.

    Args:
        path: The database file; created when missing.
        history: How many of the newest revisions watches can replay; older history is
            compacted and watching from it raises ``CompactedError``.
        history_bytes: The most bytes of values that history keeps: past it the oldest
            revisions are compacted too (the newest always stays).
    """

    def __init__(
        self, path: Path, *, history: int = 10_000, history_bytes: int = HISTORY_BYTES
    ) -> None:
        if history < 1:
            raise ValueError("history must keep at least one revision")
        self._path = path
        self._history = history
        self._history_bytes = history_bytes
        # sqlite3 objects must stay on the thread that made them; one thread also serialises
        # every commit, which is what makes the compare checks race-free.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-store")
        self._db: _Database | None = None
        self._closed = False
        self._revision = 0  # the newest committed revision that watchers have been told of
        self._changed = asyncio.Event()  # replaced after each set: one event per announcement
        self._written: deque[tuple[int, int, frozenset[str]]] = deque(maxlen=_WRITTEN_KEPT)
        """The newest commits' first and last revisions and the heads of the keys they
        changed (``head``), oldest first: watchers of other prefixes need not read them."""
        self._lease_granted = asyncio.Event()
        self._sweeper: asyncio.Task[None] | None = None
        self._queued: list[tuple[list[Op], asyncio.Future[int]]] = []
        self._flusher: asyncio.Task[None] | None = None

    @classmethod
    async def open(
        cls, path: Path, *, history: int = 10_000, history_bytes: int = HISTORY_BYTES
    ) -> SqliteStore:
        """Open (or create) the store at ``path`` and start expiring its leases."""
        store = cls(path, history=history, history_bytes=history_bytes)
        await store._start()
        return store

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()

        def on_change(first: int, revision: int, heads: frozenset[str]) -> None:
            # Called on the worker thread right after COMMIT, so watchers are woken even when
            # the coroutine that asked for the commit has been cancelled meanwhile.
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to wake
                loop.call_soon_threadsafe(self._advance, first, revision, heads)

        try:
            self._db = await loop.run_in_executor(
                self._executor,
                _Database,
                self._path,
                self._history,
                self._history_bytes,
                on_change,
            )
        except BaseException as exc:
            self._closed = True
            self._executor.shutdown(wait=False)
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"cannot open {self._path}: {exc}") from exc
            raise
        self._revision = await self._call(_Database.revision)
        self._sweeper = loop.create_task(self._sweep_leases(), name=f"lease sweeper {self._path}")

    async def _call(
        self, method: Callable[Concatenate[_Database, _P], _T], *args: _P.args, **kwargs: _P.kwargs
    ) -> _T:
        """Run ``method`` on the worker thread."""
        if self._db is None or self._closed:
            raise StoreError("store is closed")
        call = functools.partial(method, self._db, *args, **kwargs)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        except sqlite3.Error as exc:
            raise StoreError(f"sqlite: {exc}") from exc

    def _advance(self, first: int, revision: int, heads: frozenset[str]) -> None:
        self._written.append((first, revision, heads))
        self._revision = max(self._revision, revision)
        self._wake_watchers()

    def _untouched(self, prefix: str, since: int) -> bool:
        """Whether no key under ``prefix`` changed from revision ``since`` to the newest, as
        far as ``_written`` tells (False when it no longer reaches back that far)."""
        for first, _, heads in reversed(self._written):
            if _may_hold(heads, prefix):
                return False
            if first <= since:
                return True
        return False

    def _wake_watchers(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def get(self, key: str) -> KeyValue | None:
        """The key, or ``None`` when it does not exist."""
        return await self._call(_Database.get, key)

    async def range(self, prefix: str, *, start_after: str = "", limit: int = 0) -> list[KeyValue]:
        """Keys starting with ``prefix`` after ``start_after``, sorted; ``limit`` 0 means all."""
        if limit < 0:
            raise ValueError("limit must not be negative")
        return await self._call(_Database.range, prefix, start_after, limit)

    async def count(self, prefix: str) -> int:
        """How many keys start with ``prefix``."""
        return await self._call(_Database.count, prefix)

    async def commit(self, ops: Sequence[Op]) -> int:
        """Apply ``ops`` atomically as one revision; see ``Store.commit``.

        Commits that arrive while one is being written are written together, in arrival
        order, in one SQLite transaction: one fsync for many, each still its own revision.
        """
        check_ops(ops)
        if self._db is None or self._closed:
            raise StoreError("store is closed")
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._queued.append((list(ops), future))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        with STORE_COMMIT_SECONDS.labels("sqlite").time():  # queueing included: callers wait it
            return await asyncio.shield(future)

    async def _flush(self) -> None:
        while self._queued:
            batch, self._queued = self._queued, []
            try:
                results = await self._call(_Database.commit_many, [ops for ops, _ in batch])
            except Exception as err:  # the whole transaction failed: tell every caller
                results = [err if isinstance(err, StoreError) else StoreError(str(err))] * len(
                    batch
                )
            for (_, future), result in zip(batch, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    async def revision(self) -> int:
        """The current store revision."""
        return await self._call(_Database.revision)

    @property
    def path(self) -> Path:
        """The database file."""
        return self._path

    async def backup(self, path: Path) -> int:
        """A consistent copy of the store in ``path`` (which must not exist), taken while it
        serves; returns the revision the copy holds. The copy opens as a store of its own."""
        return await self._call(_Database.backup, path)

    def watch(self, prefix: str, *, start_revision: int = 0) -> AsyncIterator[WatchEvent]:
        """Changes under ``prefix`` from ``start_revision`` (0: after this call) on, forever."""
        if start_revision < 0:
            raise ValueError("start_revision must not be negative")
        # Fixed now rather than on first iteration, so that 0 means "after this call".
        return self._follow(prefix, start_revision or self._revision + 1)

    async def _follow(self, prefix: str, next_revision: int) -> AsyncIterator[WatchEvent]:
        # Reading from `changes` rather than from in-memory queues means replay and live
        # events come from one place, with no gap or duplicate where they meet.
        while True:
            events, through = await self._call(
                _Database.changes, prefix, next_revision, _WATCH_BATCH
            )
            for event in events:
                yield event
            next_revision = max(next_revision, through + 1)
            while True:
                if self._revision >= next_revision:
                    if not self._untouched(prefix, next_revision):
                        break
                    # Written since, but nothing under the prefix (the leader key, the CA, and
                    # revocations are watched, and jobs written): no query, no thread hop.
                    next_revision = self._revision + 1
                if self._closed:
                    raise StoreError("store is closed")
                await self._changed.wait()

    async def grant_lease(self, ttl_s: float) -> int:
        """A new lease that expires ``ttl_s`` seconds from now unless kept alive."""
        if ttl_s <= 0:
            raise ValueError("lease ttl must be positive")
        try:
            return await self._call(_Database.grant_lease, ttl_s)
        finally:
            # Even if cancelled: the sweeper's next query queues behind the grant.
            self._lease_granted.set()

    async def keepalive(self, lease: int) -> None:
        """Restart the lease's ttl; raises ``LeaseNotFoundError`` when it is gone."""
        await self._call(_Database.keepalive, lease)

    async def revoke(self, lease: int) -> None:
        """End the lease and delete its keys; raises ``LeaseNotFoundError`` when it is gone."""
        await self._call(_Database.revoke, lease)

    async def close(self) -> None:
        """Stop the sweeper, end open watches with ``StoreError`` and close the file."""
        if self._closed:
            return
        if self._flusher is not None:
            await asyncio.wait([self._flusher])  # commits already accepted are written first
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.wait([self._sweeper])
        self._wake_watchers()
        if self._db is not None:
            # Queued behind any calls still running, so those finish first.
            await asyncio.get_running_loop().run_in_executor(self._executor, self._db.close)
        self._executor.shutdown(wait=False)

    async def _sweep_leases(self) -> None:
        """Expire leases when due; sleeps until the next expiry or a new grant."""
        while True:
            self._lease_granted.clear()
            try:
                next_expiry = await self._call(_Database.expire_leases)
            except Exception:
                log.exception("lease_sweep_failed", path=str(self._path))
                next_expiry = _now() + _SWEEP_RETRY_S
            delay = None if next_expiry is None else max(0.0, next_expiry - _now())
            # asyncio.timeout, not wait_for: in Python 3.11 wait_for can swallow a
            # cancellation that races with the wait finishing, and this loop would never end.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._lease_granted.wait()


if TYPE_CHECKING:
    _: type[Store] = SqliteStore
