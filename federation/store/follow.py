"""Following what is under a prefix: every change from a revision on, read again after a break."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from federation.store.base import CompactedError, Store, StoreError, WatchEvent

log = structlog.get_logger()

RETRY_S = 0.5
"""Between a broken watch and reading the prefix again."""


async def follow(
    store: Store,
    prefix: str,
    revision: int,
    apply: Callable[[WatchEvent], Awaitable[None]],
    reload: Callable[[], Awaitable[int]],
    what: str,
) -> None:
    """``apply`` every change under ``prefix`` after ``revision``, until cancelled.

    A broken watch (the store restarting, history compacted) may have missed changes:
    ``reload`` reads the whole state again and returns the revision it read at or after, and
    the watch goes on from there. Breaks are logged as ``{what}_watch_broken``.
    """
    while True:
        try:
            async for event in store.watch(prefix, start_revision=revision + 1):
                revision = max(revision, event.kv.mod_revision)
                await apply(event)
        except (StoreError, CompactedError) as err:
            log.warning(f"{what}_watch_broken", error=str(err))
        await asyncio.sleep(RETRY_S)
        try:
            revision = await reload()
        except StoreError as err:
            log.warning(f"{what}_reload_failed", error=str(err))
