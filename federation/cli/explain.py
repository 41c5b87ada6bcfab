"""``fedctl jobs explain``: every site for every task, every filter that rejects it (each with
its reason code) or its score by term, and the estimate it is ranked by against the one its
site committed to.

On a terminal the tables fit its width; piped, each prints whole at its natural width (nothing
cut or wrapped, one row per line for grep). ``-o json|yaml`` (or ``--json``) prints the reply.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from federation.api.v1 import job_service_pb2, job_service_pb2_grpc, jobs_pb2
from federation.cli.output import output_of, show
from federation.cli.render import division_line, format_duration, text
from federation.connection import Connection
from federation.coordinator.jobs import spread
from federation.jobspec import state_name


def add_parser(jobs_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    explain = jobs_sub.add_parser(
        "explain",
        help="why each task runs (or waits) where it does: every filter that rejects each site",
    )
    explain.add_argument("job_id")
    explain.set_defaults(func=cmd_explain)


def _seconds(value: float) -> str:
    return f"{value:,.1f}s" if value < 3600 else f"{value / 3600:,.2f}h"


def image_pull(e: jobs_pb2.Estimate) -> str:
    """``held`` where a node of the site holds the task's image, ``12.5 MiB in 1.3s`` where it
    would be pulled; "" where nothing is known of an image (none, or no site holds it yet)."""
    if e.image_held:
        return "held"
    if e.pull_bytes:
        return f"{e.pull_bytes / 2**20:,.1f} MiB in {_seconds(e.pull_s)}"
    return ""


def ranking_table(task: jobs_pb2.TaskExplanation) -> Table | None:
    """The feasible sites best first, with their scores by term and estimates; None if none.
    A task whose image some site holds gets an ``image`` column: the pull in its transfer."""
    feasible = sorted((s for s in task.sites if s.feasible), key=lambda s: (s.rank, s.site))
    if not feasible:
        return None
    where = f" at {task.site}" if task.site else ""
    table = Table(title=text(f"task {task.task}: {state_name(task.state)}{where}: feasible sites"))
    launches = any(s.estimate.provision_s > 0 for s in feasible)  # an elastic site's option
    pulls = any(image_pull(s.estimate) for s in feasible)
    columns = ["rank", "site", "score", "queue", "transfer", "run", "total", "cost", "terms"]
    if pulls:
        columns.insert(5, "image")
    if launches:
        columns.insert(4, "launch")
    for column in columns:
        table.add_column(column, overflow="fold")
    for site in feasible:
        est = site.estimate
        terms = ", ".join(f"{k} {v:.0f}" for k, v in sorted(site.scores.items()))
        cells = [
            str(site.rank),
            site.site,
            f"{site.score:.1f}",
            _seconds(est.queue_s),
            _seconds(est.transfer_s),
            _seconds(est.run_s),
            _seconds(est.total_s),
            f"${est.cost_usd:.2f}",
            terms,
        ]
        if pulls:
            cells.insert(5, image_pull(est) or "-")
        if launches:
            cells.insert(4, _seconds(est.provision_s))
        table.add_row(*map(text, cells))
    return table


def rejections(site: jobs_pb2.SiteExplanation) -> list[jobs_pb2.SiteVerdict]:
    """Every rejection of a site; a coordinator that sends only the first gives that one."""
    if site.rejections:
        return list(site.rejections)
    return [
        jobs_pb2.SiteVerdict(site=site.site, stage=site.plugin, code=site.code, reason=site.reason)
    ]


def rejections_table(task: jobs_pb2.TaskExplanation) -> Table | None:
    """One row per filter (or check) that rejects a site: site | stage | code | reason."""
    rejected = sorted((s for s in task.sites if not s.feasible), key=lambda s: s.site)
    if not rejected:
        return None
    table = Table(title=text(f"task {task.task}: {len(rejected)} site(s) rejected"))
    for column in ("site", "stage", "code", "reason"):
        table.add_column(column, overflow="fold")
    for site in rejected:
        for verdict in rejections(site):
            table.add_row(
                *map(text, (site.site, verdict.stage, verdict.code or "-", verdict.reason))
            )
    return table


def estimate_terms(e: jobs_pb2.Estimate) -> str:
    """``3s queue + 1m 05s transfer + 24s run = 1m 32s, $0.40 on H100-80GB (±12%)``"""
    launch = f"{format_duration(e.provision_s)} launch + " if e.provision_s > 0 else ""
    line = (
        f"{format_duration(e.queue_s)} queue + {launch}{format_duration(e.transfer_s)} "
        f"transfer + {format_duration(e.run_s)} run = {format_duration(e.total_s)}, "
        f"${e.cost_usd:.2f}"
    )
    if e.device_model:
        line += f" on {e.device_model}"
    if e.run_error:
        line += f" (±{e.run_error:.0%})"
    if pull := image_pull(e):
        line += "; image held there" if e.image_held else f"; image pull {pull} of the transfer"
    return line


def estimate_lines(task: jobs_pb2.TaskExplanation) -> list[Text]:
    """The estimate the task is ranked by (placement's, now) against the one its site
    committed to when it accepted, with the committed run time over the ranked one."""
    lines = []
    ranked = task.ranked_estimate if task.HasField("ranked_estimate") else None
    if ranked is not None:
        lines.append(text(f"  ranked by at {task.ranked_site} (now): {estimate_terms(ranked)}"))
    if task.HasField("committed_estimate"):
        committed = task.committed_estimate
        line = f"  committed by {task.site}: {estimate_terms(committed)}"
        if ranked is not None and ranked.run_s > 0:
            line += f"; run {committed.run_s / ranked.run_s:.2f}x ranked"
        lines.append(text(line))
    return lines


def explain_task(task: jobs_pb2.TaskExplanation) -> list[RenderableType]:
    """Everything ``fedctl jobs explain`` shows for one task."""
    parts: list[RenderableType] = []
    head = Text.assemble(text(task.task, "bold"), text(f": {state_name(task.state)}"))
    if task.site:
        head.append_text(text(f" at {task.site}"))
    if task.note:
        head.append_text(text(f"; {task.note}"))
    parts.append(head)
    parts.extend(estimate_lines(task))
    for verdict in task.held_back:
        where = f" at {verdict.site}" if verdict.site else ""
        parts.append(text(f"  held back{where} ({verdict.stage}): {verdict.reason}"))
    if task.sites and not any(s.feasible for s in task.sites):
        parts.append(text("  no site can take it now"))
    for table in (ranking_table(task), rejections_table(task)):
        if table is not None:
            parts.append(table)
    return parts


def division(tasks: Sequence[jobs_pb2.TaskExplanation]) -> list[Text]:
    """A line per divided task: how many of its parts lie at each site."""
    parts: dict[str, list[tuple[str, int]]] = {}
    for task in tasks:
        if divided := spread.part_of(task.task):
            parts.setdefault(divided, []).append((task.site, 1))
    return [text(division_line(name, each, unit="parts")) for name, each in parts.items()]


def explanation_table(task: jobs_pb2.TaskExplanation) -> Group:
    """One task's explanation as one renderable."""
    return Group(*explain_task(task))


async def cmd_explain(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        reply = await stub.ExplainJob(job_service_pb2.ExplainJobRequest(job_id=args.job_id))
    out = output_of(args)
    if out.is_data:
        out.messages(reply)
    else:
        show(*division(reply.tasks), *(part for task in reply.tasks for part in explain_task(task)))
    return 0
