"""``fedctl top``: sites, devices and running jobs, booked beside measured, refreshed until q.

On a terminal the view redraws every ``--interval`` seconds in the alternate screen (rich's
``Live``) and reads keys from stdin in cbreak mode: ``q`` quits, as do Ctrl-C and SIGTERM, and
the terminal's settings come back on the way out. Piped, or with ``--once``, it prints one
snapshot with its tables at full width; ``-o json|yaml`` (or ``--json``) prints it as data.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import termios
import time
import tty
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from federation.api.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    job_service_pb2,
    job_service_pb2_grpc,
    jobs_pb2,
    resources_pb2,
)
from federation.cli.connection import CliError, describe_rpc_error, resolve_connection
from federation.cli.output import message_data, output_of
from federation.cli.render import (
    capacity_table,
    console,
    format_age,
    format_duration,
    print_whole,
    site_state_name,
    text,
)
from federation.connection import CHANNEL_OPTIONS, Connection, on_leader
from federation.jobspec import domain_name, kind_name
from federation.listing import list_sites
from federation.resources import booked_share
from federation.security.tls import channel_credentials

T = TypeVar("T")

RPC_TIMEOUT_S = 10.0
"""How long one call of a refresh may take: a coordinator that hangs shows as an error."""

HEADER = "fedctl top"
"""The first words of every live frame."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    top = sub.add_parser(
        "top",
        help="live view of sites, devices (booked and measured) and running jobs; q quits",
    )
    top.add_argument(
        "--interval", type=float, default=2.0, help="seconds between refreshes (default 2)"
    )
    top.add_argument(
        "--once", action="store_true", help="print one snapshot and exit (also when piped)"
    )
    top.add_argument(
        "--max-jobs",
        type=int,
        default=1000,
        help="running jobs to fetch per refresh at most; 0: all (default 1000)",
    )
    top.set_defaults(func=cmd_top)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one refresh read: every site with its view, and the running jobs."""

    sites: Sequence[admin_service_pb2.Site]
    jobs: Sequence[jobs_pb2.Job]
    more_jobs: bool
    """More running jobs matched than ``--max-jobs``."""
    taken_at: float
    """Unix time of the reading."""
    capacity: Sequence[job_service_pb2.CapacityRow] = ()
    """For a tenant, who may not list sites: the federation's capacity and what it holds."""


class Channels:
    """One channel per coordinator address, kept open across refreshes (no TLS handshake
    every two seconds), with the leader found through ``on_leader`` on every refresh."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._open: dict[str, grpc.aio.Channel] = {}

    def get(self, address: str) -> grpc.aio.Channel:
        if address not in self._open:
            credentials = channel_credentials(self.conn.tls)
            self._open[address] = grpc.aio.secure_channel(
                address, credentials, options=CHANNEL_OPTIONS
            )
        return self._open[address]

    async def close(self) -> None:
        for channel in self._open.values():
            await channel.close()
        self._open.clear()

    async def snapshot(self, max_jobs: int) -> Snapshot:
        return await on_leader(self.conn, lambda at: fetch(self.get(at.address), max_jobs))


async def fetch(channel: grpc.aio.Channel, max_jobs: int) -> Snapshot:
    """Every site, then the running jobs page by page (``max_jobs`` of them at most; 0: all).
    A tenant, who may not list sites, gets the capacity summary instead, and its own jobs."""
    admin = admin_service_pb2_grpc.AdminServiceStub(channel)
    stub = job_service_pb2_grpc.JobServiceStub(channel)
    capacity: Sequence[job_service_pb2.CapacityRow] = ()
    try:
        sites = await list_sites(admin, timeout_s=RPC_TIMEOUT_S)
    except grpc.aio.AioRpcError as err:
        if err.code() != grpc.StatusCode.PERMISSION_DENIED:
            raise
        sites = []
        request = job_service_pb2.GetCapacityRequest()
        capacity = (await stub.GetCapacity(request, timeout=RPC_TIMEOUT_S)).rows
    found: list[jobs_pb2.Job] = []
    token = ""
    while True:
        left = max_jobs - len(found) if max_jobs > 0 else 1000
        reply = await stub.ListJobs(
            job_service_pb2.ListJobsRequest(
                states=[jobs_pb2.JOB_STATE_RUNNING],
                page_size=min(left, 1000),
                page_token=token,
            ),
            timeout=RPC_TIMEOUT_S,
        )
        found += reply.jobs
        token = reply.next_page_token
        if not token or (max_jobs > 0 and len(found) >= max_jobs):
            break
    more = bool(token) or (max_jobs > 0 and len(found) > max_jobs)
    jobs = found[:max_jobs] if max_jobs > 0 else found
    return Snapshot(sites, jobs, more, time.time(), capacity)


# What the tables and the JSON show.


def _measured(use: resources_pb2.MeasuredUse) -> bool:
    return use.measured_at > 0


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _devices(site: admin_service_pb2.Site) -> Iterator[tuple[str, resources_pb2.Device]]:
    for node in site.view.nodes:
        for device in node.devices:
            yield node.name, device


def _health(device: resources_pb2.Device) -> str:
    if device.health == resources_pb2.DEVICE_HEALTH_UNSPECIFIED:
        return "-"
    return resources_pb2.DeviceHealth.Name(device.health).removeprefix("DEVICE_HEALTH_")


def _kind_counts(site: admin_service_pb2.Site) -> dict[str, dict[str, int]]:
    """``{kind: {booked, total}}``: devices with anything booked, and all of them."""
    kinds: dict[str, dict[str, int]] = {}
    for _, device in _devices(site):
        counts = kinds.setdefault(kind_name(device.kind), {"booked": 0, "total": 0})
        counts["total"] += 1
        counts["booked"] += booked_share(device) > 0
    return kinds


def _site_use(site: admin_service_pb2.Site) -> tuple[float | None, float | None]:
    """The mean measured compute use of the site's devices and of its nodes' CPUs; None
    where nothing was measured (declared hardware)."""
    devices = [d.measured.compute for _, d in _devices(site) if _measured(d.measured)]
    nodes = [n.measured.compute for n in site.view.nodes if _measured(n.measured)]
    return _mean(devices), _mean(nodes)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def site_record(site: admin_service_pb2.Site) -> dict[str, object]:
    device_use, cpu_use = _site_use(site)
    return {
        "site": site.name,
        "domain": domain_name(site.domain),
        "state": site_state_name(site.state),
        "cordoned": site.cordoned,
        "nodes": len(site.view.nodes),
        "devices": _kind_counts(site),
        "device_compute": _round(device_use),
        "cpu_compute": _round(cpu_use),
        "heartbeat_age_s": None if site.heartbeat_age_s < 0 else round(site.heartbeat_age_s, 1),
    }


def device_record(
    site: admin_service_pb2.Site, node: str, device: resources_pb2.Device, now: float
) -> dict[str, object]:
    use = device.measured
    measured = _measured(use)
    return {
        "site": site.name,
        "node": node,
        "device": device.id or str(device.index),
        "kind": kind_name(device.kind),
        "model": device.model,
        "booked": round(booked_share(device), 4),
        "memory_total_mib": device.memory_total_mib,
        "memory_booked_mib": device.memory_total_mib - device.memory_free_mib,
        "measured": {
            "compute": round(use.compute, 4),
            "memory_used_mib": use.memory_used_mib,
            "power_watts": device.power_watts,
            "temperature_c": device.temperature_c,
            "age_s": round(max(now - use.measured_at, 0.0), 1),
        }
        if measured
        else None,
        "health": _health(device),
        "health_reason": device.health_reason,
    }


def running_tasks(
    job: jobs_pb2.Job, now: float
) -> Iterator[tuple[jobs_pb2.TaskStatus, float | None]]:
    """Each running task of a running job (its first task if none is yet), with seconds
    since it started (None if it did not say)."""
    tasks = [t for t in job.tasks if t.state == jobs_pb2.JOB_STATE_RUNNING] or job.tasks[:1]
    for task in tasks:
        started = task.started_at.ToNanoseconds() / 1e9 if task.HasField("started_at") else None
        yield task, None if started is None else max(now - started, 0.0)


def job_records(job: jobs_pb2.Job, now: float) -> list[dict[str, object]]:
    """One record per running task of a running job."""
    return [
        {
            "job": job.id,
            "name": job.spec.name,
            "tenant": job.spec.tenant,
            "task": task.name,
            "site": task.site,
            "nodes": list(task.nodes),
            "devices": list(task.devices),
            "running_s": None if running is None else round(running, 1),
        }
        for task, running in running_tasks(job, now)
    ]


def snapshot_record(snapshot: Snapshot) -> dict[str, object]:
    """The snapshot as plain data, for ``-o json``."""
    now = snapshot.taken_at
    return {
        "taken_at": round(now, 3),
        "sites": [site_record(site) for site in snapshot.sites],
        "devices": [
            device_record(site, node, device, now)
            for site in snapshot.sites
            for node, device in _devices(site)
        ],
        "jobs": [record for job in snapshot.jobs for record in job_records(job, now)],
        "more_jobs": snapshot.more_jobs,
        "capacity": [message_data(row) for row in snapshot.capacity],
    }


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _gib(mib: float) -> str:
    return f"{mib / 1024:.1f}"


def sites_table(snapshot: Snapshot) -> Table:
    table = Table(title="Sites")
    for column in ("site", "domain", "state", "nodes", "devices booked/total"):
        table.add_column(column)
    for column in ("device use", "cpu use", "heartbeat"):
        table.add_column(column, justify="right")
    for site in snapshot.sites:
        kinds = _kind_counts(site)
        devices = ", ".join(f"{k} {c['booked']}/{c['total']}" for k, c in sorted(kinds.items()))
        state = site_state_name(site.state) + (" cordoned" if site.cordoned else "")
        style = "" if site.state == admin_service_pb2.SITE_STATE_CONNECTED else "red"
        device_use, cpu_use = _site_use(site)
        age = site.heartbeat_age_s
        table.add_row(
            text(site.name),
            text(domain_name(site.domain)),
            text(state, style),
            text(str(len(site.view.nodes))),
            text(devices or "-"),
            text(_percent(device_use)),
            text(_percent(cpu_use)),
            text("never" if age < 0 else f"{age:.1f}s"),
        )
    return table


def devices_table(snapshot: Snapshot) -> Table:
    table = Table(title="Devices (booked by tasks; measured use, memory, power, temperature)")
    for column in ("site", "node", "device", "model"):
        table.add_column(column)
    for column in ("booked", "use", "memory GiB", "power W", "temp °C", "read"):
        table.add_column(column, justify="right")
    table.add_column("health")
    now = snapshot.taken_at
    for site in snapshot.sites:
        for node, device in _devices(site):
            share = booked_share(device)
            booked = "-" if share == 0 else "whole" if device.allocated else f"{share:.0%}"
            total = _gib(device.memory_total_mib)
            use = device.measured
            if _measured(use):
                measured = (
                    f"{use.compute:.0%}",
                    f"{_gib(use.memory_used_mib)}/{total}",
                    f"{device.power_watts:.0f}"
                    + (f"/{device.power_tdp_watts:.0f}" if device.power_tdp_watts else ""),
                    f"{device.temperature_c:.0f}",
                    format_age(max(now - use.measured_at, 0.0)),
                )
            else:
                measured = ("-", f"-/{total}", "-", "-", "never")
            health = _health(device)
            style = {"DEGRADED": "yellow", "UNHEALTHY": "red"}.get(health, "")
            if device.health_reason:
                health += f": {device.health_reason}"
            name = device.id or str(device.index)
            model = " ".join(p for p in (kind_name(device.kind), device.model) if p)
            table.add_row(
                *map(text, (site.name, node, name, model, booked, *measured)), text(health, style)
            )
    return table


def jobs_table(snapshot: Snapshot) -> Table:
    title = "Running jobs" + (" (more not shown: raise --max-jobs)" if snapshot.more_jobs else "")
    table = Table(title=title)
    for column in ("job", "name", "tenant", "task", "site", "nodes / devices"):
        table.add_column(column)
    table.add_column("running for", justify="right")
    for job in snapshot.jobs:
        for task, running in running_tasks(job, snapshot.taken_at):
            # Devices read "node:kind:index"; the nodes alone for tasks that hold no device.
            where = ", ".join(task.devices) or ", ".join(task.nodes) or "-"
            cells = (job.id, job.spec.name, job.spec.tenant, task.name, task.site or "-", where)
            table.add_row(
                *map(text, cells), text("-" if running is None else format_duration(running))
            )
    return table


def snapshot_tables(snapshot: Snapshot) -> list[Table]:
    if snapshot.capacity:  # a tenant's: the fleet as a summary, and its own jobs
        return [capacity_table(snapshot.capacity), jobs_table(snapshot)]
    return [sites_table(snapshot), devices_table(snapshot), jobs_table(snapshot)]


def frame(snapshot: Snapshot | None, address: str, interval: float, error: str) -> Group:
    """One live frame: a header line, the tables, and the last error if the refresh failed."""
    when = time.strftime("%H:%M:%S", time.localtime(snapshot.taken_at)) if snapshot else "-"
    header = Text.assemble(
        text(HEADER, "bold"),
        text(f"  {address}  {when}  every {interval:g}s, q to quit"),
    )
    parts: list[RenderableType] = [header]
    if error:
        parts.append(text(f"refresh failed, retrying: {error}", "red"))
    if snapshot is None:
        parts.append(text("connecting..."))
    else:
        parts.extend(snapshot_tables(snapshot))
    return Group(*parts)


# The command.


async def cmd_top(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        raise CliError("--interval must be more than 0 seconds")
    conn = resolve_connection(args.coordinator, args.pki_dir, args.ca, args.cert, args.key)
    out = output_of(args)
    channels = Channels(conn)
    try:
        if out.is_data or args.once or not sys.stdout.isatty():
            try:
                snapshot = await channels.snapshot(args.max_jobs)
            except grpc.aio.AioRpcError as err:
                raise CliError(describe_rpc_error(err)) from None
            if out.is_data:
                out.data(snapshot_record(snapshot))
            else:
                print_whole(console, snapshot_tables(snapshot))  # whole with --once too
            return 0
        await live(channels, args.interval, args.max_jobs)
        return 0
    finally:
        await channels.close()


async def live(channels: Channels, interval: float, max_jobs: int) -> None:
    """Redraw until q, Ctrl-C, SIGTERM or SIGHUP; a failed refresh shows and is retried."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    with contextlib.ExitStack() as stack:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(signum, stop.set)
            stack.callback(loop.remove_signal_handler, signum)
        stack.enter_context(keys(loop, on_quit=stop.set))
        snapshot: Snapshot | None = None
        error = ""
        address = channels.conn.address
        with Live(
            frame(None, address, interval, error),
            console=console,
            screen=True,
            auto_refresh=False,
        ) as view:
            loop.add_signal_handler(signal.SIGWINCH, view.refresh)  # redraw at the new size
            try:
                while not stop.is_set():
                    try:
                        fresh = await until_stopped(channels.snapshot(max_jobs), stop)
                    except grpc.aio.AioRpcError as err:
                        error = describe_rpc_error(err)
                    else:
                        if fresh is None:
                            break
                        snapshot, error = fresh, ""
                    view.update(frame(snapshot, address, interval, error), refresh=True)
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), interval)
            finally:
                loop.remove_signal_handler(signal.SIGWINCH)


async def until_stopped(work: Awaitable[T], stop: asyncio.Event) -> T | None:
    """``work``'s result, or None as soon as ``stop`` is set (``work`` is then cancelled):
    q quits at once even while a coordinator is slow to answer."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
    return None if not task.done() or task.cancelled() else task.result()


@contextlib.contextmanager
def keys(loop: asyncio.AbstractEventLoop, on_quit: Callable[[], None]) -> Iterator[None]:
    """Read keys from a terminal stdin in cbreak mode (no echo, no line buffering, Ctrl-C
    still a signal) until the block ends, then put the terminal's settings back.

    The event loop selects on stdin; ``q`` calls ``on_quit``. Without a terminal on stdin
    (``< /dev/null``) no keys are read: Ctrl-C and signals still stop the view.
    """
    fd = sys.stdin.fileno() if sys.stdin is not None else -1
    if fd < 0 or not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)

    def readable() -> None:
        try:
            data = os.read(fd, 64)
        except OSError:
            data = b""
        if not data:  # the terminal went away
            loop.remove_reader(fd)
            on_quit()
        elif b"q" in data.lower():
            on_quit()

    tty.setcbreak(fd, termios.TCSANOW)
    try:
        loop.add_reader(fd, readable)
        try:
            yield
        finally:
            loop.remove_reader(fd)
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
