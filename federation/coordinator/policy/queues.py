"""The queues operators create, kept in the store under ``/queues/<name>``."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Collection, Mapping, Sequence

import structlog

from federation.api.v1 import queues_pb2, resources_pb2
from federation.coordinator.jobs.validation import name_problem
from federation.coordinator.policy.resources import quota_key, quota_label
from federation.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    FieldViolation,
    InvalidArgumentError,
    QueueNotFoundError,
)
from federation.resources import resource_problem
from federation.store import CasConflictError, Delete, Op, Put, Store

log = structlog.get_logger()

QUEUES = "/queues/"
MAX_QUEUES = 10_000
MAX_QUOTAS = 64
MAX_AMOUNT = 1e12


def queue_key(name: str) -> str:
    return QUEUES + name


def queue_violations(
    queue: queues_pb2.Queue, known: Mapping[str, queues_pb2.Queue], path: str = "queue"
) -> list[FieldViolation]:
    """What is wrong with ``queue`` beside the ``known`` queues (it may replace its own)."""
    out = []
    if problem := name_problem(queue.name):
        out.append(FieldViolation(f"{path}.name", problem))
    if not queue.tenant:
        out.append(FieldViolation(f"{path}.tenant", "is required: the tenant that owns it"))
    elif problem := name_problem(queue.tenant):
        out.append(FieldViolation(f"{path}.tenant", problem))
    if not (math.isfinite(queue.weight) and 0 <= queue.weight <= MAX_AMOUNT):
        out.append(FieldViolation(f"{path}.weight", f"must be a number >= 0, got {queue.weight}"))
    if queue.parent:
        if queue.parent not in known:
            out.append(FieldViolation(f"{path}.parent", f"no queue {queue.parent[:64]!r}"))
        elif cycle := _cycle(queue, known):
            out.append(FieldViolation(f"{path}.parent", f"makes a cycle: {' -> '.join(cycle)}"))
    if len(queue.quotas) > MAX_QUOTAS:
        out.append(FieldViolation(f"{path}.quotas", f"at most {MAX_QUOTAS} quotas"))
    seen: set[str] = set()
    for i, quota in enumerate(queue.quotas[:MAX_QUOTAS]):
        where = f"{path}.quotas[{i}]"
        if problem := resource_problem(quota.resource):
            out.append(FieldViolation(f"{where}.resource", problem))
        elif quota_key(quota) in seen:
            out.append(FieldViolation(f"{where}.resource", f"{quota_label(quota)} appears twice"))
        seen.add(quota_key(quota))
        if quota.site and quota.domain:
            out.append(FieldViolation(f"{where}.domain", "give a site or a domain, not both"))
        if quota.site and (problem := name_problem(quota.site)):
            out.append(FieldViolation(f"{where}.site", problem))
        if quota.domain not in resources_pb2.Domain.values():
            out.append(FieldViolation(f"{where}.domain", f"unknown domain {quota.domain}"))
        for name in ("nominal", "borrowing_limit"):
            value = getattr(quota, name)
            if not (math.isfinite(value) and 0 <= value <= MAX_AMOUNT):
                out.append(FieldViolation(f"{where}.{name}", f"must be a number >= 0, got {value}"))
    return out


def _cycle(queue: queues_pb2.Queue, known: Mapping[str, queues_pb2.Queue]) -> list[str]:
    """The names around a cycle that ``queue``'s parent would close, or []."""
    path = [queue.name]
    current = queue.parent
    while current:
        path.append(current)
        if current == queue.name:
            return path
        parent = known.get(current)
        current = parent.parent if parent is not None else ""
    return []


class QueueTable:
    """The queues by name, as scheduling reads them: nothing here writes (the simulator's
    are the topology's; the coordinator's are a ``QueueBook``)."""

    def __init__(self, queues: Mapping[str, queues_pb2.Queue] | None = None) -> None:
        self._queues: dict[str, queues_pb2.Queue] = dict(queues or {})

    @property
    def queues(self) -> Mapping[str, queues_pb2.Queue]:
        """The queues by name (read them, never change them)."""
        return self._queues

    def get(self, name: str) -> queues_pb2.Queue:
        queue = self._queues.get(name)
        if queue is None:
            raise QueueNotFoundError(name)
        return queue

    def children(self, name: str) -> list[str]:
        return [q.name for q in self._queues.values() if q.parent == name]


class QueueBook(QueueTable):
    """Every queue, cached from the store; writes go to the store first."""

    def __init__(self, store: Store) -> None:
        super().__init__()
        self._store = store
        self._revisions: dict[str, int] = {}
        self._writing = asyncio.Lock()
        """One write at a time: a check (a parent exists, no children) holds until it lands."""

    async def load(self) -> None:
        for kv in await self._store.range(QUEUES, limit=MAX_QUEUES):
            queue = queues_pb2.Queue.FromString(kv.value)
            self._queues[queue.name] = queue
            self._revisions[queue.name] = kv.mod_revision

    async def create(self, queue: queues_pb2.Queue, also: Sequence[Op] = ()) -> queues_pb2.Queue:
        """Store a new queue, and ``also`` (its audit entry) in the same commit."""
        async with self._writing:
            return await self._create(queue, also)

    async def _create(self, queue: queues_pb2.Queue, also: Sequence[Op] = ()) -> queues_pb2.Queue:
        if queue.name in self._queues:
            raise AlreadyExistsError(f"queue {queue.name!r} already exists", queue=queue.name)
        if len(self._queues) >= MAX_QUEUES:
            raise FailedPreconditionError(f"at most {MAX_QUEUES} queues")
        return await self._write(queue, expect_revision=0, also=also)

    async def update(self, queue: queues_pb2.Queue, also: Sequence[Op] = ()) -> queues_pb2.Queue:
        async with self._writing:
            if queue.name not in self._queues:
                raise QueueNotFoundError(queue.name)
            revision = self._revisions[queue.name]
            return await self._write(queue, expect_revision=revision, also=also)

    async def delete(self, name: str, used_by: Collection[str], also: Sequence[Op] = ()) -> None:
        """Delete ``name`` unless ``used_by`` (unfinished jobs naming it) or children."""
        async with self._writing:
            await self._delete(name, used_by, also)

    async def _delete(self, name: str, used_by: Collection[str], also: Sequence[Op] = ()) -> None:
        queue = self.get(name)
        if children := self.children(name):
            raise FailedPreconditionError(
                f"queue {name} has queues under it: {', '.join(sorted(children))}. To fix: "
                "delete them or move them under another parent first"
            )
        if used_by:
            raise FailedPreconditionError(
                f"queue {name} holds {len(used_by)} unfinished job(s), e.g. "
                f"{sorted(used_by)[0]}. To fix: wait for them or cancel them"
            )
        try:
            await self._store.commit(
                [Delete(queue_key(name), expect_revision=self._revisions[name]), *also]
            )
        except CasConflictError:
            raise FailedPreconditionError(f"queue {name} changed meanwhile; try again") from None
        del self._queues[name], self._revisions[name]
        log.info("queue_deleted", queue=queue.name)

    async def _write(
        self, queue: queues_pb2.Queue, *, expect_revision: int, also: Sequence[Op] = ()
    ) -> queues_pb2.Queue:
        known = {**self._queues, queue.name: queue}
        if violations := queue_violations(queue, known):
            raise InvalidArgumentError(violations)
        stored = queues_pb2.Queue()
        stored.CopyFrom(queue)
        stored.weight = stored.weight or 1.0
        put = Put(
            queue_key(queue.name), stored.SerializeToString(), expect_revision=expect_revision
        )
        try:
            revision = await self._store.commit([put, *also])
        except CasConflictError:
            raise FailedPreconditionError(
                f"queue {queue.name} changed meanwhile; try again"
            ) from None
        self._queues[queue.name] = stored
        self._revisions[queue.name] = revision
        log.info("queue_written", queue=queue.name, tenant=queue.tenant)
        return stored
