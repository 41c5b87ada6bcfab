"""``fedctl jobs explain``: every site for every task, rejected by what or scored by term."""

from __future__ import annotations

import argparse

from rich.table import Table
from rich.text import Text

from federation.api.v1 import job_service_pb2, job_service_pb2_grpc, jobs_pb2
from federation.cli.connection import Connection
from federation.cli.render import console, print_json, text
from federation.jobspec import state_name


def add_parser(jobs_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    explain = jobs_sub.add_parser("explain", help="why each task runs (or waits) where it does")
    explain.add_argument("job_id")
    explain.set_defaults(func=cmd_explain)


def _seconds(value: float) -> str:
    return f"{value:,.1f}s" if value < 3600 else f"{value / 3600:,.2f}h"


def explanation_table(task: jobs_pb2.TaskExplanation) -> Table:
    where = f" at {task.site}" if task.site else ""
    table = Table(title=text(f"task {task.task}: {state_name(task.state)}{where}"))
    for column in (
        "rank",
        "site",
        "score",
        "queue",
        "transfer",
        "run",
        "total",
        "cost",
        "terms / why not",
    ):
        table.add_column(column, overflow="fold")
    for site in sorted(task.sites, key=lambda s: (not s.feasible, s.rank, s.site)):
        est = site.estimate
        if site.feasible:
            terms = ", ".join(f"{k} {v:.0f}" for k, v in sorted(site.scores.items()))
            cells = (
                str(site.rank),
                site.site,
                f"{site.score:.1f}",
                _seconds(est.queue_s),
                _seconds(est.transfer_s),
                _seconds(est.run_s),
                _seconds(est.total_s),
                f"${est.cost_usd:.2f}",
                terms,
            )
        else:
            cells = ("-", site.site, "-", "", "", "", "", "", f"[{site.plugin}] {site.reason}")
        table.add_row(*map(text, cells))
    return table


async def cmd_explain(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        reply = await stub.ExplainJob(job_service_pb2.ExplainJobRequest(job_id=args.job_id))
    if args.json:
        print_json(reply)
        return 0
    for task in reply.tasks:
        if task.note:
            console.print(Text.assemble(text(task.task, "bold"), text(f": {task.note}")))
        if task.sites:
            console.print(explanation_table(task))
    return 0
