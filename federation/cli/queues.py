"""``fedctl queues``: create, update, list and delete the queues tenants submit to."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from rich.table import Table

from federation.api.v1 import admin_service_pb2, admin_service_pb2_grpc, queues_pb2
from federation.cli.connection import CliError
from federation.cli.output import output_of, show
from federation.cli.render import text
from federation.connection import Connection
from federation.coordinator.policy.resources import quota_key, quota_label
from federation.jobspec import parse_domain


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    queues = sub.add_parser("queues", help="queues, their quotas, usage and fair share")
    queues.set_defaults(func=cmd_list)
    queues_sub = queues.add_subparsers(dest="queues_command")
    queues_sub.add_parser("list", help="every queue with its usage and share").set_defaults(
        func=cmd_list
    )
    for name, func in (("create", cmd_create), ("update", cmd_update)):
        p = queues_sub.add_parser(name, help=f"{name} a queue (update replaces it whole)")
        p.add_argument("name")
        p.add_argument("--tenant", required=True, help="the tenant that owns it")
        p.add_argument("--weight", type=float, default=1.0, help="fair-share weight (default 1)")
        p.add_argument("--parent", default="", help="the queue it sits under")
        p.add_argument(
            "--quota",
            action="append",
            default=[],
            metavar="RESOURCE[@site/NAME|@domain/NAME]=NOMINAL[+BORROW]",
            help="e.g. gpu=8, gpu/A100-80GB=4+4, cpu=64, memory_mib=262144, gpu@site/dc-1=2, "
            "gpu@domain/cloud=4 (repeatable)",
        )
        p.set_defaults(func=func)
    delete = queues_sub.add_parser("delete", help="delete a queue no unfinished job names")
    delete.add_argument("name")
    delete.set_defaults(func=cmd_delete)


def parse_quota(text_: str) -> queues_pb2.Quota:
    """``gpu=8`` or ``gpu/A100-80GB=4+2`` (nominal, then how much more it may borrow), each
    optionally at one site or in one domain: ``gpu@site/dc-1=2``, ``gpu@domain/cloud=4``."""
    what, sep, amounts = text_.partition("=")
    resource, _, scope = what.strip().partition("@")
    where, _, name = scope.partition("/")
    nominal, _, borrow = amounts.partition("+")
    try:
        if not sep or not resource or (scope and (where not in ("site", "domain") or not name)):
            raise ValueError
        quota = queues_pb2.Quota(
            resource=resource,
            nominal=float(nominal),
            borrowing_limit=float(borrow) if borrow else 0.0,
            site=name if where == "site" else "",
        )
        if where == "domain":
            quota.domain = parse_domain(name)
        return quota
    except ValueError:
        raise CliError(
            f"--quota {text_!r}: write RESOURCE=NOMINAL or RESOURCE=NOMINAL+BORROW, e.g. gpu=8+4, "
            "with @site/NAME or @domain/edge|datacenter|cloud after RESOURCE to count one site "
            "or domain only"
        ) from None


def _queue(args: argparse.Namespace) -> queues_pb2.Queue:
    return queues_pb2.Queue(
        name=args.name,
        tenant=args.tenant,
        weight=args.weight,
        parent=args.parent,
        quotas=[parse_quota(q) for q in args.quota],
    )


async def cmd_create(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        admin = admin_service_pb2_grpc.AdminServiceStub(channel)
        reply = await admin.CreateQueue(admin_service_pb2.CreateQueueRequest(queue=_queue(args)))
    _done(args, reply.queue, "created")
    return 0


async def cmd_update(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        admin = admin_service_pb2_grpc.AdminServiceStub(channel)
        reply = await admin.UpdateQueue(admin_service_pb2.UpdateQueueRequest(queue=_queue(args)))
    _done(args, reply.queue, "updated")
    return 0


def _done(args: argparse.Namespace, queue: queues_pb2.Queue, what: str) -> None:
    out = output_of(args)
    if out.is_data:
        out.messages(queue)
    else:
        show(text(f"queue {queue.name} {what}"))


async def cmd_delete(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        admin = admin_service_pb2_grpc.AdminServiceStub(channel)
        await admin.DeleteQueue(admin_service_pb2.DeleteQueueRequest(name=args.name))
    out = output_of(args)
    if out.is_data:
        out.data({"deleted": args.name})
    else:
        show(text(f"queue {args.name} deleted"))
    return 0


async def cmd_list(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        admin = admin_service_pb2_grpc.AdminServiceStub(channel)
        reply = await admin.ListQueues(admin_service_pb2.ListQueuesRequest())
    out = output_of(args)
    if out.is_data:
        out.messages(list(reply.queues))
    else:
        show(queues_table(reply.queues))
    return 0


def queues_table(queues: Iterable[queues_pb2.QueueStatus]) -> Table:
    table = Table(title="Queues")
    for column in (
        "queue",
        "tenant",
        "parent",
        "weight",
        "quota (used/nominal+borrow)",
        "borrowed",
        "dominant share",
        "waiting jobs",
    ):
        table.add_column(column)
    for status in queues:
        queue = status.queue
        quotas = ", ".join(
            f"{quota_label(q)} {status.usage.get(quota_key(q), 0):g}/{q.nominal:g}"
            + (f"+{q.borrowing_limit:g}" if q.borrowing_limit else "")
            for q in queue.quotas
        )
        borrowed = ", ".join(f"{r} {a:g}" for r, a in sorted(status.borrowed.items()))
        share = (
            f"{status.dominant_share:.2f} ({status.dominant_resource})"
            if status.dominant_resource
            else "0"
        )
        cells = (
            queue.name,
            queue.tenant,
            queue.parent or "-",
            f"{queue.weight:g}",
            quotas or "no quota",
            borrowed or "-",
            share,
            str(status.waiting_jobs),
        )
        table.add_row(*map(text, cells))
    return table
