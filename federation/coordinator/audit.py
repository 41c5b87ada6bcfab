"""The audit trail: every change an identity makes to the federation, in the store.

Each entry is written in the same commit as the change it records, so neither is ever stored
without the other. Keys count down with time, so a plain range read lists the newest first.
"""

from __future__ import annotations

import re
import secrets
import time

from federation.api.v1 import audit_service_pb2
from federation.coordinator.jobs.records import now_timestamp
from federation.errors import FieldViolation, InvalidArgumentError
from federation.store import Delete, Put, Store

AUDIT = "/audit/"
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
SCAN_CHUNK = 500
MAX_SCANNED = 20_000
"""Entries one call reads at most while filtering: a rare action's page comes back short (with
a page token to go on) rather than the call reading the whole trail."""
_COUNTDOWN_FROM = 10**20
_KEY_RE = re.compile(r"^/audit/\d{20}-[0-9a-f]{8}$")


def entry(identity: str, action: str, target: str, detail: str = "") -> Put:
    """The store write that records ``identity`` doing ``action`` to ``target`` now."""
    event = audit_service_pb2.AuditEvent(
        time=now_timestamp(), identity=identity, action=action, target=target, detail=detail
    )
    key = f"{AUDIT}{_COUNTDOWN_FROM - time.time_ns():020d}-{secrets.token_hex(4)}"
    return Put(key, event.SerializeToString())


async def list_events(
    store: Store, request: audit_service_pb2.ListAuditEventsRequest
) -> audit_service_pb2.ListAuditEventsResponse:
    """One page of the trail, newest first, filtered by action prefix and identity."""
    violations = []
    if request.limit > MAX_LIMIT:
        violations.append(FieldViolation("limit", f"at most {MAX_LIMIT}, got {request.limit}"))
    if request.page_token and not _KEY_RE.fullmatch(request.page_token):
        violations.append(FieldViolation("page_token", "is not one this service gave"))
    if violations:
        raise InvalidArgumentError(violations)
    limit = request.limit or DEFAULT_LIMIT
    out = audit_service_pb2.ListAuditEventsResponse()
    after, scanned = request.page_token, 0
    while True:
        chunk = await store.range(AUDIT, start_after=after, limit=SCAN_CHUNK)
        for kv in chunk:
            scanned += 1
            after = kv.key
            event = audit_service_pb2.AuditEvent.FromString(kv.value)
            if not event.action.startswith(request.action_prefix):
                continue
            if request.identity and event.identity != request.identity:
                continue
            out.events.append(event)
            if len(out.events) == limit:
                out.next_page_token = after  # the next page may turn out empty
                return out
        if len(chunk) < SCAN_CHUNK:
            return out  # the trail is read to its end
        if scanned >= MAX_SCANNED:
            out.next_page_token = after
            return out


async def remove_older(store: Store, before_ns: int, batch: int = 100) -> int:
    """Delete the entries made before ``before_ns`` (epoch nanoseconds), a bounded batch per
    commit; returns how many. They are the trail's last keys, as keys count down with time."""
    after = f"{AUDIT}{_COUNTDOWN_FROM - before_ns:020d}"
    removed = 0
    while old := await store.range(AUDIT, start_after=after, limit=batch):
        await store.commit([Delete(kv.key) for kv in old])
        removed += len(old)
    return removed
