"""Leader election among coordinators that share one store, on a lease and a create-only key.

Each candidate holds one lease for as long as it runs, kept alive every ``lease_s / 3``. It
registers under ``/coordinators/`` with that lease, then campaigns: it creates ``/leader``
(``expect_revision=0``) attached to the same lease. The one whose create succeeds leads; the
revision of that write is its fencing token (see ``FencedStore``). The others read who leads
and watch ``/leader`` until it is deleted, which happens when the leader's lease expires or
is revoked, and then campaign again.

A leader whose keepalive fails, or does not get through before the lease would run out by
its own clock, steps down at once, before the store expires the lease, so two leaders never
act at the same time; the guard in every write makes sure of it even if clocks disagree.
Everything here uses only the ``Store`` protocol, so it runs on SQLite (in one process) as on
etcd (across processes).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from federation.store import (
    CasConflictError,
    CompactedError,
    LeaseNotFoundError,
    Put,
    Store,
    StoreError,
    WatchEventType,
)

log = structlog.get_logger()

LEADER_KEY = "/leader"
"""Exists while some coordinator leads; its value is that coordinator's ``CoordinatorInfo``."""
MEMBERS = "/coordinators/"
"""One key per running coordinator, attached to its lease."""
DEFAULT_LEASE_S = 3.0
REVOKE_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class CoordinatorInfo:
    """How clients and agents reach one coordinator."""

    address: str
    """The advertised mTLS address (host:port)."""
    join_address: str = ""
    """The advertised join address (host:port)."""

    def encode(self) -> bytes:
        """The value stored under ``/leader`` and ``/coordinators/``."""
        return json.dumps({"address": self.address, "join_address": self.join_address}).encode()

    @classmethod
    def decode(cls, data: bytes) -> CoordinatorInfo:
        """Read a stored value; anything unreadable becomes an empty address."""
        try:
            value = json.loads(data)
            return cls(str(value.get("address", "")), str(value.get("join_address", "")))
        except (ValueError, AttributeError):
            return cls("")


ElectedCallback = Callable[[int], Awaitable[None]]
"""Called with the fencing token (the revision of the leader key) on winning."""
DeposedCallback = Callable[[], Awaitable[None]]
"""Called on losing the lead, or on stopping while leading."""


class LeaseLostError(StoreError):
    """This candidate's lease expired, was revoked, or could not be kept alive in time."""


class LeaderElection:
    """One candidate: campaigns, leads or follows until cancelled.

    Args:
        store: The store every candidate shares.
        me: How others reach this candidate; its address must be unique among candidates.
        lease_s: Lease ttl: how long a dead leader keeps the lead.
        on_elected: Called on winning, with the fencing token.
        on_deposed: Called on losing the lead (at once, before the lease would expire).
        retry_s: Wait before a new lease after the store failed; default ``lease_s / 3``.
    """

    def __init__(
        self,
        store: Store,
        me: CoordinatorInfo,
        *,
        lease_s: float = DEFAULT_LEASE_S,
        on_elected: ElectedCallback,
        on_deposed: DeposedCallback,
        retry_s: float | None = None,
    ) -> None:
        if lease_s <= 0:
            raise ValueError("lease_s must be positive")
        self._store = store
        self._me = me
        self._lease_s = lease_s
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._retry_s = retry_s if retry_s is not None else lease_s / 3
        self._leader: CoordinatorInfo | None = None
        self._leader_known = asyncio.Event()
        self._revision: int | None = None
        self.lease = 0
        """The lease of the current session (0 between sessions)."""

    @property
    def me(self) -> CoordinatorInfo:
        """This candidate."""
        return self._me

    @property
    def is_leader(self) -> bool:
        """Whether this candidate leads now."""
        return self._revision is not None

    @property
    def revision(self) -> int | None:
        """The fencing token while leading, else ``None``."""
        return self._revision

    def leader(self) -> CoordinatorInfo | None:
        """The leader as last seen (this candidate while it leads), or ``None``."""
        return self._leader

    async def known_leader(self) -> CoordinatorInfo:
        """The leader, once one is known (waits while none is)."""
        while self._leader is None:
            await self._leader_known.wait()
        return self._leader

    async def members(self) -> list[CoordinatorInfo]:
        """Every running candidate, ordered by address."""
        return [CoordinatorInfo.decode(kv.value) for kv in await self._store.range(MEMBERS)]

    async def run(self) -> None:
        """Take part until cancelled; on cancellation step down and give the lease back."""
        while True:
            try:
                await self._session()
            except StoreError as err:
                log.warning("election_session_ended", error=str(err))
            except Exception:
                log.exception("election_session_failed")  # e.g. taking the lead failed
            await asyncio.sleep(self._retry_s)  # a store that just failed is not hammered

    async def _session(self) -> None:
        """One lease: register, campaign, lead or follow, until the lease is lost."""
        granted_at = time.monotonic()
        lease = await self._store.grant_lease(self._lease_s)
        self.lease = lease
        keeper = asyncio.create_task(self._keep_alive(lease, granted_at + self._lease_s))
        campaign = asyncio.create_task(self._campaign(lease))
        try:
            done, _ = await asyncio.wait({keeper, campaign}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # raises whatever ended the session
            raise AssertionError("an election task ended without an error")  # pragma: no cover
        finally:
            for task in (keeper, campaign):
                task.cancel()
            await asyncio.gather(keeper, campaign, return_exceptions=True)
            await self._step_down()
            self.lease = 0
            await self._revoke(lease)

    async def _keep_alive(self, lease: int, expires: float) -> None:
        """Refresh the lease every ``lease_s / 3``; raise once it is lost or about to be."""
        while True:
            await asyncio.sleep(self._lease_s / 3)
            sent = time.monotonic()
            if sent >= expires:
                raise LeaseLostError("no keepalive got through before the lease ran out")
            try:
                async with asyncio.timeout(expires - sent):
                    await self._store.keepalive(lease)
            except TimeoutError:
                raise LeaseLostError("no keepalive answer before the lease ran out") from None
            except LeaseNotFoundError:
                raise LeaseLostError(f"lease {lease} expired or was revoked") from None
            except StoreError as err:
                log.warning("lease_keepalive_failed", lease=lease, error=str(err))
                continue  # the next tick tries again; the deadline decides
            expires = sent + self._lease_s

    async def _campaign(self, lease: int) -> None:
        """Register, then try to create the leader key until this candidate leads."""
        await self._store.commit([Put(MEMBERS + self._me.address, self._me.encode(), lease=lease)])
        while True:
            try:
                revision = await self._store.commit(
                    [Put(LEADER_KEY, self._me.encode(), expect_revision=0, lease=lease)]
                )
            except CasConflictError:
                kv = await self._store.get(LEADER_KEY)
                if kv is None:
                    continue  # deleted meanwhile: campaign again
                self._see_leader(CoordinatorInfo.decode(kv.value))
                await self._until_changed(kv.mod_revision, deleted_only=True)
                self._see_leader(None)  # gone: nobody leads until the next campaign is won
                continue
            await self._lead(revision)

    async def _lead(self, revision: int) -> None:
        """Lead until the session ends (the keeper fails or the leader key changes)."""
        self._revision = revision
        self._see_leader(self._me)
        log.info("leader_elected", address=self._me.address, revision=revision)
        await self._on_elected(revision)
        while True:
            try:
                await self._until_changed(revision, deleted_only=False)
            except StoreError as err:  # the watch broke, which says nothing of the lease
                log.warning("leader_watch_broken", error=str(err))
                await asyncio.sleep(self._retry_s)
            kv = await self._store.get(LEADER_KEY)
            if kv is None or kv.mod_revision != revision:
                raise LeaseLostError("the leader key was deleted or overwritten")

    async def _until_changed(self, revision: int, *, deleted_only: bool) -> None:
        """Return once the leader key written at ``revision`` is deleted (or overwritten)."""
        try:
            async for event in self._store.watch(LEADER_KEY, start_revision=revision + 1):
                if event.kv.key != LEADER_KEY:
                    continue  # a longer key under the same prefix
                if event.type is WatchEventType.DELETE or not deleted_only:
                    return
                self._see_leader(CoordinatorInfo.decode(event.kv.value))
        except CompactedError:
            return  # history is gone: look at the key again

    def _see_leader(self, leader: CoordinatorInfo | None) -> None:
        if leader == self._leader:
            return
        self._leader = leader
        if leader is None:
            self._leader_known.clear()
            return
        self._leader_known.set()
        if leader != self._me:
            log.info("leader_seen", leader=leader.address, me=self._me.address)

    async def _step_down(self) -> None:
        """Stop leading, if this candidate leads."""
        was_leader = self._revision is not None
        self._revision = None
        self._see_leader(None)
        if was_leader:
            log.warning("leader_stepped_down", address=self._me.address)
            await self._on_deposed()

    async def _revoke(self, lease: int) -> None:
        """Give the lease back, so that the others need not wait for it to expire."""
        with contextlib.suppress(StoreError, TimeoutError):
            async with asyncio.timeout(REVOKE_TIMEOUT_S):
                await self._store.revoke(lease)
