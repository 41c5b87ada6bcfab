"""``fedctl audit``: who changed what in the federation, and when, newest first."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from rich.table import Table

from federation.api.v1 import audit_service_pb2, audit_service_pb2_grpc
from federation.cli.output import message_data, output_of, show
from federation.cli.render import text, utc_time
from federation.connection import Connection


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    audit = sub.add_parser("audit", help="the audit trail: tokens, joins, cordons, queues")
    audit.add_argument("--limit", type=int, default=100, help="at most this many (max 1000)")
    audit.add_argument("--action", default="", help="only actions starting with it: queue., site.")
    audit.add_argument("--identity", default="", help="only this identity's, e.g. operator:alice")
    audit.add_argument("--page-token", default="", help="go on from where a page ended")
    audit.set_defaults(func=cmd_audit)


async def cmd_audit(args: argparse.Namespace, conn: Connection) -> int:
    request = audit_service_pb2.ListAuditEventsRequest(
        limit=max(args.limit, 0),
        action_prefix=args.action,
        identity=args.identity,
        page_token=args.page_token,
    )
    async with conn.channel() as channel:
        reply = await audit_service_pb2_grpc.AuditServiceStub(channel).ListAuditEvents(request)
    out = output_of(args)
    if out.is_data:
        events = message_data(list(reply.events))
        out.data({"events": events, "next_page_token": reply.next_page_token})
        return 0
    show(audit_table(reply.events))
    if reply.next_page_token:
        show(text(f"more: fedctl audit --page-token {reply.next_page_token}"))
    return 0


def _plain(events: Iterable[audit_service_pb2.AuditEvent]) -> list[dict[str, str]]:
    return [
        {
            "time": utc_time(e.time),
            "identity": e.identity,
            "action": e.action,
            "target": e.target,
            "detail": e.detail,
        }
        for e in events
    ]


def audit_table(events: Iterable[audit_service_pb2.AuditEvent]) -> Table:
    table = Table(title=text("Audit trail (newest first, UTC)"))
    for column in ("time", "identity", "action", "target", "detail"):
        table.add_column(column, overflow="fold")
    for row in _plain(events):
        table.add_row(*map(text, row.values()))
    return table
