"""The store's revocation list read into a coordinator's ``RevocationBook`` and kept current.

Here, beside the store, so that ``federation.security`` never imports the store it lies under.
"""

from __future__ import annotations

from federation.api.v1 import records_pb2
from federation.security.revocation import REVOCATIONS, SUPERSEDED, RevocationBook
from federation.store.base import Store, WatchEvent, WatchEventType
from federation.store.follow import follow as follow_prefix


async def load(store: Store, book: RevocationBook) -> int:
    """Read every revocation into ``book``; returns the store revision it read at or after."""
    revision = await store.revision()
    kvs = await store.range(REVOCATIONS)
    revoked = [kv for kv in kvs if not kv.key.startswith(SUPERSEDED)]
    renewed = [kv for kv in kvs if kv.key.startswith(SUPERSEDED)]
    book.replace(
        (records_pb2.Revocation.FromString(kv.value) for kv in revoked),
        (records_pb2.Supersession.FromString(kv.value) for kv in renewed),
    )
    return revision


async def follow(store: Store, book: RevocationBook, revision: int) -> None:
    """Keep ``book`` current from the store's watch after ``revision``, until cancelled.

    A broken watch (the store restarting, history compacted) reads the whole list again.
    """

    async def apply(event: WatchEvent) -> None:
        if event.type is WatchEventType.DELETE:
            book.forget(event.kv.key)
        elif event.kv.key.startswith(SUPERSEDED):
            book.supersede(records_pb2.Supersession.FromString(event.kv.value))
        else:
            book.apply(records_pb2.Revocation.FromString(event.kv.value))

    await follow_prefix(
        store, REVOCATIONS, revision, apply, lambda: load(store, book), "revocation"
    )
