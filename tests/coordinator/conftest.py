"""A real etcd for the coordinator tests that elect a leader."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from store.etcd_server import LocalEtcd, etcd_binary

from federation.coordinator.jobs.events import EventHub
from federation.coordinator.jobs.repository import JobRepository
from federation.store import SqliteStore


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    """One etcd member for the session (tests keep apart by key prefix)."""
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (apt-get install -y etcd-server)")
    server = LocalEtcd.start(tmp_path_factory.mktemp("etcd"))
    try:
        yield server
    finally:
        server.stop()


@pytest_asyncio.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    """A real embedded store in the test's folder."""
    store = await SqliteStore.open(tmp_path / "db")
    yield store
    await store.close()


@pytest.fixture
def hub() -> EventHub:
    return EventHub()


@pytest.fixture
def repo(store: SqliteStore, hub: EventHub) -> JobRepository:
    return JobRepository(store, hub)
