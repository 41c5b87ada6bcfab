"""``fedctl`` commands that talk to the coordinator: status, sites, token, jobs."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

from google.protobuf import json_format
from rich.console import Console, RenderableType
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

from federation.api.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    job_service_pb2,
    job_service_pb2_grpc,
    jobs_pb2,
    serving_service_pb2,
    serving_service_pb2_grpc,
)
from federation.cli import explain
from federation.cli.connection import CliError, cli_error
from federation.cli.explain import division, explain_task
from federation.cli.follow import exit_status
from federation.cli.output import Output, message_data, output_of, show
from federation.cli.render import (
    capacity_table,
    coordinators_table,
    endpoints_table,
    event_line,
    job_details,
    jobs_table,
    link_records,
    links_matrix,
    sites_table,
    text,
    time_left,
    unhealthy_devices_table,
    utc_time,
    visible_line,
)
from federation.client import CallError, Client
from federation.connection import Connection
from federation.jobspec import JobSpecFileError, load_job_specs, parse_domain, state_name
from federation.listing import list_sites
from federation.watch import events_of

DRAIN_POLL_S = 1.0
"""How often ``sites drain`` asks how far the drain is."""
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_seconds(value: str) -> float:
    """A duration as seconds: a number of seconds, or one with a unit (90s, 10m, 2h, 1d)."""
    number, unit = (value[:-1], _UNITS[value[-1]]) if value[-1:] in _UNITS else (value, 1.0)
    try:
        seconds = float(number) * unit
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        raise argparse.ArgumentTypeError(f"{value!r} is not a duration (90s, 10m, 2h, 1d)")
    return seconds


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    status = sub.add_parser(
        "status", help="federation status: the leader and followers, sites and job counts"
    )
    status.set_defaults(func=cmd_status)

    capacity = sub.add_parser(
        "capacity",
        help="what the federation has per domain and device model, and what your jobs hold",
    )
    capacity.set_defaults(func=cmd_capacity)
    sites = sub.add_parser("sites", help="list, cordon, drain and uncordon sites")
    sites.set_defaults(func=cmd_sites)
    sites_sub = sites.add_subparsers(dest="sites_command")
    sites_sub.add_parser("list").set_defaults(func=cmd_sites)
    sites_sub.add_parser(
        "links", help="bandwidth and RTT between sites: measured, with their age, or declared"
    ).set_defaults(func=cmd_site_links)
    for name, func, what in (
        ("cordon", cmd_cordon, "nothing new lands on a site, or on one node of it (--node)"),
        ("uncordon", cmd_uncordon, "undo a cordon or a drain (of the site: of its nodes too)"),
    ):
        p = sites_sub.add_parser(name, help=what)
        p.add_argument("site")
        p.add_argument("--node", default="", help="only this node of the site")
        p.set_defaults(func=func)
    drain = sites_sub.add_parser(
        "drain",
        help="empty a site or a node for maintenance: cordon it, stop what checkpoints now "
        "(placed again elsewhere from its checkpoint), the rest at --deadline",
    )
    drain.add_argument("site")
    drain.add_argument("--node", default="", help="only this node of the site")
    drain.add_argument(
        "--deadline",
        type=parse_seconds,
        default=0.0,
        metavar="DURATION",
        help="how long tasks that do not checkpoint may still run (90s, 10m, 2h; default: "
        "until they end)",
    )
    drain.add_argument(
        "--no-wait", action="store_true", help="return at once instead of following the drain"
    )
    drain.set_defaults(func=cmd_drain)

    token = sub.add_parser("token", help="join tokens")
    token_sub = token.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser("create", help="mint a one-time join token for a site")
    create.add_argument("--site", required=True)
    create.add_argument("--domain", required=True, choices=["edge", "datacenter", "cloud"])
    create.add_argument("--ttl", type=float, default=3600.0, help="seconds (default 3600)")
    create.add_argument("--out", type=Path, help="write the token to this file (0600)")
    create.set_defaults(func=cmd_token_create)

    jobs = sub.add_parser("jobs", help="submit, list, get, cancel and watch jobs")
    jobs_sub = jobs.add_subparsers(dest="jobs_command", required=True)
    submit = jobs_sub.add_parser("submit", help="submit the job(s) in a YAML or JSON file")
    submit.add_argument("file", type=Path)
    submit.add_argument(
        "--wait",
        action="store_true",
        help="stream their events until they end; exit 0 if all succeeded, 3 if one failed, "
        "4 if one was cancelled",
    )
    submit.add_argument(
        "--dry-run",
        action="store_true",
        help="check the spec(s) and show where each task would go now; store nothing",
    )
    submit.set_defaults(func=cmd_submit)
    wait = jobs_sub.add_parser(
        "wait", help="stream jobs' events until they end; exit status as submit --wait"
    )
    wait.add_argument("job_ids", nargs="+")
    wait.set_defaults(func=cmd_wait)
    ls = jobs_sub.add_parser("list", help="list jobs, in the order they were submitted")
    ls.add_argument("--state", action="append", default=[], help="e.g. RUNNING (repeatable)")
    ls.add_argument("--tenant", default="")
    ls.add_argument("--site", default="")
    ls.add_argument("--limit", type=int, default=100, help="at most this many (default 100)")
    ls.add_argument("--page-token", default="", help="go on from where a listing ended")
    ls.set_defaults(func=cmd_list)
    get = jobs_sub.add_parser("get", help="one job with its tasks and events")
    get.add_argument("job_id")
    get.set_defaults(func=cmd_get)
    cancel = jobs_sub.add_parser("cancel", help="cancel a job")
    cancel.add_argument("job_id")
    cancel.add_argument("--reason", default="")
    cancel.set_defaults(func=cmd_cancel)
    events = jobs_sub.add_parser(
        "events", help="a job's events so far, oldest first (watch: as they come)"
    )
    events.add_argument("job_id")
    events.add_argument("--task", default="", help="only this task's (and the job's own)")
    events.set_defaults(func=cmd_events)
    logs = jobs_sub.add_parser(
        "logs", help="a replica's output lines, from the site that ran it (-f: as they come)"
    )
    logs.add_argument("job_id")
    logs.add_argument("task", nargs="?", default="", help="may be left out for one task")
    logs.add_argument("--replica", type=int, default=0, help="which replica (default 0)")
    logs.add_argument(
        "-f", "--follow", action="store_true", help="go on with new lines until the run ends"
    )
    logs.add_argument("--tail", type=int, default=0, metavar="N", help="only the last N lines")
    logs.add_argument(
        "--since",
        type=parse_since,
        metavar="WHEN",
        help="only lines from then on: a duration back from now (10m) or an ISO 8601 time",
    )
    logs.add_argument(
        "--timestamps", action="store_true", help="start each line with when the site read it"
    )
    logs.set_defaults(func=cmd_logs)
    watch = jobs_sub.add_parser(
        "watch", help="stream job events; with job ids, until those jobs end (else Ctrl-C)"
    )
    watch.add_argument("job_ids", nargs="*")
    watch.set_defaults(func=cmd_watch)
    explain.add_parser(jobs_sub)
    endpoints = jobs_sub.add_parser(
        "endpoints", help="a service job's replicas: their addresses, readiness and restarts"
    )
    endpoints.add_argument("job_id")
    endpoints.add_argument(
        "--watch", action="store_true", help="print them again each time they change"
    )
    endpoints.add_argument("--ready-only", action="store_true", help="only ready replicas")
    endpoints.set_defaults(func=cmd_endpoints)
    scale = jobs_sub.add_parser("scale", help="change how many replicas a running service keeps")
    scale.add_argument("job_id")
    scale.add_argument("--replicas", type=int, required=True)
    scale.add_argument("--task", default="", help="the service task (default: the only one)")
    scale.set_defaults(func=cmd_scale)
    update = jobs_sub.add_parser(
        "update",
        help="roll a running service onto the task of that name in a job file (command, env, "
        "service policy, replicas), service.max_unavailable replicas at a time",
    )
    update.add_argument("job_id")
    update.add_argument("file", type=Path, help="a job file, as for submit")
    update.add_argument("--task", default="", help="the service task (default: the only one)")
    update.set_defaults(func=cmd_update)


async def cmd_status(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        admin = admin_service_pb2_grpc.AdminServiceStub(channel)
        reply = await admin.GetFederationStatus(admin_service_pb2.GetFederationStatusRequest())
        sites = await list_sites(admin)
    out = output_of(args)
    if out.is_data:
        # As before the status counted its sites: every site, read page by page, beside it.
        doc = json_format.MessageToDict(reply, preserving_proto_field_name=True)
        out.data({**doc, "sites": message_data(sites)})
        return 0
    views: list[RenderableType] = [coordinators_table(reply), sites_table(sites, wide=out.is_wide)]
    if (unhealthy := unhealthy_devices_table(sites)) is not None:
        views.append(unhealthy)
    if reply.rescheduling_paused:
        views.append(
            Text.assemble(text("rescheduling paused", "bold"), text(f": {reply.rescheduling_note}"))
        )
    views.append(certificates_table(reply))
    counts = Table(title=text(f"Jobs (coordinator {reply.coordinator_version})"))
    counts.add_column("state")
    counts.add_column("jobs", justify="right")
    for name, count in sorted(reply.jobs_by_state.items()):
        counts.add_row(text(name.removeprefix("JOB_STATE_")), text(str(count)))
    views.append(counts)
    show(*views)
    return 0


def certificates_table(reply: admin_service_pb2.GetFederationStatusResponse) -> Table:
    """When certificates expire: the soonest the coordinator issued, its own, the CA's."""
    table = Table(title=text("Certificates (expiry, UTC)"))
    for column in ("certificate", "expires", "left"):
        table.add_column(column)
    soonest = reply.soonest_expiring_certificate
    if reply.HasField("soonest_expiring_certificate"):
        name = f"soonest issued: {soonest.identity} ({soonest.serial_hex})"
        table.add_row(
            text(name), text(utc_time(soonest.not_after)), text(time_left(soonest.not_after))
        )
    else:
        table.add_row(text("soonest issued"), text("-"), text("none issued and valid"))
    expiries = [("coordinator", reply.server_certificate_not_after), ("CA", reply.ca_not_after)]
    for name, stamp in expiries:
        if stamp.seconds:
            table.add_row(text(name), text(utc_time(stamp)), text(time_left(stamp)))
    return table


async def cmd_capacity(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        reply = await stub.GetCapacity(job_service_pb2.GetCapacityRequest())
    out = output_of(args)
    if out.is_data:
        out.messages(list(reply.rows))
    else:
        show(capacity_table(reply.rows))
    return 0


async def cmd_sites(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        admin = admin_service_pb2_grpc.AdminServiceStub(channel)
        sites = await list_sites(admin)
    out = output_of(args)
    if out.is_data:
        out.messages(sites)
        return 0
    views: list[RenderableType] = [sites_table(sites, wide=out.is_wide)]
    if (unhealthy := unhealthy_devices_table(sites)) is not None:
        views.append(unhealthy)
    show(*views)
    return 0


async def cmd_site_links(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        admin = admin_service_pb2_grpc.AdminServiceStub(channel)
        sites = await list_sites(admin)
    now = time.time()
    out = output_of(args)
    if out.is_data:
        out.data(link_records(sites, now=now))
    else:
        show(links_matrix(sites, now=now))
    return 0


async def _cordon(args: argparse.Namespace, conn: Connection, cordoned: bool) -> int:
    async with conn.channel() as channel:
        admin = admin_service_pb2_grpc.AdminServiceStub(channel)
        if cordoned:
            request = admin_service_pb2.CordonSiteRequest(site=args.site, node=args.node)
            site = (await admin.CordonSite(request)).site
        else:
            undo = admin_service_pb2.UncordonSiteRequest(site=args.site, node=args.node)
            site = (await admin.UncordonSite(undo)).site
    out = output_of(args)
    if out.is_data:
        out.messages(site)
    elif args.node:
        state = "cordoned" if args.node in site.cordoned_nodes else "schedulable"
        show(text(f"node {args.node} of site {site.name} is {state}"))
    else:
        show(text(f"site {site.name} is {'cordoned' if site.cordoned else 'schedulable'}"))
    return 0


async def cmd_drain(args: argparse.Namespace, conn: Connection) -> int:
    """Start a drain, then follow it until nothing is left there (unless --no-wait)."""
    where = f"node {args.node} of site {args.site}" if args.node else f"site {args.site}"
    out = output_of(args)
    async with conn.channel() as channel:
        admin = admin_service_pb2_grpc.AdminServiceStub(channel)
        request = admin_service_pb2.DrainSiteRequest(
            site=args.site, node=args.node, deadline_s=args.deadline
        )
        site = (await admin.DrainSite(request)).site
        if not args.no_wait:
            site = await follow_drain(admin, site, args.node, where, quiet=out.is_data)
    if out.is_data:
        out.messages(site)
        return 0
    left = _drain_of(site, args.node).tasks_left
    state = "empty" if not left else f"draining, {left} task(s) left"
    show(text(f"{where} is cordoned and {state}"))
    return 0


def _drain_of(site: admin_service_pb2.Site, node: str) -> admin_service_pb2.Drain:
    return next((d for d in site.drains if d.node == node), admin_service_pb2.Drain())


async def follow_drain(
    admin: admin_service_pb2_grpc.AdminServiceAsyncStub,
    site: admin_service_pb2.Site,
    node: str,
    where: str,
    *,
    quiet: bool,
) -> admin_service_pb2.Site:
    """Poll the site until its drain of ``node`` has no task left; a bar on a terminal, a
    line per change in a log (nothing with ``quiet``)."""
    first = _drain_of(site, node).tasks_left
    bar = None
    if not quiet and sys.stderr.isatty():
        bar = Progress(
            TextColumn(f"draining {where}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} tasks moved or ended"),
            console=Console(stderr=True),
            transient=True,
        )
        bar.start()
    task = bar.add_task("drain", total=first) if bar is not None else None
    said = -1
    try:
        while (left := _drain_of(site, node).tasks_left) > 0:
            if bar is not None and task is not None:
                bar.update(task, completed=first - left)
            elif not quiet and left != said:
                print(f"draining {where}: {left} task(s) left", file=sys.stderr)
            said = left
            await asyncio.sleep(DRAIN_POLL_S)
            site = next(s for s in await list_sites(admin) if s.name == site.name)
    finally:
        if bar is not None:
            bar.stop()
    return site


async def cmd_cordon(args: argparse.Namespace, conn: Connection) -> int:
    return await _cordon(args, conn, True)


async def cmd_uncordon(args: argparse.Namespace, conn: Connection) -> int:
    return await _cordon(args, conn, False)


async def cmd_token_create(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        admin = admin_service_pb2_grpc.AdminServiceStub(channel)
        reply = await admin.CreateJoinToken(
            admin_service_pb2.CreateJoinTokenRequest(
                site=args.site, domain=parse_domain(args.domain), ttl_s=args.ttl
            )
        )
    if args.out:
        from federation.security.pki import write_private_file

        write_private_file(args.out, reply.token.encode() + b"\n")
    out = output_of(args)
    if out.is_data:
        out.messages(reply)
    elif args.out:
        show(
            text(
                f"token for {args.site} written to {args.out} "
                f"(expires {reply.expires_at.ToDatetime():%Y-%m-%d %H:%M:%S} UTC)"
            )
        )
    else:
        print(reply.token)
    return 0


async def cmd_submit(args: argparse.Namespace, conn: Connection) -> int:
    try:
        specs = load_job_specs(args.file)
    except JobSpecFileError as err:
        raise CliError(str(err)) from None
    if args.dry_run and args.wait:
        raise CliError("--dry-run stores nothing to wait for. To fix: give one of them")
    out = output_of(args)
    async with Client(conn.address, conn.tls) as client:
        try:
            if args.dry_run:
                return await _dry_run(client, specs, out)
            if len(specs) == 1:
                submitted = [await client.submit(specs[0])]
            else:
                submitted = await client.submit_many(specs)
            if out.is_data:
                out.messages(submitted)
            else:
                show(*(text(f"submitted {job.id} ({job.spec.name})") for job in submitted))
            if not args.wait:
                return 0
            sys.stdout.flush()
            return exit_status(await client.wait([j.id for j in submitted], _printer(out)))
        except CallError as err:
            raise cli_error(err) from None


async def _dry_run(client: Client, specs: list[jobs_pb2.JobSpec], out: Output) -> int:
    """Each spec checked and placed as the federation is now; nothing is stored."""
    plans = [await client.plan(spec) for spec in specs]
    if out.is_data:
        out.messages([job_service_pb2.SubmitJobResponse(job=j, placement=p) for j, p in plans])
        return 0
    for job, placement in plans:
        show(text(f"{job.spec.name}: valid; not stored. Where its tasks would go now:"))
        show(*division(placement), *(part for task in placement for part in explain_task(task)))
    return 0


async def cmd_wait(args: argparse.Namespace, conn: Connection) -> int:
    return await _follow(conn, args.job_ids, output_of(args))


async def _follow(conn: Connection, job_ids: list[str], out: Output) -> int:
    """Print the jobs' events until they end; their exit status."""
    async with Client(conn.address, conn.tls) as client:
        try:
            return exit_status(await client.wait(job_ids, _printer(out)))
        except CallError as err:
            raise cli_error(err) from None


def _printer(out: Output) -> Callable[[jobs_pb2.JobEvent], None]:
    def print_event(event: jobs_pb2.JobEvent) -> None:
        if out.is_data:
            out.messages(event, stream=True)
        else:
            show(text(event_line(event)))
        # A reader of a pipe sees each event as it happens, not when a buffer fills.
        sys.stdout.flush()

    return print_event


async def cmd_list(args: argparse.Namespace, conn: Connection) -> int:
    states = []
    for name in args.state:
        full = "JOB_STATE_" + name.upper().removeprefix("JOB_STATE_")
        if full not in set(jobs_pb2.JobState.keys()):
            raise CliError(
                f"unknown state {name!r}; one of PENDING, SCHEDULING, DELEGATED, "
                "RUNNING, SUCCEEDED, FAILED, CANCELLED"
            )
        states.append(jobs_pb2.JobState.Value(full))
    async with conn.channel() as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        found: list[jobs_pb2.Job] = []
        token = args.page_token
        while len(found) < args.limit:
            reply = await stub.ListJobs(
                job_service_pb2.ListJobsRequest(
                    states=states,
                    tenant=args.tenant,
                    site=args.site,
                    page_size=min(args.limit - len(found), 1000),
                    page_token=token,
                )
            )
            found += reply.jobs
            token = reply.next_page_token
            if not token:
                break
    out = output_of(args)
    if out.is_data:
        out.messages(found)
    else:
        show(jobs_table(found, wide=out.is_wide))
    if token:  # on stderr: the listing itself stays what a script parses
        print(f"more jobs: add --page-token {token}", file=sys.stderr)
    return 0


async def cmd_get(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        reply = await stub.GetJob(
            job_service_pb2.GetJobRequest(job_id=args.job_id, include_events=True)
        )
    out = output_of(args)
    if out.is_data:
        out.messages(reply)
    else:
        show(*job_details(reply, wide=out.is_wide))
    return 0


async def cmd_events(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        reply = await stub.GetJob(
            job_service_pb2.GetJobRequest(job_id=args.job_id, include_events=True)
        )
    events = [e for e in reply.events if not args.task or e.task in ("", args.task)]
    out = output_of(args)
    if out.is_data:
        out.messages(events)
    else:
        show(*(text(event_line(event)) for event in events))
    return 0


async def cmd_cancel(args: argparse.Namespace, conn: Connection) -> int:
    async with conn.channel() as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        job = (
            await stub.CancelJob(
                job_service_pb2.CancelJobRequest(job_id=args.job_id, reason=args.reason)
            )
        ).job
    out = output_of(args)
    if out.is_data:
        out.messages(job)
    else:
        show(text(f"{job.id}: {state_name(job.state)} ({job.reason})"))
    return 0


def parse_since(value: str) -> datetime:
    """``--since``: a duration back from now (90s, 10m, 2h) or an ISO 8601 time."""
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        return datetime.now(UTC) - timedelta(seconds=parse_seconds(value))
    return when if when.tzinfo is not None else when.astimezone()


async def cmd_logs(args: argparse.Namespace, conn: Connection) -> int:
    """Print the lines as they arrive: text, or one JSON object a line with -o json."""
    out = output_of(args)
    if args.replica < 0 or args.tail < 0:
        raise CliError("--replica and --tail take a number >= 0")
    async with Client(conn.address, conn.tls) as client:
        lines = client.logs(
            args.job_id,
            args.task,
            replica=args.replica,
            follow=args.follow,
            tail=args.tail,
            since=args.since,
        )
        try:
            async for line in lines:
                when = datetime.fromtimestamp(line.stamp_ns / 1e9, UTC).isoformat()
                if out.is_data:
                    record = {"time": when, "stamp_ns": line.stamp_ns, "text": line.text}
                    print(json.dumps(record, ensure_ascii=True))
                else:
                    shown = visible_line(line.text)
                    print(f"{when} {shown}" if args.timestamps else shown)
                sys.stdout.flush()  # a reader of a pipe sees each line as it comes
        except CallError as err:
            raise cli_error(err) from None
    return 0


async def cmd_watch(args: argparse.Namespace, conn: Connection) -> int:
    print_event = _printer(output_of(args))
    if args.job_ids:  # named jobs: until they end
        await _follow(conn, args.job_ids, output_of(args))
        return 0
    async with conn.channel() as channel:
        stub = job_service_pb2_grpc.JobServiceStub(channel)
        request = job_service_pb2.WatchJobsRequest(include_current=True)
        async for event in events_of(stub.WatchJobs(request)):
            print_event(event)
    return 0


async def cmd_scale(args: argparse.Namespace, conn: Connection) -> int:
    request = serving_service_pb2.ScaleServiceRequest(
        job_id=args.job_id, task=args.task, replicas=args.replicas
    )
    async with conn.channel() as channel:
        stub = serving_service_pb2_grpc.ServingServiceStub(channel)
        job = (await stub.ScaleService(request)).job
    return _show_changed(args, job)


async def cmd_update(args: argparse.Namespace, conn: Connection) -> int:
    try:
        specs = load_job_specs(args.file)
    except JobSpecFileError as err:
        raise CliError(str(err)) from None
    tasks = [t for spec in specs for t in spec.tasks if t.kind == jobs_pb2.TASK_KIND_SERVICE]
    chosen = [t for t in tasks if t.name == args.task] if args.task else tasks
    if len(chosen) != 1:
        names = ", ".join(t.name for t in tasks) or "none"
        raise CliError(
            f"{args.file} has {len(chosen)} service tasks"
            + (f" named {args.task}" if args.task else "")
            + f" (service tasks there: {names}); name one with --task"
        )
    request = serving_service_pb2.UpdateServiceRequest(job_id=args.job_id, spec=chosen[0])
    async with conn.channel() as channel:
        stub = serving_service_pb2_grpc.ServingServiceStub(channel)
        job = (await stub.UpdateService(request)).job
    return _show_changed(args, job)


def _show_changed(args: argparse.Namespace, job: jobs_pb2.Job) -> int:
    out = output_of(args)
    if out.is_data:
        out.messages(job)
    else:
        show(text(f"{job.id}: {job.reason or state_name(job.state)}"))
    return 0


async def cmd_endpoints(args: argparse.Namespace, conn: Connection) -> int:
    out = output_of(args)
    async with conn.channel() as channel:
        stub = serving_service_pb2_grpc.ServingServiceStub(channel)
        if not args.watch:
            reply = await stub.ListEndpoints(
                serving_service_pb2.ListEndpointsRequest(job_id=args.job_id)
            )
            endpoints = [e for e in reply.endpoints if e.ready or not args.ready_only]
            if out.is_data:
                out.messages(
                    serving_service_pb2.ListEndpointsResponse(
                        job_id=reply.job_id, endpoints=endpoints
                    )
                )
            else:
                show(endpoints_table(endpoints, f"Endpoints of {reply.job_id}"))
            return 0
        request = serving_service_pb2.WatchEndpointsRequest(
            job_id=args.job_id, ready_only=args.ready_only
        )
        async for change in stub.WatchEndpoints(request):
            if out.is_data:
                out.messages(change, stream=True)
            else:
                now = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
                show(endpoints_table(change.endpoints, f"Endpoints of {args.job_id} at {now}"))
            sys.stdout.flush()
    return 0
