"""Leader election and fencing on both stores: SQLite in one process, and a real etcd."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from store.etcd_server import LocalEtcd

from federation.coordinator.ha.fencing import FencedStore
from federation.coordinator.ha.leader import LEADER_KEY, CoordinatorInfo, LeaderElection
from federation.errors import NotLeaderError
from federation.store import Put, SqliteStore, Store
from federation.store.etcd import EtcdStore

pytestmark = pytest.mark.xdist_group("etcd")

LEASE_S = 1.0  # the smallest lease etcd grants with the test server's short election timeout
WAIT_S = 10.0  # upper bound for anything that should happen within a lease or two
OpenStore = Callable[[], Awaitable[Store]]


@pytest_asyncio.fixture(params=["sqlite", "etcd"])
async def open_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[OpenStore]:
    """Opens a candidate's view of one shared store: the same SQLite store, or a new client
    of one etcd prefix."""
    opened: list[Store] = []
    if request.param == "sqlite":
        shared = await SqliteStore.open(tmp_path / "federation.db")
        opened.append(shared)

        async def same() -> Store:
            return shared

        yield same
    else:
        etcd: LocalEtcd = request.getfixturevalue("etcd")
        prefix = f"/test-{uuid.uuid4().hex}"

        async def connect() -> Store:
            store = await EtcdStore.open([etcd.endpoint], prefix=prefix)
            opened.append(store)
            return store

        yield connect
    for store in opened:
        await store.close()


class Partition:
    """A store that stops answering lease and write calls once cut, as a partitioned leader's."""

    HANGS = frozenset({"grant_lease", "keepalive", "revoke", "commit"})

    def __init__(self, store: Store) -> None:
        self._store = store
        self.is_cut = False

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if name not in self.HANGS:
            return method

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self.is_cut:
                await asyncio.Event().wait()  # never answers
            return await method(*args, **kwargs)

        return call


@dataclass
class Candidate:
    """One election with its store and what its callbacks saw."""

    name: str
    store: Partition
    elected: asyncio.Queue[tuple[int, float]] = field(default_factory=asyncio.Queue)
    deposed: list[float] = field(default_factory=list)
    election: LeaderElection | None = None
    task: asyncio.Task[None] | None = None

    def start(self) -> None:
        async def on_elected(token: int) -> None:
            self.elected.put_nowait((token, time.monotonic()))

        async def on_deposed() -> None:
            self.deposed.append(time.monotonic())

        self.election = LeaderElection(
            self.store,  # type: ignore[arg-type]
            CoordinatorInfo(f"{self.name}:7070", f"{self.name}:7071"),
            lease_s=LEASE_S,
            on_elected=on_elected,
            on_deposed=on_deposed,
        )
        self.task = asyncio.create_task(self.election.run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


@pytest_asyncio.fixture
async def pair(open_store: OpenStore) -> AsyncIterator[tuple[Candidate, Candidate]]:
    """Two running candidates, each with its own (cuttable) view of the shared store."""
    a = Candidate("a", Partition(await open_store()))
    b = Candidate("b", Partition(await open_store()))
    a.start()
    b.start()
    yield a, b
    await asyncio.gather(a.stop(), b.stop())


async def first_elected(*candidates: Candidate) -> tuple[Candidate, int, float]:
    """The first of ``candidates`` to win, with its token and when it won."""
    waits = {asyncio.ensure_future(c.elected.get()): c for c in candidates}
    try:
        done, _ = await asyncio.wait(waits, timeout=WAIT_S, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiting in waits:
            waiting.cancel()
    assert done, "nobody was elected"
    winner = next(iter(done))
    token, at = winner.result()
    return waits[winner], token, at


async def test_one_of_two_candidates_leads(pair: tuple[Candidate, Candidate]) -> None:
    """Of two candidates exactly one wins; the other follows it and names it as the leader."""
    winner, token, _ = await first_elected(*pair)
    loser = pair[1] if winner is pair[0] else pair[0]
    assert winner.election is not None
    assert loser.election is not None
    async with asyncio.timeout(WAIT_S):
        assert await loser.election.known_leader() == winner.election.me
    assert winner.election.is_leader
    assert winner.election.revision == token
    assert not loser.election.is_leader
    assert loser.election.leader() == winner.election.me
    assert loser.elected.empty()
    kv = await winner.store.get(LEADER_KEY)
    assert kv is not None
    assert (kv.mod_revision, CoordinatorInfo.decode(kv.value)) == (token, winner.election.me)
    members = await winner.election.members()
    assert {m.address for m in members} == {"a:7070", "b:7070"}


async def test_lapsed_lease_hands_over_and_fences_the_old_leader(
    pair: tuple[Candidate, Candidate],
) -> None:
    """A leader cut off from the store steps down; once its lease lapses the other wins, and
    a write guarded by the old leader's token fails."""
    winner, old_token, _ = await first_elected(*pair)
    other = pair[1] if winner is pair[0] else pair[0]
    assert await FencedStore(winner.store, old_token, lambda: None).commit(  # type: ignore[arg-type]
        [Put("/jobs/before", b"1")]
    )
    cut_at = time.monotonic()
    winner.store.is_cut = True
    successor, new_token, won_at = await first_elected(other)
    assert successor is other
    assert new_token > old_token
    assert winner.deposed, "the cut-off leader never stepped down"
    assert winner.deposed[0] <= won_at, "two leaders at once"
    assert won_at - cut_at <= LEASE_S + 3.0
    stale = FencedStore(other.store, old_token, lambda: None)  # type: ignore[arg-type]
    with pytest.raises(NotLeaderError):
        await stale.commit([Put("/jobs/after", b"stale")])
    assert await other.store.get("/jobs/after") is None
    current = FencedStore(other.store, new_token, lambda: None)  # type: ignore[arg-type]
    await current.commit([Put("/jobs/after", b"fresh")])


async def test_stopped_leader_hands_over_at_once(pair: tuple[Candidate, Candidate]) -> None:
    """A leader that stops gives its lease back, so the other wins without waiting for it."""
    winner, _, _ = await first_elected(*pair)
    other = pair[1] if winner is pair[0] else pair[0]
    stopped_at = time.monotonic()
    await winner.stop()
    assert winner.deposed, "a stopping leader must step down"
    _, _, won_at = await first_elected(other)
    assert won_at - stopped_at < LEASE_S


async def test_fenced_view_refuses_at_once_after_fence(open_store: OpenStore) -> None:
    """Once fenced (on stepping down), a leader's view refuses writes without asking the store."""
    store = await open_store()
    token = await store.commit([Put(LEADER_KEY, CoordinatorInfo("me:1").encode())])
    leader = CoordinatorInfo("next:1", "next:2")
    fenced = FencedStore(store, token, lambda: leader)
    await fenced.commit([Put("/jobs/a", b"1")])
    fenced.fence()
    with pytest.raises(NotLeaderError) as caught:
        await fenced.commit([Put("/jobs/b", b"1")])
    assert caught.value.metadata == {"leader": "next:1", "leader_join": "next:2"}
    assert await store.get("/jobs/b") is None
