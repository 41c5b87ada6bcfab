"""A ``Store`` view whose every commit holds only while this coordinator leads.

Each commit goes out with ``Check(LEADER_KEY, revision)``, ``revision`` being the one at which
this coordinator created the leader key. Once another coordinator has taken over, the key has
been deleted and written again, so the check fails and the commit writes nothing: a leader
that lost its lease without noticing (paused, partitioned) can never overwrite what the new
leader wrote. The jobs, sites and enrollment of a leader all write through this view.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING

import structlog

from federation.coordinator.ha.leader import LEADER_KEY, CoordinatorInfo
from federation.errors import NotLeaderError
from federation.store import CasConflictError, Check, KeyValue, Op, Store, WatchEvent

log = structlog.get_logger()


def not_leader(leader: CoordinatorInfo | None) -> NotLeaderError:
    """The refusal that names ``leader`` (or none, while no leader is known)."""
    if leader is None:
        return NotLeaderError()
    return NotLeaderError(leader.address, leader.join_address)


class FencedStore:
    """Commits through ``store`` guarded by the leader key's revision; reads pass through.

    Args:
        store: The shared store; closing this view leaves it open.
        revision: The fencing token (``token``): the revision at which this coordinator
            wrote the leader key.
        leader: Who leads now, for the refusal's hint.
    """

    def __init__(
        self, store: Store, revision: int, leader: Callable[[], CoordinatorInfo | None]
    ) -> None:
        self._store = store
        self.token = revision
        self._leader = leader
        self._fenced = False

    @property
    def is_fenced(self) -> bool:
        """Whether commits are refused without asking the store."""
        return self._fenced

    def fence(self) -> None:
        """Refuse every later commit at once (called on stepping down)."""
        self._fenced = True

    async def commit(self, ops: Sequence[Op]) -> int:
        """Apply ``ops`` atomically, only if the leader key is still at ``token``.

        Raises:
            NotLeaderError: This coordinator no longer leads; nothing was written.
        """
        if self._fenced:
            raise not_leader(self._leader())
        try:
            return await self._store.commit([*ops, Check(LEADER_KEY, self.token)])
        except CasConflictError as err:
            if err.key != LEADER_KEY:
                raise
            self._fenced = True
            log.warning("write_fenced", token=self.token, leader_revision=err.actual)
            raise not_leader(self._leader()) from None

    async def get(self, key: str) -> KeyValue | None:
        """The key, or ``None`` when it does not exist."""
        return await self._store.get(key)

    async def range(self, prefix: str, *, start_after: str = "", limit: int = 0) -> list[KeyValue]:
        """Keys starting with ``prefix``, sorted by key; see ``Store.range``."""
        return await self._store.range(prefix, start_after=start_after, limit=limit)

    async def count(self, prefix: str) -> int:
        """How many keys start with ``prefix``."""
        return await self._store.count(prefix)

    async def revision(self) -> int:
        """The current store revision."""
        return await self._store.revision()

    def watch(self, prefix: str, *, start_revision: int = 0) -> AsyncIterator[WatchEvent]:
        """Changes under ``prefix``; see ``Store.watch``."""
        return self._store.watch(prefix, start_revision=start_revision)

    async def grant_lease(self, ttl_s: float) -> int:
        """A new lease of the shared store."""
        return await self._store.grant_lease(ttl_s)

    async def keepalive(self, lease: int) -> None:
        """Restart a lease's ttl."""
        await self._store.keepalive(lease)

    async def revoke(self, lease: int) -> None:
        """End a lease now."""
        await self._store.revoke(lease)

    async def close(self) -> None:
        """Fence this view; the shared store stays open (its owner closes it)."""
        self._fenced = True


if TYPE_CHECKING:
    _: type[Store] = FencedStore
