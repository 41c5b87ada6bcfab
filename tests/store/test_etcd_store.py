"""The store contract on ``EtcdStore`` against a real etcd, plus what only etcd must do.

One etcd member runs for the whole session (see ``etcd_server``); every test gets a fresh key
prefix, so tests never see each other's keys and nothing needs wiping.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio

from federation.store import CommitTooLargeError, CompactedError, Delete, Put, StoreError
from federation.store.etcd import EtcdStore

from .contract import PUT, WAIT_S, StoreContract, summary, take
from .etcd_server import LocalEtcd, compact, etcd_binary, free_ports, write_pki

pytestmark = [
    pytest.mark.xdist_group("etcd"),
    pytest.mark.skipif(
        etcd_binary() is None,
        reason="etcd is not installed (apt-get install -y etcd-server)",
    ),
]

FAST_S = 2.0  # how quickly an unreachable or refusing etcd must be reported


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    """One etcd member for the session, with a plaintext and a mutual-TLS client port."""
    server = LocalEtcd.start(tmp_path_factory.mktemp("etcd"))
    try:
        yield server
    finally:
        server.stop()


def fresh_prefix() -> str:
    """A key prefix no other test uses (all the same length, so none extends another)."""
    return f"/test-{uuid.uuid4().hex}"


class TestEtcdStore(StoreContract):
    """``EtcdStore`` against the shared contract, over plaintext and over mutual TLS."""

    # etcd leases are whole seconds; the fixture's short election timeout makes 1 s allowed.
    lease_ttl_s = 1.0

    @pytest_asyncio.fixture(params=["plaintext", "tls"])
    async def store(
        self, etcd: LocalEtcd, request: pytest.FixtureRequest
    ) -> AsyncIterator[EtcdStore]:
        """A store under a fresh prefix, over plaintext or over mutual TLS."""
        if request.param == "tls":
            store = await EtcdStore.open(
                [etcd.tls_endpoint], prefix=fresh_prefix(), tls=etcd.client_tls
            )
        else:
            store = await EtcdStore.open([etcd.endpoint], prefix=fresh_prefix())
        yield store
        await store.close()


@pytest_asyncio.fixture
async def store(etcd: LocalEtcd) -> AsyncIterator[EtcdStore]:
    """A plaintext store under a fresh prefix."""
    store = await EtcdStore.open([etcd.endpoint], prefix=fresh_prefix())
    yield store
    await store.close()


async def test_prefixes_isolate_stores(etcd: LocalEtcd, store: EtcdStore) -> None:
    """Two stores with different prefixes on one etcd never see each other's keys or events."""
    other = await EtcdStore.open([etcd.endpoint], prefix=fresh_prefix())
    try:
        events = other.watch("")
        await store.commit([Put("/jobs/a", b"mine"), Put("/only-mine", b"x")])
        revision = await other.commit([Put("/jobs/a", b"theirs")])
        mine, theirs = await store.get("/jobs/a"), await other.get("/jobs/a")
        assert mine is not None
        assert theirs is not None
        assert (mine.value, theirs.value) == (b"mine", b"theirs")
        assert [kv.key for kv in await store.range("")] == ["/jobs/a", "/only-mine"]
        assert [kv.key for kv in await other.range("")] == ["/jobs/a"]
        assert (await store.count(""), await other.count("")) == (2, 1)
        assert await other.get("/only-mine") is None
        assert summary(await take(events, 1)) == [(PUT, "/jobs/a", b"theirs", revision)]
    finally:
        await other.close()


async def test_keys_sit_under_the_prefix_in_etcd(etcd: LocalEtcd) -> None:
    """A store's key is the etcd key with its prefix, as a store without a prefix sees."""
    prefix = fresh_prefix()
    store = await EtcdStore.open([etcd.endpoint], prefix=prefix)
    raw = await EtcdStore.open([etcd.endpoint], prefix="")
    try:
        revision = await store.commit([Put("/jobs/a", b"1")])
        kv = await raw.get(f"{prefix}/jobs/a")
        assert kv is not None
        assert (kv.key, kv.value, kv.mod_revision) == (f"{prefix}/jobs/a", b"1", revision)
        assert [kv.key for kv in await raw.range(prefix)] == [f"{prefix}/jobs/a"]
    finally:
        await store.close()
        await raw.close()


async def test_reopen_keeps_data_and_revisions(etcd: LocalEtcd) -> None:
    """Keys written before closing read back after reopening with the same prefix."""
    prefix = fresh_prefix()
    store = await EtcdStore.open([etcd.endpoint], prefix=prefix)
    await store.commit([Put("/a", b"1"), Put("/b", b"2")])
    revision = await store.commit([Put("/a", b"3")])
    await store.close()

    reopened = await EtcdStore.open([etcd.endpoint], prefix=prefix)
    try:
        kv = await reopened.get("/a")
        assert kv is not None
        assert (kv.value, kv.mod_revision) == (b"3", revision)
        assert [kv.key for kv in await reopened.range("/")] == ["/a", "/b"]
        assert await reopened.revision() >= revision
        events = await take(reopened.watch("/", start_revision=revision), 1)
        assert [(e.kv.key, e.kv.mod_revision) for e in events] == [("/a", revision)]
    finally:
        await reopened.close()


async def test_revision_is_shared_by_every_prefix(etcd: LocalEtcd, store: EtcdStore) -> None:
    """A commit under another prefix advances this store's revision too, as etcd counts them."""
    other = await EtcdStore.open([etcd.endpoint], prefix=fresh_prefix())
    try:
        before = await store.revision()
        assert await other.commit([Put("/a", b"1")]) == before + 1
        assert await store.revision() == before + 1
    finally:
        await other.close()


async def test_unreachable_etcd_raises_store_error_quickly() -> None:
    """Opening a store on a port where nothing listens fails fast with StoreError."""
    (port,) = free_ports(1)
    started = time.monotonic()
    with pytest.raises(StoreError, match=f"cannot reach etcd.*127.0.0.1:{port}"):
        await EtcdStore.open([f"127.0.0.1:{port}"])
    assert time.monotonic() - started < FAST_S


async def test_outage_raises_store_error_and_the_store_recovers(tmp_path: Path) -> None:
    """While etcd is down calls and watches raise StoreError; afterwards the same store works."""
    server = LocalEtcd.start(tmp_path)  # its own etcd: the shared one must stay up
    try:
        store = await EtcdStore.open([server.endpoint], timeout_s=FAST_S)
        try:
            revision = await store.commit([Put("/a", b"1")])
            watching = asyncio.create_task(take(store.watch("/"), 1))
            await asyncio.sleep(0.05)  # let the watcher block before the outage
            server.stop()
            with pytest.raises(StoreError, match="unreachable"):
                await asyncio.wait_for(watching, WAIT_S)
            started = time.monotonic()
            with pytest.raises(StoreError, match="unreachable"):
                await store.get("/a")
            assert time.monotonic() - started < FAST_S

            server.restart()
            async with asyncio.timeout(WAIT_S):  # gRPC reconnects after a short backoff
                while True:
                    try:
                        kv = await store.get("/a")
                        break
                    except StoreError:
                        await asyncio.sleep(0.1)
            assert kv is not None
            assert (kv.value, kv.mod_revision) == (b"1", revision)
        finally:
            await store.close()
    finally:
        server.stop()


async def test_dead_endpoint_is_skipped_for_a_live_one(etcd: LocalEtcd) -> None:
    """With a dead endpoint listed first, the store connects to the next and works."""
    (port,) = free_ports(1)
    store = await EtcdStore.open([f"http://127.0.0.1:{port}", etcd.endpoint], prefix=fresh_prefix())
    try:
        revision = await store.commit([Put("/a", b"1")])
        kv = await store.get("/a")
        assert kv is not None
        assert kv.mod_revision == revision
    finally:
        await store.close()


async def test_commit_over_etcd_txn_limit_names_the_setting(store: EtcdStore) -> None:
    """A commit with more ops than etcd's --max-txn-ops raises CommitTooLargeError saying so."""
    with pytest.raises(CommitTooLargeError, match="max-txn-ops"):
        await store.commit([Put(f"/k{i}", b"x") for i in range(200)])
    assert await store.count("/") == 0


async def test_watch_from_compacted_revision_raises(etcd: LocalEtcd, store: EtcdStore) -> None:
    """Watching from a revision that etcd has compacted away raises CompactedError."""
    first = await store.commit([Put("/w/a", b"1")])
    await store.commit([Delete("/w/a")])
    last = await store.commit([Put("/w/b", b"2")])
    await compact(etcd.endpoint, last)
    with pytest.raises(CompactedError):
        await anext(store.watch("/w/", start_revision=first))
    events = await take(store.watch("/w/", start_revision=last), 1)
    assert [e.kv.key for e in events] == ["/w/b"]


async def test_history_is_compacted_to_what_is_kept(store: EtcdStore) -> None:
    """``compact_history`` drops revisions older than about one period: a watch from before
    then raises CompactedError, the values stay, and recent history is still there."""
    first = await store.commit([Put("/h/a", b"1")])
    for i in range(20):
        await store.commit([Put("/h/a", str(i).encode())])
    compactor = asyncio.create_task(store.compact_history(0.1))
    try:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                await anext(store.watch("/h/", start_revision=first))
            except CompactedError:
                break
            assert time.monotonic() < deadline, "history was never compacted"
            await asyncio.sleep(0.05)
    finally:
        compactor.cancel()
    kept = await store.get("/h/a")
    assert kept is not None
    assert kept.value == b"19"
    recent = await store.commit([Put("/h/b", b"new")])
    events = await take(store.watch("/h/", start_revision=recent), 1)
    assert [e.kv.key for e in events] == ["/h/b"]


async def test_closed_store_ends_watches_and_calls(etcd: LocalEtcd) -> None:
    """After close, waiting and paused watches and any new call raise StoreError."""
    store = await EtcdStore.open([etcd.endpoint], prefix=fresh_prefix())
    paused = store.watch("/")
    await store.commit([Put("/a", b"1"), Put("/b", b"2")])
    await take(paused, 1)  # "/b" is received but not taken
    waiting = asyncio.create_task(take(store.watch("/"), 1))
    await asyncio.sleep(0.05)  # let the watcher block before closing
    await store.close()
    with pytest.raises(StoreError, match="closed"):
        await asyncio.wait_for(waiting, 5)
    with pytest.raises(StoreError, match="closed"):
        await anext(paused)
    with pytest.raises(StoreError, match="closed"):
        await store.get("/a")
    with pytest.raises(StoreError, match="closed"):
        await anext(store.watch("/"))


async def test_tls_with_a_foreign_ca_is_refused(etcd: LocalEtcd, tmp_path: Path) -> None:
    """A client certificate from another CA fails the handshake with a prompt StoreError."""
    _, foreign = write_pki(tmp_path)
    started = time.monotonic()
    with pytest.raises(StoreError, match="cannot reach etcd"):
        await EtcdStore.open([etcd.tls_endpoint], tls=foreign)
    assert time.monotonic() - started < FAST_S


async def test_endpoint_scheme_must_match_tls(etcd: LocalEtcd) -> None:
    """An https endpoint without tls files, or an http one with them, is a ValueError."""
    with pytest.raises(ValueError, match="https"):
        await EtcdStore.open([etcd.tls_endpoint])
    with pytest.raises(ValueError, match="http"):
        await EtcdStore.open([etcd.endpoint], tls=etcd.client_tls)
