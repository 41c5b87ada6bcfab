"""The store contract on ``SqliteStore``, plus what only a file-backed store must do."""

from __future__ import annotations

import asyncio
import signal
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

import federation
from federation.store import CompactedError, Put, SqliteStore, StoreError
from federation.store import sqlite as sqlite_module

from .contract import StoreContract, take

REPO_ROOT = Path(federation.__file__).resolve().parents[1]

# Commits one key, reports its revision, then hangs without closing the store until killed.
CHILD = """
import asyncio, sys
from pathlib import Path
from federation.store import Put, SqliteStore

async def main():
    store = await SqliteStore.open(Path(sys.argv[1]))
    print(await store.commit([Put("/durable", b"survives")]), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


class TestSqliteStore(StoreContract):
    """``SqliteStore`` against the shared contract and its own durability guarantees."""

    @pytest_asyncio.fixture
    async def store(self, tmp_path: Path) -> AsyncIterator[SqliteStore]:
        store = await SqliteStore.open(tmp_path / "store.db")
        yield store
        await store.close()

    async def test_reopen_keeps_data_and_revision(self, tmp_path: Path) -> None:
        """Closing and reopening the file returns every key and the same store revision."""
        path = tmp_path / "store.db"
        store = await SqliteStore.open(path)
        await store.commit([Put("/a", b"1"), Put("/b", b"2")])
        revision = await store.commit([Put("/a", b"3")])
        await store.close()

        reopened = await SqliteStore.open(path)
        try:
            assert await reopened.revision() == revision
            kv = await reopened.get("/a")
            assert kv is not None
            assert (kv.value, kv.mod_revision) == (b"3", revision)
            assert [kv.key for kv in await reopened.range("/")] == ["/a", "/b"]
            assert await reopened.commit([Put("/c", b"4")]) == revision + 1
        finally:
            await reopened.close()

    async def test_reopen_keeps_watch_history(self, tmp_path: Path) -> None:
        """Watch history written before a restart can still be replayed after it."""
        path = tmp_path / "store.db"
        store = await SqliteStore.open(path)
        first = await store.commit([Put("/w/a", b"1")])
        await store.close()

        reopened = await SqliteStore.open(path)
        try:
            events = await take(reopened.watch("/w/", start_revision=first), 1)
            assert [(e.kv.key, e.kv.mod_revision) for e in events] == [("/w/a", first)]
        finally:
            await reopened.close()

    async def test_watch_from_compacted_revision_raises(self, tmp_path: Path) -> None:
        """With history=3, watching from before the newest 3 revisions raises CompactedError."""
        store = await SqliteStore.open(tmp_path / "store.db", history=3)
        try:
            revisions = [await store.commit([Put(f"/k{i}", b"x")]) for i in range(10)]
            with pytest.raises(CompactedError):
                await anext(store.watch("", start_revision=revisions[0]))
            with pytest.raises(CompactedError):
                await anext(store.watch("", start_revision=revisions[-4]))
            events = await take(store.watch("", start_revision=revisions[-3]), 3)
            assert [e.kv.mod_revision for e in events] == revisions[-3:]
        finally:
            await store.close()

    async def test_history_keeps_at_most_its_bytes(self, tmp_path: Path) -> None:
        """Large values are not kept revision after revision: past history_bytes, the oldest
        revisions are compacted even within history, across a reopen too; the newest stays."""
        path = tmp_path / "store.db"
        value = b"v" * 100_000
        store = await SqliteStore.open(path, history=10_000, history_bytes=1_000_000)
        try:
            revisions = [await store.commit([Put("/big", value)]) for _ in range(30)]
            with pytest.raises(CompactedError):
                await anext(store.watch("", start_revision=revisions[-12]))
            (newest,) = await take(store.watch("", start_revision=revisions[-1]), 1)
            assert newest.kv.value == value
        finally:
            await store.close()
        reopened = await SqliteStore.open(path, history=10_000, history_bytes=300_000)
        try:
            revision = await reopened.commit([Put("/big", value)])
            with pytest.raises(CompactedError):
                await anext(reopened.watch("", start_revision=revision - 3))
            (newest,) = await take(reopened.watch("", start_revision=revision), 1)
            assert newest.kv.mod_revision == revision
        finally:
            await reopened.close()
        assert path.stat().st_size < 30 * len(value)

    async def test_expired_lease_keys_are_hidden_before_the_sweep(
        self, store: SqliteStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Reads skip keys of a lease past its expiry even before the sweeper deletes them."""
        lease = await store.grant_lease(60)
        await store.commit([Put("/live/a", b"1", lease=lease), Put("/live/b", b"2")])
        revision = await store.revision()
        monkeypatch.setattr(sqlite_module, "_now", lambda: time.time() + 120)
        assert await store.get("/live/a") is None
        assert [kv.key for kv in await store.range("/live/")] == ["/live/b"]
        assert await store.count("/live/") == 1
        # No new revision: the key was hidden by the read, not deleted by a sweep.
        assert await store.revision() == revision

    async def test_second_open_of_same_file_is_refused(self, tmp_path: Path) -> None:
        """A file held by one store cannot be opened by another until the first closes."""
        path = tmp_path / "store.db"
        store = await SqliteStore.open(path)
        try:
            with pytest.raises(StoreError):
                await SqliteStore.open(path)
        finally:
            await store.close()
        second = await SqliteStore.open(path)
        await second.close()

    async def test_file_is_in_wal_mode(self, tmp_path: Path) -> None:
        """The database file is left in WAL journal mode."""
        path = tmp_path / "store.db"
        store = await SqliteStore.open(path)
        await store.close()
        conn = sqlite3.connect(path)
        try:
            assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        finally:
            conn.close()

    async def test_closed_store_ends_watches_and_calls(self, tmp_path: Path) -> None:
        """After close, a waiting watch and any new call raise StoreError."""
        store = await SqliteStore.open(tmp_path / "store.db")
        waiting = asyncio.create_task(take(store.watch("/"), 1))
        await asyncio.sleep(0.05)  # let the watcher block before closing
        await store.close()
        with pytest.raises(StoreError):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(StoreError):
            await store.get("/a")

    async def test_a_watch_reads_history_only_for_commits_under_its_prefix(
        self, store: SqliteStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Commits elsewhere wake a watcher but cost it no read; every event under its
        prefix still arrives, in order, whatever was committed beside it."""
        reads: list[str] = []
        changes = sqlite_module._Database.changes

        def counted(db: sqlite_module._Database, prefix: str, *args: int) -> object:
            reads.append(prefix)
            return changes(db, prefix, *args)

        monkeypatch.setattr(sqlite_module._Database, "changes", counted)
        events = store.watch("/watched/")
        first = asyncio.create_task(take(events, 1))
        await asyncio.sleep(0.05)  # the watch has read history once and waits
        read_before = len(reads)
        for i in range(50):
            await store.commit([Put(f"/jobs/{i}", b"x"), Put(f"/index/state/{i}", b"")])
        mixed = await store.commit([Put("/jobs/mixed", b"x"), Put("/watched/a", b"1")])
        (event,) = await first
        assert (event.kv.key, event.kv.mod_revision) == ("/watched/a", mixed)
        assert len(reads) - read_before == 1  # the mixed commit's alone
        later = await store.commit([Put("/watchedness", b"no"), Put("/watched/b", b"2")])
        (event,) = await take(events, 1)
        assert (event.kv.key, event.kv.mod_revision) == ("/watched/b", later)

    async def test_a_watch_that_lags_past_what_is_remembered_reads_history(
        self, store: SqliteStore, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """More commits than the store remembers the keys of, while a watcher is busy: it
        reads them all rather than assume they were elsewhere."""
        monkeypatch.setattr(sqlite_module, "_WRITTEN_KEPT", 4)
        lagging = await SqliteStore.open(store.path.with_name("lagging.db"))
        try:
            events = lagging.watch("/w/")
            await lagging.commit([Put("/w/0", b"")])
            (event,) = await take(events, 1)  # read, then busy until the next anext
            for i in range(8):
                await lagging.commit([Put(f"/other/{i}", b"")])
            inside = await lagging.commit([Put("/w/1", b"")])
            for i in range(8):  # the last four remembered are all elsewhere
                await lagging.commit([Put(f"/other/x{i}", b"")])
            (event,) = await take(events, 1)
            assert (event.kv.key, event.kv.mod_revision) == ("/w/1", inside)
        finally:
            await lagging.close()

    async def test_commit_survives_sigkill(self, tmp_path: Path) -> None:
        """A commit that returned in a process later killed with SIGKILL is in the file."""
        path = tmp_path / "store.db"
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CHILD,
            str(path),
            cwd=REPO_ROOT,
            stdout=asyncio.subprocess.PIPE,
        )
        assert child.stdout is not None
        try:
            line = await asyncio.wait_for(child.stdout.readline(), 30)
        finally:
            child.send_signal(signal.SIGKILL)
            await child.wait()
        assert child.returncode == -signal.SIGKILL
        revision = int(line)

        store = await SqliteStore.open(path)
        try:
            kv = await store.get("/durable")
            assert kv is not None
            assert (kv.value, kv.mod_revision) == (b"survives", revision)
            assert await store.revision() == revision
        finally:
            await store.close()
