"""Behaviour every ``Store`` must have; subclasses of ``StoreContract`` supply ``store``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import ClassVar

import pytest

from federation.api.v1 import (
    audit_service_pb2,
    certificate_service_pb2,
    job_service_pb2,
    jobs_pb2,
    queues_pb2,
    records_pb2,
)
from federation.common import job_state
from federation.coordinator import audit
from federation.coordinator.jobs import index as job_index
from federation.coordinator.jobs.events import EventHub
from federation.coordinator.jobs.listing import ListFilter
from federation.coordinator.jobs.records import JOBS, Change, read_record, transition
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.policy.queues import QueueBook
from federation.coordinator.scheduling.learning import MAX_PUTS_PER_COMMIT, MIN_TASKS, SpeedLearner
from federation.coordinator.security.certificates import Certificates
from federation.coordinator.sites.enrollment import CERTIFICATES
from federation.security.pki import CertificateAuthority
from federation.security.revocation import RevocationBook, supersession_key
from federation.store import (
    CasConflictError,
    Check,
    Delete,
    LeaseNotFoundError,
    Put,
    Store,
    WatchEvent,
    WatchEventType,
)
from federation.store.revocations import follow, load

PUT = WatchEventType.PUT
DELETE = WatchEventType.DELETE
WAIT_S = 5.0  # upper bound for anything that should happen promptly


async def take(events: AsyncIterator[WatchEvent], n: int) -> list[WatchEvent]:
    """The next ``n`` events, failing the test if they take longer than ``WAIT_S``."""
    out: list[WatchEvent] = []
    async with asyncio.timeout(WAIT_S):
        while len(out) < n:
            out.append(await anext(events))
    return out


def summary(events: list[WatchEvent]) -> list[tuple[WatchEventType, str, bytes, int]]:
    """The fields of each event that tests compare."""
    return [(e.type, e.kv.key, e.kv.value, e.kv.mod_revision) for e in events]


class StoreContract:
    """Tests shared by every ``Store`` implementation."""

    # Backends with coarser leases (etcd: whole seconds, with a minimum) may raise this.
    lease_ttl_s: ClassVar[float] = 0.5

    # Reads and writes.

    async def test_get_missing_key_returns_none(self, store: Store) -> None:
        """A key that was never written reads as None."""
        assert await store.get("/missing") is None

    async def test_put_then_get_round_trips(self, store: Store) -> None:
        """A put returns the new revision and the key reads back with it."""
        before = await store.revision()
        revision = await store.commit([Put("/a", b"\x00value")])
        assert revision == before + 1
        assert await store.revision() == revision
        kv = await store.get("/a")
        assert kv is not None
        assert (kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.lease) == (
            "/a",
            b"\x00value",
            revision,
            revision,
            0,
        )

    async def test_empty_value_round_trips(self, store: Store) -> None:
        """An empty value is stored as empty bytes, not as a missing key."""
        await store.commit([Put("/empty", b"")])
        kv = await store.get("/empty")
        assert kv is not None
        assert kv.value == b""

    async def test_overwrite_keeps_create_revision_and_advances_mod_revision(
        self, store: Store
    ) -> None:
        """Rewriting a key keeps its create_revision and moves mod_revision to the new commit."""
        first = await store.commit([Put("/a", b"1")])
        second = await store.commit([Put("/a", b"2")])
        kv = await store.get("/a")
        assert kv is not None
        assert second > first
        assert (kv.value, kv.create_revision, kv.mod_revision) == (b"2", first, second)

    async def test_recreated_key_gets_new_create_revision(self, store: Store) -> None:
        """A key written again after a delete starts a new life with a fresh create_revision."""
        await store.commit([Put("/a", b"1")])
        await store.commit([Delete("/a")])
        revision = await store.commit([Put("/a", b"2")])
        kv = await store.get("/a")
        assert kv is not None
        assert kv.create_revision == revision

    async def test_multi_op_commit_uses_one_revision(self, store: Store) -> None:
        """All writes of one commit share a single new revision."""
        await store.commit([Put("/gone", b"x")])
        before = await store.revision()
        revision = await store.commit([Put("/a", b"1"), Put("/b", b"2"), Delete("/gone")])
        assert revision == before + 1
        a, b = await store.get("/a"), await store.get("/b")
        assert a is not None
        assert b is not None
        assert a.mod_revision == b.mod_revision == revision
        assert await store.get("/gone") is None

    async def test_delete_removes_key(self, store: Store) -> None:
        """An unconditional delete removes the key and advances the revision."""
        put = await store.commit([Put("/a", b"1")])
        deleted = await store.commit([Delete("/a")])
        assert deleted == put + 1
        assert await store.get("/a") is None

    async def test_delete_missing_key_is_a_noop(self, store: Store) -> None:
        """Deleting a key that does not exist succeeds without a new revision."""
        before = await store.revision()
        assert await store.commit([Delete("/missing")]) == before
        assert await store.revision() == before

    async def test_duplicate_keys_in_one_commit_are_rejected(self, store: Store) -> None:
        """Two ops on the same key in one commit are refused, as etcd refuses them."""
        with pytest.raises(ValueError, match="twice"):
            await store.commit([Put("/a", b"1"), Delete("/a")])
        assert await store.get("/a") is None

    # Compare-and-swap.

    async def test_create_only_put_fails_when_key_exists(self, store: Store) -> None:
        """expect_revision=0 refuses to overwrite an existing key and reports its revision."""
        revision = await store.commit([Put("/a", b"1")])
        with pytest.raises(CasConflictError) as caught:
            await store.commit([Put("/a", b"2", expect_revision=0)])
        assert (caught.value.key, caught.value.expected, caught.value.actual) == ("/a", 0, revision)
        kv = await store.get("/a")
        assert kv is not None
        assert kv.value == b"1"

    async def test_create_only_put_succeeds_when_key_is_missing(self, store: Store) -> None:
        """expect_revision=0 writes a key that does not exist yet."""
        await store.commit([Put("/a", b"1", expect_revision=0)])
        assert await store.get("/a") is not None

    async def test_put_with_matching_revision_succeeds(self, store: Store) -> None:
        """A put expecting the key's current mod_revision is applied."""
        revision = await store.commit([Put("/a", b"1")])
        await store.commit([Put("/a", b"2", expect_revision=revision)])
        kv = await store.get("/a")
        assert kv is not None
        assert kv.value == b"2"

    async def test_put_with_wrong_revision_fails(self, store: Store) -> None:
        """A put expecting a revision other than the key's mod_revision is refused."""
        revision = await store.commit([Put("/a", b"1")])
        with pytest.raises(CasConflictError) as caught:
            await store.commit([Put("/a", b"2", expect_revision=revision + 100)])
        assert (caught.value.expected, caught.value.actual) == (revision + 100, revision)

    async def test_expected_revision_on_missing_key_fails(self, store: Store) -> None:
        """A put expecting a revision of a key that does not exist reports actual 0."""
        with pytest.raises(CasConflictError) as caught:
            await store.commit([Put("/a", b"1", expect_revision=5)])
        assert caught.value.actual == 0
        assert await store.get("/a") is None

    async def test_failed_commit_writes_nothing(self, store: Store) -> None:
        """When one expectation fails, the other ops of the commit are not applied either."""
        await store.commit([Put("/taken", b"1"), Put("/old", b"1")])
        before = await store.revision()
        with pytest.raises(CasConflictError):
            await store.commit(
                [Put("/new", b"2"), Delete("/old"), Put("/taken", b"2", expect_revision=0)]
            )
        assert await store.get("/new") is None
        assert await store.get("/old") is not None
        assert await store.revision() == before

    async def test_delete_with_wrong_revision_fails(self, store: Store) -> None:
        """A delete expecting a stale revision is refused and the key stays."""
        first = await store.commit([Put("/a", b"1")])
        await store.commit([Put("/a", b"2")])
        with pytest.raises(CasConflictError):
            await store.commit([Delete("/a", expect_revision=first)])
        assert await store.get("/a") is not None

    async def test_delete_with_matching_revision_succeeds(self, store: Store) -> None:
        """A delete expecting the key's current mod_revision removes it."""
        revision = await store.commit([Put("/a", b"1")])
        await store.commit([Delete("/a", expect_revision=revision)])
        assert await store.get("/a") is None

    async def test_concurrent_cas_has_exactly_one_winner(self, store: Store) -> None:
        """Of 20 concurrent commits expecting the same revision, exactly one is applied."""
        revision = await store.commit([Put("/counter", b"start")])
        results = await asyncio.gather(
            *(
                store.commit([Put("/counter", str(i).encode(), expect_revision=revision)])
                for i in range(20)
            ),
            return_exceptions=True,
        )
        winners = [i for i, result in enumerate(results) if isinstance(result, int)]
        assert len(winners) == 1
        assert all(isinstance(r, CasConflictError) for r in results if not isinstance(r, int))
        kv = await store.get("/counter")
        assert kv is not None
        assert kv.value == str(winners[0]).encode()

    # Guards (Check).

    async def test_check_that_holds_lets_the_commit_apply(self, store: Store) -> None:
        """A commit guarded by a check on an unchanged key applies, and leaves that key alone."""
        guard = await store.commit([Put("/leader", b"me")])
        revision = await store.commit([Check("/leader", guard), Put("/jobs/a", b"1")])
        assert revision == guard + 1
        leader, job = await store.get("/leader"), await store.get("/jobs/a")
        assert leader is not None
        assert job is not None
        assert (leader.value, leader.mod_revision, job.value) == (b"me", guard, b"1")

    async def test_check_on_changed_key_fails_and_writes_nothing(self, store: Store) -> None:
        """A check on a key rewritten since refuses the whole commit and names the key."""
        guard = await store.commit([Put("/leader", b"me")])
        moved = await store.commit([Put("/leader", b"other")])
        with pytest.raises(CasConflictError) as caught:
            await store.commit([Put("/jobs/a", b"1"), Check("/leader", guard)])
        assert (caught.value.key, caught.value.expected, caught.value.actual) == (
            "/leader",
            guard,
            moved,
        )
        assert await store.get("/jobs/a") is None
        assert await store.revision() == moved

    async def test_check_on_deleted_key_fails(self, store: Store) -> None:
        """A check on a key deleted since (as lease expiry deletes it) fails with actual 0."""
        lease = await store.grant_lease(60)
        guard = await store.commit([Put("/leader", b"me", lease=lease)])
        await store.revoke(lease)
        with pytest.raises(CasConflictError) as caught:
            await store.commit([Check("/leader", guard), Put("/jobs/a", b"1")])
        assert caught.value.actual == 0
        assert await store.get("/jobs/a") is None

    async def test_check_zero_requires_a_missing_key(self, store: Store) -> None:
        """A check expecting revision 0 holds while the key is missing and fails once it exists."""
        await store.commit([Check("/leader", 0), Put("/a", b"1")])
        await store.commit([Put("/leader", b"me")])
        with pytest.raises(CasConflictError):
            await store.commit([Check("/leader", 0), Put("/b", b"1")])
        assert await store.get("/b") is None

    async def test_checks_alone_change_nothing(self, store: Store) -> None:
        """A commit of checks only does not advance the revision."""
        guard = await store.commit([Put("/leader", b"me")])
        assert await store.commit([Check("/leader", guard), Check("/missing", 0)]) == guard
        assert await store.revision() == guard

    async def test_check_with_negative_revision_is_rejected(self, store: Store) -> None:
        """A check expecting a negative revision is refused before anything is sent."""
        with pytest.raises(ValueError, match="negative"):
            await store.commit([Check("/leader", -1), Put("/a", b"1")])
        assert await store.get("/a") is None

    # Range and count.

    async def _fill_jobs(self, store: Store) -> None:
        await store.commit(
            [
                Put("/jobs/b", b"b"),
                Put("/jobs/a", b"a"),
                Put("/jobs/c", b"c"),
                Put("/jobs2/x", b"x"),
                Put("/jobs", b"bare"),
                Put("/jobr", b"before"),
            ]
        )

    async def test_range_returns_prefix_sorted_by_key(self, store: Store) -> None:
        """range returns only keys under the prefix, sorted, with their values."""
        await self._fill_jobs(store)
        kvs = await store.range("/jobs/")
        assert [(kv.key, kv.value) for kv in kvs] == [
            ("/jobs/a", b"a"),
            ("/jobs/b", b"b"),
            ("/jobs/c", b"c"),
        ]

    async def test_range_honours_start_after_and_limit(self, store: Store) -> None:
        """start_after skips keys up to and including it; limit caps the page."""
        await self._fill_jobs(store)
        assert [kv.key for kv in await store.range("/jobs/", start_after="/jobs/a")] == [
            "/jobs/b",
            "/jobs/c",
        ]
        assert [kv.key for kv in await store.range("/jobs/", limit=2)] == ["/jobs/a", "/jobs/b"]
        page = await store.range("/jobs/", start_after="/jobs/a", limit=1)
        assert [kv.key for kv in page] == ["/jobs/b"]
        assert await store.range("/jobs/", start_after="/jobs/c") == []
        assert len(await store.range("/jobs/", start_after="/jobr")) == 3

    async def test_empty_prefix_ranges_over_everything(self, store: Store) -> None:
        """The empty prefix selects every key in the store."""
        await self._fill_jobs(store)
        assert len(await store.range("")) == 6

    async def test_count_matches_prefix(self, store: Store) -> None:
        """count counts exactly the keys under the prefix."""
        await self._fill_jobs(store)
        assert await store.count("/jobs/") == 3
        assert await store.count("/jobs2/") == 1
        assert await store.count("/nothing/") == 0
        assert await store.count("") == 6

    # Watch.

    async def test_watch_replays_history_in_order(self, store: Store) -> None:
        """A watch from an old revision replays puts and deletes in revision order."""
        first = await store.commit([Put("/w/a", b"1")])
        second = await store.commit([Put("/w/b", b"2")])
        third = await store.commit([Delete("/w/a")])
        events = await take(store.watch("/w/", start_revision=first), 3)
        assert summary(events) == [
            (PUT, "/w/a", b"1", first),
            (PUT, "/w/b", b"2", second),
            (DELETE, "/w/a", b"", third),
        ]
        assert events[0].kv.create_revision == first

    async def test_watch_starts_mid_history(self, store: Store) -> None:
        """Events older than start_revision are not replayed."""
        await store.commit([Put("/w/a", b"1")])
        second = await store.commit([Put("/w/b", b"2")])
        events = await take(store.watch("/w/", start_revision=second), 1)
        assert summary(events) == [(PUT, "/w/b", b"2", second)]

    async def test_watch_continues_from_history_into_live_events(self, store: Store) -> None:
        """After replaying history a watch delivers new commits as they happen."""
        first = await store.commit([Put("/w/a", b"1")])
        events = store.watch("/w/", start_revision=first)
        assert summary(await take(events, 1)) == [(PUT, "/w/a", b"1", first)]
        waiting = asyncio.create_task(take(events, 2))
        await asyncio.sleep(0.05)  # let the watcher block on "nothing new" before committing
        assert not waiting.done()
        second = await store.commit([Put("/w/b", b"2"), Delete("/w/a")])
        live = await waiting
        assert summary(live) == [(PUT, "/w/b", b"2", second), (DELETE, "/w/a", b"", second)]

    async def test_watch_without_start_revision_sees_only_later_changes(self, store: Store) -> None:
        """start_revision=0 skips everything committed before the watch call."""
        await store.commit([Put("/w/old", b"1")])
        events = store.watch("/w/")
        revision = await store.commit([Put("/w/new", b"2")])
        assert summary(await take(events, 1)) == [(PUT, "/w/new", b"2", revision)]

    async def test_watch_filters_by_prefix(self, store: Store) -> None:
        """A watch sees keys under its prefix and none under a neighbouring one."""
        start = await store.revision() + 1
        await store.commit([Put("/jobs2/x", b"x")])
        await store.commit([Put("/jobs/a", b"a")])
        await store.commit([Put("/other", b"o"), Put("/jobs2/y", b"y")])
        await store.commit([Put("/jobs/b", b"b")])
        events = await take(store.watch("/jobs/", start_revision=start), 2)
        assert [e.kv.key for e in events] == ["/jobs/a", "/jobs/b"]

    # Leases.

    async def test_put_with_unknown_lease_fails(self, store: Store) -> None:
        """A put attached to a lease that does not exist is refused and writes nothing."""
        with pytest.raises(LeaseNotFoundError):
            await store.commit([Put("/a", b"1"), Put("/b", b"2", lease=987654)])
        assert await store.get("/a") is None

    async def test_leased_key_vanishes_after_ttl(self, store: Store) -> None:
        """Without keepalives, a lease's keys are deleted (with DELETE events) after its ttl."""
        started = time.monotonic()
        lease = await store.grant_lease(self.lease_ttl_s)
        revision = await store.commit([Put("/live/agent", b"up", lease=lease)])
        kv = await store.get("/live/agent")
        assert kv is not None
        assert kv.lease == lease
        async with asyncio.timeout(self.lease_ttl_s + WAIT_S):
            async for event in store.watch("/live/", start_revision=revision + 1):
                if event.type is DELETE and event.kv.key == "/live/agent":
                    break
        assert time.monotonic() - started >= self.lease_ttl_s
        assert await store.get("/live/agent") is None
        with pytest.raises(LeaseNotFoundError):
            await store.keepalive(lease)

    async def test_keepalive_extends_lease(self, store: Store) -> None:
        """Keepalives keep a lease's keys well past the original ttl."""
        lease = await store.grant_lease(self.lease_ttl_s)
        await store.commit([Put("/live/agent", b"up", lease=lease)])
        deadline = time.monotonic() + 3 * self.lease_ttl_s
        while time.monotonic() < deadline:
            await store.keepalive(lease)
            await asyncio.sleep(self.lease_ttl_s / 5)
        assert await store.get("/live/agent") is not None

    async def test_revoke_deletes_keys_with_delete_events(self, store: Store) -> None:
        """Revoking a lease deletes its keys in one revision and reports them to watchers."""
        lease = await store.grant_lease(60)
        put = await store.commit(
            [Put("/live/a", b"1", lease=lease), Put("/live/b", b"2", lease=lease)]
        )
        events = store.watch("/live/", start_revision=put + 1)
        await store.revoke(lease)
        deleted = await take(events, 2)
        assert {(e.type, e.kv.key, e.kv.mod_revision) for e in deleted} == {
            (DELETE, "/live/a", put + 1),
            (DELETE, "/live/b", put + 1),
        }
        assert await store.range("/live/") == []

    async def test_keepalive_and_revoke_of_revoked_lease_fail(self, store: Store) -> None:
        """A revoked lease is gone: keepalive and a second revoke raise LeaseNotFoundError."""
        lease = await store.grant_lease(60)
        await store.revoke(lease)
        with pytest.raises(LeaseNotFoundError):
            await store.keepalive(lease)
        with pytest.raises(LeaseNotFoundError):
            await store.revoke(lease)

    async def test_put_without_lease_detaches_key(self, store: Store) -> None:
        """Rewriting a leased key without a lease detaches it, so revoking spares it."""
        lease = await store.grant_lease(60)
        await store.commit([Put("/a", b"1", lease=lease)])
        await store.commit([Put("/a", b"2")])
        await store.revoke(lease)
        kv = await store.get("/a")
        assert kv is not None
        assert (kv.value, kv.lease) == (b"2", 0)

    # State the coordinator keeps.

    async def test_learned_speeds_read_back(self, store: Store) -> None:
        """A coordinator's learned speeds, more than one commit's worth, read back whole in a
        fresh learner (after a restart, or by a new leader)."""
        learner = SpeedLearner(metrics=False)
        for _ in range(MIN_TASKS):
            learner.observe("training", "T4", 60.0, 200.0, 120.0, site="slow site")
            learner.observe("training", "T4", 60.0, 200.0, 60.0, site="fast/site")
        for i in range(MAX_PUTS_PER_COMMIT + 5):
            for _ in range(MIN_TASKS):
                learner.observe("inference", f"model {i}", 10.0, 10.0, 1.0 + i)
        assert await learner.save(store) == MAX_PUTS_PER_COMMIT + 8
        fresh = SpeedLearner(metrics=False)
        assert await fresh.load(store) == MAX_PUTS_PER_COMMIT + 8
        assert fresh.learned() == learner.learned()
        for site in ("slow site", "fast/site"):
            assert fresh.overrides("training", {}, site=site) == learner.overrides(
                "training", {}, site=site
            )

    async def test_queues_read_back(self, store: Store) -> None:
        """Queues written by one coordinator read back whole in a fresh book; a delete stays."""
        book = QueueBook(store)
        quota = queues_pb2.Quota(resource="gpu/A100-80GB", nominal=8, borrowing_limit=4)
        await book.create(queues_pb2.Queue(name="org", tenant="t", quotas=[quota]))
        await book.create(queues_pb2.Queue(name="team", tenant="t", parent="org", weight=2))
        await book.update(queues_pb2.Queue(name="team", tenant="u", parent="org", weight=3))
        fresh = QueueBook(store)
        await fresh.load()
        assert dict(fresh.queues) == dict(book.queues)
        assert fresh.queues["team"].weight == 3
        await fresh.delete("team", used_by=[])
        again = QueueBook(store)
        await again.load()
        assert list(again.queues) == ["org"]

    async def test_revocations_read_back_and_reach_a_follower(self, store: Store) -> None:
        """Revocations one coordinator wrote read back whole in a fresh book; one written
        later reaches a book that follows the store; each left its audit entry."""
        record = records_pb2.IssuedCertificate(serial_hex="abc123", identity="site:edge-1")
        await store.commit([Put(CERTIFICATES + "abc123", record.SerializeToString())])
        revoker = Certificates(store, CertificateAuthority.create(), RevocationBook())
        await revoker.revoke(
            "operator:admin",
            certificate_service_pb2.RevokeCertificatesRequest(serial_hex="abc123", reason="lost"),
        )
        fresh = RevocationBook()
        revision = await load(store, fresh)
        assert [r.serial_hex for r in fresh.revocations()] == ["abc123"]
        marked = await store.get(CERTIFICATES + "abc123")
        assert marked is not None
        assert records_pb2.IssuedCertificate.FromString(marked.value).revoked
        follower = asyncio.create_task(follow(store, fresh, revision))
        try:
            await revoker.revoke(
                "operator:admin",
                certificate_service_pb2.RevokeCertificatesRequest(
                    identity="tenant:t", reason="left"
                ),
            )
            for _ in range(int(WAIT_S / 0.02)):  # the book has no event to wait on
                if "tenant:t" in fresh.by_identity:
                    break
                await asyncio.sleep(0.02)
            assert fresh.by_identity["tenant:t"].reason == "left"
        finally:
            follower.cancel()
        trail = await audit.list_events(store, audit_service_pb2.ListAuditEventsRequest())
        assert [(e.action, e.target) for e in trail.events] == [
            ("certificate.revoke", "tenant:t"),
            ("certificate.revoke", "abc123"),
        ]

    async def test_supersessions_read_back_and_reach_a_follower(self, store: Store) -> None:
        """A renewal's supersession reads back in a fresh book and reaches a following one
        (every coordinator refuses a renewed certificate once its overlap ends); its
        deletion (compaction) is followed too; revocations are untouched by either."""

        def supersession(serial: str, newer: str) -> Put:
            record = records_pb2.Supersession(
                serial_hex=serial, identity="tenant:t", superseded_by=newer
            )
            return Put(supersession_key(serial), record.SerializeToString())

        await store.commit([supersession("a1", "b2")])
        fresh = RevocationBook()
        revision = await load(store, fresh)
        assert fresh.renewals_of("a1") == ["b2"]
        assert fresh.revocations() == []
        follower = asyncio.create_task(follow(store, fresh, revision))
        try:
            await store.commit([supersession("b2", "c3")])
            for _ in range(int(WAIT_S / 0.02)):  # the book has no event to wait on
                if "b2" in fresh.superseded:
                    break
                await asyncio.sleep(0.02)
            assert fresh.renewals_of("a1") == ["b2", "c3"]
            await store.commit([Delete(supersession_key("a1"))])
            for _ in range(int(WAIT_S / 0.02)):
                if "a1" not in fresh.superseded:
                    break
                await asyncio.sleep(0.02)
            assert list(fresh.superseded) == ["b2"]
        finally:
            follower.cancel()

    async def test_job_indexes_and_retention_read_back(self, store: Store) -> None:
        """Jobs written through the repository, more than one commit's worth, read back from
        their indexes in a fresh repository (counts and a filtered listing); once past their
        time, the finished ones leave with every index entry, and the counts follow."""
        repo = JobRepository(store, EventHub())
        await repo.load()
        jobs = []
        for i in range(40):
            job = jobs_pb2.Job(id=f"j{i:02d}", state=job_state.PENDING)
            job.spec.tenant = "t/a" if i % 2 else "t b"
            job.spec.tasks.add(name="main")
            job.tasks.add(name="main", state=job_state.PENDING)
            jobs.append(job)
        await repo.create(jobs)

        def cancel(job: jobs_pb2.Job) -> list[Change]:
            return [transition(job, "main", job_state.CANCELLED, "stop")]

        results = await repo.update_many([(f"j{i:02d}", cancel) for i in range(0, 40, 3)])
        assert all(isinstance(r, jobs_pb2.Job) for r in results.values())
        fresh = JobRepository(store, EventHub())
        assert len(await fresh.load()) == 26
        counts = {"JOB_STATE_PENDING": 26, "JOB_STATE_CANCELLED": 14}
        assert await fresh.count_by_state() == counts
        page = job_service_pb2.ListJobsResponse().jobs
        where = ListFilter.of((job_state.CANCELLED,), "t/a")
        assert await fresh.list_page(lambda job: True, page, 100, "", where=where) == ""
        assert [job.id for job in page] == [f"j{i:02d}" for i in range(3, 40, 6)]
        assert await fresh.remove_finished(time.time_ns() + 10**9) == 14
        assert await fresh.count_by_state() == {"JOB_STATE_PENDING": 26}
        assert await store.count(JOBS) == 26
        stored = [read_record(kv.value).job for kv in await store.range(JOBS)]
        indexed = {kv.key for kv in await store.range(job_index.INDEX)}
        assert indexed == set().union(*(job_index.keys(job) for job in stored))
