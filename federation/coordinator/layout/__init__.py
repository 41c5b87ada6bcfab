"""The layout of the keys a coordinator writes, its version in the store, and migrations.

``LAYOUT_KEY`` holds the version of the key layout the store is in (a decimal number). A
coordinator that leads brings the store to ``CURRENT`` before it loads anything: step by step,
with the migration registered for each older version (``MIGRATIONS``). A migration writes in
bounded commits (etcd takes at most 128 operations per transaction) and records how far it got
under ``PROGRESS_KEY`` in the same commits, so a leader that dies or loses its lease mid-way
leaves a store that the next leader carries on migrating. A store of a newer layout than this
release knows is refused: downgrades are not supported.

History of the layout:

1. Each job alone under ``/jobs/ID``; each of its events under ``/events/ID/SEQUENCE``.
2. One ``JobRecord`` per job under ``/jobs/ID``: the job and its newest events.
3. As 2, with each job's index entries under ``/index/`` (``federation.coordinator.jobs.index``).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from federation.coordinator.jobs.records import JOBS, OLD_EVENTS
from federation.store import Delete, Put, Store, StoreError

log = structlog.get_logger()

LAYOUT_KEY = "/meta/layout"
PROGRESS_KEY = "/meta/layout-migration"
"""Where a migration under way records its source version and how far it got."""
CURRENT = 3
"""The layout this release writes."""
MAX_OPS = 100
"""Most writes one migration commit makes: below etcd's 128 operations per transaction,
leaving room for the progress record and the leader's fencing check."""
MAX_BYTES = 1 << 20
"""Most bytes of values one migration commit writes: below etcd's 1.5 MiB request limit."""


class LayoutError(StoreError):
    """The store is laid out by a newer release, or its layout version cannot be read."""


@dataclass(frozen=True, slots=True)
class Progress:
    """How far a migration from ``source`` got: ``cursor`` is the migration's own mark."""

    source: int
    cursor: str = ""

    def put(self, cursor: str) -> Put:
        """The write that records ``cursor``: add it to the commit that got that far."""
        return Put(PROGRESS_KEY, json.dumps({"source": self.source, "cursor": cursor}).encode())


Migrate = Callable[[Store, Progress], Awaitable[None]]
"""Brings a store from one layout to the next, committing ``Progress.put`` as it goes."""


@dataclass(frozen=True, slots=True)
class Migration:
    source: int
    """The layout it reads; it leaves the store in ``source + 1``."""
    what: str
    run: Migrate


def _migrations() -> dict[int, Migration]:
    """Version -> the migration from it to the next (imported late: they import this)."""
    from federation.coordinator.layout import events_to_records, job_indexes

    return {
        1: Migration(1, "jobs and their events into one JobRecord each", events_to_records.run),
        2: Migration(
            2, "index entries for every job (state, tenant, site, queue)", job_indexes.run
        ),
    }


async def stored_layout(store: Store) -> int | None:
    """The layout version ``store`` records, or ``None`` when it records none.

    Raises:
        LayoutError: The recorded version is not a number.
    """
    kv = await store.get(LAYOUT_KEY)
    if kv is None:
        return None
    try:
        return int(kv.value.decode())
    except (UnicodeDecodeError, ValueError):
        raise LayoutError(f"{LAYOUT_KEY} holds {kv.value[:32]!r}, not a layout version") from None


async def found_layout(store: Store) -> int:
    """The layout ``store`` is in: the recorded one, else the one its keys show (releases
    before the record wrote layout 1 or 2; only layout 1 has keys under ``/events/``; a store
    with no jobs at all is taken as fresh)."""
    recorded = await stored_layout(store)
    if recorded is not None:
        return recorded
    if await store.count(OLD_EVENTS):
        return 1
    return 2 if await store.range(JOBS, limit=1) else CURRENT


def check_not_newer(version: int, current: int = CURRENT) -> None:
    """Raise ``LayoutError`` for a layout newer than this release knows."""
    if version > current:
        raise LayoutError(
            f"the store is in key layout {version}, newer than layout {current} that this "
            "coordinator knows: downgrades are not supported. To fix: run a release that "
            f"knows layout {version}"
        )


async def check_layout(store: Store) -> None:
    """Refuse, without writing, a store of a newer layout (every coordinator, at start)."""
    check_not_newer(await found_layout(store))


async def upgrade_layout(
    store: Store, migrations: dict[int, Migration] | None = None, current: int = CURRENT
) -> int:
    """Bring ``store`` to layout ``current``, migrating step by step; returns the version it
    found. Only the leading coordinator calls this, through its fenced store.

    Raises:
        LayoutError: The store is of a newer layout, or no migration leads from its own.
    """
    table = _migrations() if migrations is None else migrations
    found = version = await found_layout(store)
    check_not_newer(version, current)
    if await stored_layout(store) is None:  # a fresh store, or one from before the record
        await store.commit([Put(LAYOUT_KEY, str(version).encode())])
    while version < current:
        migration = table.get(version)
        if migration is None:
            raise LayoutError(f"no migration from key layout {version}; run an older release")
        progress = await _progress(store, version)
        log.info(
            "layout_migration_started",
            source=version,
            target=version + 1,
            what=migration.what,
            resumed_at=progress.cursor or None,
        )
        await migration.run(store, progress)
        version += 1
        await store.commit([Put(LAYOUT_KEY, str(version).encode()), Delete(PROGRESS_KEY)])
        log.info("layout_migrated", layout=version)
    return found


async def _progress(store: Store, source: int) -> Progress:
    """Where an interrupted migration from ``source`` got to, or its start."""
    kv = await store.get(PROGRESS_KEY)
    if kv is None:
        return Progress(source)
    record = json.loads(kv.value)
    if record.get("source") != source:
        return Progress(source)  # left by an earlier step, which completed
    return Progress(source, str(record.get("cursor", "")))
