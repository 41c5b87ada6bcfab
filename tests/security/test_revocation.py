"""The revocation book: what a revocation covers, and keeping it current from the store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

from federation.api.v1 import records_pb2
from federation.security.identity import Identity, Role
from federation.security.pki import CertificateAuthority
from federation.security.revocation import (
    PeerCertificate,
    RevocationBook,
    peer_certificate_of,
    revocation_key,
)
from federation.store import Delete, Put, SqliteStore
from federation.store.revocations import follow, load

TENANT = Identity(Role.TENANT, "team-a")


def by_identity(identity: str, at_s: int) -> records_pb2.Revocation:
    revocation = records_pb2.Revocation(identity=identity, reason="r")
    revocation.revoked_at.seconds = at_s
    return revocation


def test_an_identity_revocation_covers_certificates_issued_up_to_it() -> None:
    book = RevocationBook()
    book.apply(by_identity("tenant:team-a", 1000))
    assert book.revocation_of(PeerCertificate(TENANT, "a1", 999)) is not None
    assert book.revocation_of(PeerCertificate(TENANT, "a2", 1000)) is not None  # same second
    assert book.revocation_of(PeerCertificate(TENANT, "a3", 1001)) is None
    other = PeerCertificate(Identity(Role.TENANT, "team-b"), "b1", 10)
    assert book.revocation_of(other) is None


def test_a_serial_revocation_covers_that_certificate_only() -> None:
    book = RevocationBook()
    book.apply(records_pb2.Revocation(serial_hex="a1", reason="r"))
    assert book.revocation_of(PeerCertificate(TENANT, "a1", 5)) is not None
    assert book.revocation_of(PeerCertificate(TENANT, "a2", 5)) is None


def test_the_issue_time_is_not_before_plus_the_clock_skew() -> None:
    cert_pem, _ = CertificateAuthority.create().issue_client(TENANT)
    cert = peer_certificate_of(cert_pem)
    assert cert.identity == TENANT
    assert abs(cert.issued_s - time.time()) < 2


async def test_open_streams_of_a_revoked_certificate_are_cancelled() -> None:
    book = RevocationBook()

    async def serve(cert: PeerCertificate) -> None:
        book.open_stream(cert)
        await asyncio.sleep(60)

    mine = asyncio.create_task(serve(PeerCertificate(TENANT, "a1", 5)))
    later = asyncio.create_task(serve(PeerCertificate(TENANT, "a2", 50)))
    await asyncio.sleep(0)
    book.apply(by_identity("tenant:team-a", 10))
    await asyncio.sleep(0)
    assert mine.cancelled()
    assert not later.done()
    later.cancel()


async def within_a_second(check: Callable[[], bool]) -> None:
    for _ in range(100):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within a second")


async def test_the_book_follows_the_store(tmp_path: Path) -> None:
    store = await SqliteStore.open(tmp_path / "db")
    first = by_identity("tenant:team-a", 10)
    await store.commit([Put(revocation_key(first), first.SerializeToString())])
    book = RevocationBook()
    follower = asyncio.create_task(follow(store, book, await load(store, book)))
    try:
        assert list(book.by_identity) == ["tenant:team-a"]
        second = records_pb2.Revocation(serial_hex="ff", reason="r")
        await store.commit([Put(revocation_key(second), second.SerializeToString())])
        await within_a_second(lambda: "ff" in book.by_serial)
        await store.commit([Delete(revocation_key(first))])
        await within_a_second(lambda: not book.by_identity)
    finally:
        follower.cancel()
        await store.close()
