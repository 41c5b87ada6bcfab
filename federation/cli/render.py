"""Tables and lines for people, from API messages (``output`` prints them, or data instead)."""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

from google.protobuf import timestamp_pb2
from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2, resources_pb2
from federation.coordinator.jobs import retries, spread
from federation.jobspec import domain_name, kind_name, state_name


class FedctlConsole(Console):
    """A console that leaves a closed pipe to fedctl's ``main``.

    rich answers a ``BrokenPipeError`` by exiting with status 1 from wherever it printed;
    fedctl ends every closed pipe alike (``output.quiet_on_closed_pipe``).
    """

    def on_broken_pipe(self) -> None:
        self.quiet = True  # print nothing more
        raise BrokenPipeError


console = FedctlConsole()

# C0 (ESC among them), DEL and C1 drive the terminal: OSC 0 sets its title, OSC 8 makes a
# hyperlink, CSI 2J clears the screen. Bidi overrides and U+2028/9 reorder or break a line.
# rich's strip_control_codes drops only BEL, BS, VT, FF and CR, silently, and keeps ESC.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def text(value: str, style: str = "") -> Text:
    """``value`` to show as it is: never read as markup, control characters made visible.

    Every string from a reply goes through here, since tenants and sites choose them. Each
    unsafe character reads as its Python escape (``\\x1b``, ``\\n``, ``\\t``): newlines
    and tabs too, so one value stays on one line and cannot pass for a row or a line of
    fedctl's own. ``--json`` keeps the exact value.
    """
    visible = _UNSAFE.sub(lambda m: m.group().encode("unicode_escape").decode(), value)
    return Text(visible, style=style)


def visible_line(value: str) -> str:
    """A line of a task's output as ``text`` shows a value (control characters made
    visible, so it cannot drive the terminal), but with its tabs kept."""
    return "\t".join(text(part).plain for part in value.split("\t"))


def site_state_name(value: int) -> str:
    return admin_service_pb2.SiteState.Name(value).removeprefix("SITE_STATE_")  # type: ignore[arg-type]


def device_summary(nodes: Iterable[resources_pb2.Node]) -> str:
    """``GPU 6/8 (declared), NPU 2/2`` — free/total per kind, with provenance."""
    totals: dict[str, list[int]] = {}
    declared: set[str] = set()
    for node in nodes:
        for dev in node.devices:
            kind = kind_name(dev.kind)
            free_total = totals.setdefault(kind, [0, 0])
            free_total[1] += 1
            if not dev.allocated and dev.health == resources_pb2.DEVICE_HEALTH_HEALTHY:
                free_total[0] += 1
            if dev.provenance == resources_pb2.PROVENANCE_DECLARED:
                declared.add(kind)
    parts = []
    for kind, (free, total) in sorted(totals.items()):
        models = ""
        parts.append(f"{kind} {free}/{total}{' (declared)' if kind in declared else ''}{models}")
    return ", ".join(parts) or "-"


def unhealthy_devices_table(sites: Sequence[admin_service_pb2.Site]) -> Table | None:
    """Every device that is not healthy, with why; None when all are."""
    table = Table(title="Devices not healthy")
    for column in ("site", "node", "device", "model", "health", "reason"):
        table.add_column(column)
    for site in sites:
        for node in site.view.nodes:
            for dev in node.devices:
                if dev.health in (
                    resources_pb2.DEVICE_HEALTH_HEALTHY,
                    resources_pb2.DEVICE_HEALTH_UNSPECIFIED,
                ):
                    continue
                health = resources_pb2.DeviceHealth.Name(dev.health).removeprefix("DEVICE_HEALTH_")
                cells = (site.name, node.name, dev.id or str(dev.index), dev.model, health)
                table.add_row(*map(text, cells), text(dev.health_reason or "-"))
    return table if table.row_count else None


def coordinators_table(status: admin_service_pb2.GetFederationStatusResponse) -> Table:
    """The leader and the followers standing by, one row each."""
    table = Table(title=text(f"Coordinators (leader {status.leader or 'unknown'})"))
    table.add_column("address")
    table.add_column("role")
    table.add_column("join address")
    for coordinator in status.coordinators:
        role = text("leader", "bold") if coordinator.leader else text("follower")
        table.add_row(text(coordinator.address), role, text(coordinator.join_address or "-"))
    return table


SITE_WIDE_COLUMNS = (
    "region",
    "scheduler",
    "agent",
    "$/device-h",
    "joined (UTC)",
    "arrivals/h",
    "mean run",
)
"""What ``-o wide`` adds to the sites table."""


def endpoints_table(endpoints: Sequence[jobs_pb2.Endpoint], title: str = "Endpoints") -> Table:
    """One row per replica of a service: where clients reach it and whether it is ready."""
    table = Table(title=title)
    loaded = any(e.load or e.draining for e in endpoints)  # an autoscaled service
    columns = ("site", "node", "address", "replica", "revision", "ready", "restarts")
    for column in (*columns, "load") if loaded else columns:
        table.add_column(column)
    for e in endpoints:
        host = f"[{e.address}]" if ":" in e.address else e.address
        ready = "draining" if e.draining else "yes" if e.ready else "no"
        restarts = f"{e.restarts} (crash loop)" if e.crash_looping else str(e.restarts)
        row = [e.site, e.node, f"{host}:{e.port}", str(e.replica), str(e.revision), ready, restarts]
        table.add_row(*row, f"{e.load:g}") if loaded else table.add_row(*row)
    return table


def sites_table(sites: Sequence[admin_service_pb2.Site], *, wide: bool = False) -> Table:
    """One row per site; ``wide`` adds ``SITE_WIDE_COLUMNS``."""
    table = Table(title="Sites")
    for column in (
        "site",
        "domain",
        "state",
        "nodes",
        "cpu free/total",
        "devices free/total",
        "heartbeat",
        "unreachable for",
        "link to us",
        "source",
        "tasks",
        "next free",
        *(SITE_WIDE_COLUMNS if wide else ()),
    ):
        table.add_column(column)
    for site in sites:
        view = site.view
        # What could still be launched is counted in the nodes column, not as capacity.
        there = [
            n for n in view.nodes if n.launch.state != resources_pb2.NodeLaunch.STATE_LAUNCHABLE
        ]
        cpu_free = sum(n.cpu_free for n in there)
        cpu_total = sum(n.cpu_cores for n in there)
        provenances = {n.provenance for n in view.nodes} | {
            d.provenance for n in view.nodes for d in n.devices
        }
        source = "/".join(
            name
            for value, name in (
                (resources_pb2.PROVENANCE_DISCOVERED, "discovered"),
                (resources_pb2.PROVENANCE_DECLARED, "declared"),
            )
            if value in provenances
        )
        state = site_state_name(site.state) + (" cordoned" if site.cordoned else "")
        if site.cordoned_nodes:
            state += f" ({len(site.cordoned_nodes)} nodes cordoned)"
        if left := sum(d.tasks_left for d in site.drains):
            state += f" draining ({left} tasks left)"
        age = f"{site.heartbeat_age_s:.1f}s" if site.heartbeat_age_s >= 0 else "never"
        unreachable = (
            format_duration(site.unreachable_s)
            if site.state == admin_service_pb2.SITE_STATE_UNREACHABLE
            else "-"
        )
        cells: tuple[str, ...] = (
            site.name,
            domain_name(site.domain),
            state,
            nodes_cell(view.nodes),
            f"{cpu_free:g}/{cpu_total:g}",
            device_summary(there),
            age,
            unreachable,
            coordinator_link(view.coordinator_link),
            source or "-",
            *forecast_cells(site.forecast),
        )
        if wide:
            price = view.price_per_device_hour
            cells += (
                view.region or "-",
                view.scheduler or "-",
                view.agent_version or "-",
                f"{price:g}" if price else "-",
                utc_time(site.joined_at) if site.HasField("joined_at") else "-",
                f"{site.forecast.arrivals_per_hour:.1f}",
                format_duration(site.forecast.mean_run_s) if site.forecast.mean_run_s else "-",
            )
        table.add_row(*map(text, cells))
    return table


def nodes_cell(nodes: Sequence[resources_pb2.Node]) -> str:
    """Nodes running; for an elastic site also those it could launch, is launching, and
    that run idle (``3 (1 idle; 1 launching; +2 launchable)``)."""
    launch = resources_pb2.NodeLaunch
    states = Counter(n.launch.state for n in nodes if n.HasField("launch"))
    running = len(nodes) - states[launch.STATE_LAUNCHABLE] - states[launch.STATE_LAUNCHING]
    idle = sum(1 for n in nodes if n.launch.state == launch.STATE_RUNNING and n.launch.idle_since)
    notes = [
        f"{count} {what}"
        for count, what in (
            (idle, "idle"),
            (states[launch.STATE_LAUNCHING], "launching"),
        )
        if count
    ]
    if states[launch.STATE_LAUNCHABLE]:
        notes.append(f"+{states[launch.STATE_LAUNCHABLE]} launchable")
    return f"{running} ({'; '.join(notes)})" if notes else str(running)


def forecast_cells(forecast: admin_service_pb2.SiteForecast) -> tuple[str, str]:
    """``3 (+2 waiting)`` tasks, and when the first should end (``-``: none with an estimate)."""
    tasks = str(forecast.tasks) + (f" (+{forecast.waiting} waiting)" if forecast.waiting else "")
    free = format_duration(forecast.next_free_s) if forecast.next_free_s >= 0 else "-"
    return tasks, free


def time_left(stamp: timestamp_pb2.Timestamp, now_s: float | None = None) -> str:
    """``12d 3h left``, ``41m left``, ``expired``: how long until ``stamp``."""
    left_s = stamp.seconds - (time.time() if now_s is None else now_s)
    if left_s <= 0:
        return "expired"
    days, rest = divmod(int(left_s), 86400)
    hours, rest = divmod(rest, 3600)
    if days:
        return f"{days}d {hours}h left"
    if hours:
        return f"{hours}h {rest // 60}m left"
    return f"{rest // 60}m {rest % 60}s left"


def utc_time(stamp: timestamp_pb2.Timestamp) -> str:
    """``2025-03-01 14:02:09``: a moment in UTC, to the second."""
    return f"{stamp.ToDatetime():%Y-%m-%d %H:%M:%S}"


def coordinator_link(link: resources_pb2.Link) -> str:
    """The site's measured link to the coordinator, or "-" before it is measured."""
    if not link.measured_at:
        return "-"
    return f"{link.bandwidth_mbps:,.0f} Mbit/s {link.rtt_ms:.1f} ms"


def _published_links(
    sites: Sequence[admin_service_pb2.Site],
) -> list[tuple[str, resources_pb2.Link]]:
    return [
        (site.name, link)
        for site in sorted(sites, key=lambda s: s.name)
        for link in sorted(site.view.links, key=lambda link: link.peer_site)
    ]


def _age_s(link: resources_pb2.Link, now: float) -> float | None:
    return None if link.declared else max(now - link.measured_at, 0.0)


def link_records(sites: Sequence[admin_service_pb2.Site], *, now: float) -> list[dict[str, object]]:
    """Every published link as ``{from, to, bandwidth_mbps, rtt_ms, declared, age_s}``.

    ``age_s`` is seconds since the measurement by ``now``, and ``None`` for a declared link,
    which was never measured.
    """
    records: list[dict[str, object]] = []
    for source, link in _published_links(sites):
        age = _age_s(link, now)
        records.append(
            {
                "from": source,
                "to": link.peer_site,
                "bandwidth_mbps": link.bandwidth_mbps,
                "rtt_ms": link.rtt_ms,
                "declared": link.declared,
                "age_s": None if age is None else round(age, 1),
            }
        )
    return records


def links_matrix(sites: Sequence[admin_service_pb2.Site], *, now: float) -> Table:
    """A site-by-site table (rows from, columns to) of bandwidth / RTT and each one's age."""
    links = {(source, link.peer_site): link for source, link in _published_links(sites)}
    names = sorted({s.name for s in sites} | {to for _, to in links})
    table = Table(
        title="Links: bandwidth Mbit/s / RTT ms (age)",
        caption="rows: from, columns: to; * declared by the operator, not measured",
    )
    table.add_column("from \\ to")
    for name in names:
        table.add_column(text(name), justify="right")
    for source in names:
        cells = []
        for target in names:
            link = links.get((source, target))
            if source == target:
                cells.append("·")
            elif link is None:
                cells.append("-")
            else:
                cells.append(_link_cell(link, now))
        table.add_row(*map(text, (source, *cells)))
    return table


def _link_cell(link: resources_pb2.Link, now: float) -> str:
    figures = f"{_figure(link.bandwidth_mbps)} / {_figure(link.rtt_ms)}"
    age = _age_s(link, now)
    return f"{figures}*" if age is None else f"{figures} ({format_age(age)})"


def _figure(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def format_age(seconds: float) -> str:
    """``42s``, ``5m``, ``3h`` or ``2d``: the age of a measurement at a glance."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds:.0f}s"


def format_duration(seconds: float) -> str:
    """``42s``, ``5m 03s``, ``2h 10m``: how long something has lasted, to the second."""
    whole = max(0, int(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    if minutes:
        return f"{minutes}m {secs:02d}s"
    return f"{secs}s"


def estimate_line(task: jobs_pb2.TaskStatus) -> str:
    """``estimate: 3s queue + 1m 05s transfer + 24s run (±12%) on H100-80GB; ran 26s (1.08x)``:
    the estimate the site committed to, against what happened."""
    e = task.estimate
    line = (
        f"estimate: {format_duration(e.queue_s)} queue + {format_duration(e.transfer_s)} "
        f"transfer + {format_duration(e.run_s)} run"
    )
    if e.run_error:
        line += f" (±{e.run_error:.0%})"
    if e.device_model:
        line += f" on {e.device_model}"
    if task.HasField("started_at") and task.HasField("finished_at"):
        ran = (task.finished_at.ToNanoseconds() - task.started_at.ToNanoseconds()) / 1e9
        line += f"; ran {format_duration(ran)}"
        if e.run_s > 0:
            line += f" ({ran / e.run_s:.2f}x)"
    return line


def checkpoint_line(checkpoint: jobs_pb2.CheckpointRecord) -> str:
    """Where a task's newest checkpoint is, its size, when and by which copy it was made."""
    when = f"{checkpoint.time.ToDatetime():%H:%M:%S}" if checkpoint.HasField("time") else "?"
    return (
        f"{checkpoint.path} ({checkpoint.bytes} bytes) at {checkpoint.site} epoch "
        f"{checkpoint.epoch}, {when}, {checkpoint.progress_s:.0f}s of work"
    )


def artifact_line(artifact: jobs_pb2.Artifact) -> str:
    """One stored output: its name, size and where it is (a partial one says so)."""
    where = f"{artifact.key} at {artifact.site}" if artifact.key else f"kept at {artifact.site}"
    kind = " (folder)" if artifact.folder else ""
    partial = ", partial: kept after the task did not succeed" if artifact.partial else ""
    return f"{artifact.name}{kind}: {artifact.bytes} bytes, {where}{partial}"


JOB_WIDE_COLUMNS = ("queue", "priority", "submitted by", "created (UTC)")
"""What ``-o wide`` adds to the jobs table."""


def jobs_table(jobs: Sequence[jobs_pb2.Job], title: str = "Jobs", *, wide: bool = False) -> Table:
    """One row per job, its tasks one line each; ``wide`` adds ``JOB_WIDE_COLUMNS``."""
    table = Table(title=text(title))
    columns = ("job", "name", "tenant", "state", "tasks (site, state)", "reason")
    for column in (*columns, *(JOB_WIDE_COLUMNS if wide else ())):
        table.add_column(column, overflow="fold")
    for job in jobs:
        # One line per task: the newlines are ours, any in a name or a site come out escaped.
        tasks = Text("\n").join(
            text(
                f"{t.name}: {t.site or '-'} {state_name(t.state)}"
                + (f" exit {t.exit_code}" if t.state == jobs_pb2.JOB_STATE_FAILED else "")
            )
            for t in job.tasks
        )
        cells = (job.id, job.spec.name, job.spec.tenant, state_name(job.state))
        more: tuple[str, ...] = ()
        if wide:
            spec = job.spec
            priority = f"{spec.priority} ({spec.priority_class})" if spec.priority_class else ""
            more = (
                spec.queue or "-",
                priority or str(spec.priority),
                job.submitted_by or "-",
                utc_time(job.created_at) if job.HasField("created_at") else "-",
            )
        table.add_row(*map(text, cells), tasks, text(job.reason), *map(text, more))
    return table


def event_line(event: jobs_pb2.JobEvent) -> str:
    where = f" at {event.site}" if event.site else ""
    if event.moved_from:
        where = f" moved from {event.moved_from}"
    task = f" task {event.task}" if event.task else ""
    return (
        f"{event.time.ToDatetime():%H:%M:%S} {event.job_id}{task} -> {state_name(event.state)}"
        f"{where}: {event.reason} (job {state_name(event.job_state)})"
    )


def division_line(name: str, parts: Sequence[tuple[str, int]], unit: str = "replicas") -> str:
    """How a divided task's parts (site, replicas each) lie over sites:
    ``train: 6 replicas in 3 parts: dc-a 2, dc-b 2, cloud-a 2``; sites in order of the parts'
    numbers, then "not placed"."""
    by_site: dict[str, int] = {}
    for site, replicas in parts:
        by_site[site] = by_site.get(site, 0) + replicas
    left = by_site.pop("", 0)
    lying = [f"{site} {count}" for site, count in by_site.items()]
    if left:
        lying.append(f"not placed {left}")
    total = sum(replicas for _, replicas in parts)
    held = f"{total} {unit} in {len(parts)} parts" if unit != "parts" else f"{total} parts"
    return f"{name}: {held}: {', '.join(lying)}"


def job_details(
    reply: job_service_pb2.GetJobResponse, *, wide: bool = False
) -> Iterator[RenderableType]:
    """``fedctl jobs get``: the job's table, each task's details, then the job's events."""
    job = reply.job
    yield jobs_table([job], title=f"Job {job.id}", wide=wide)
    for name, parts in spread.division(job).items():
        yield text(division_line(name, parts))
    for task in job.tasks:
        yield Text.assemble(
            text(task.name, "bold"),
            text(
                f" {state_name(task.state)} at {task.site or '-'} epoch {task.epoch}: {task.reason}"
            ),
        )
        if task.nodes:
            yield text(f"  nodes: {', '.join(task.nodes)}")
        if task.devices:
            yield text(f"  devices: {', '.join(task.devices)}")
        if task.estimate.total_s:
            yield text("  " + estimate_line(task))
        if task.checkpoint.path:
            yield text("  checkpoint: " + checkpoint_line(task.checkpoint))
        for artifact in task.artifacts:
            yield text("  output " + artifact_line(artifact))
        spec = next((t for t in job.spec.tasks if t.name == task.name), None)
        most = retries.max_attempts(spec) if spec is not None else 1
        if task.failed_attempts and most > 1:
            later = (
                f", next not before {utc_time(task.retry_at)}" if task.HasField("retry_at") else ""
            )
            yield text(f"  failed attempts: {task.failed_attempts} of {most}{later}")
        if task.displaced.site:
            yield text(
                f"  last moved away from: epoch {task.displaced.epoch} at {task.displaced.site}"
            )
        moves = [e for e in reply.events if e.task == task.name and e.moved_from]
        if moves:
            yield text(f"  moves ({task.moves}):")
            for event in moves:
                yield text("    " + event_line(event))
        for verdict in task.verdicts:
            yield text(f"  {verdict.site}: [{verdict.stage}] {verdict.reason}")
        if task.output_tail:
            yield text("  output tail:")
            # Output keeps its lines, each indented so that none passes for a line of ours.
            lines = task.output_tail.rstrip().splitlines()
            yield Text("\n").join(text("    " + line) for line in lines)
    yield text("events", "bold")
    for event in reply.events:
        yield text("  " + event_line(event))


def print_whole(out: Console, renderables: Sequence[RenderableType]) -> None:
    """Print each at its natural width, even wider than the terminal: nothing cut or wrapped."""
    wide = out.options.update(width=1_000_000)
    widths = [Measurement.get(out, wide, r).maximum for r in renderables]
    width = out.width
    out.width = max([width, *widths])  # print() never goes past the console's width
    try:
        for renderable in renderables:
            out.print(renderable, crop=False)
    finally:
        out.width = width


def capacity_table(rows: Sequence[job_service_pb2.CapacityRow]) -> Table:
    """The federation's capacity per domain and model, and what the caller's jobs hold."""
    table = Table(title="Capacity (sites taking work now)")
    for column in ("domain", "kind", "model", "sites", "total", "healthy", "free", "yours"):
        table.add_column(
            column, justify="right" if column not in ("domain", "kind", "model") else "left"
        )
    for row in rows:
        table.add_row(
            text(row.domain),
            text(row.kind),
            text(row.model or "-"),
            str(row.sites),
            f"{row.total:g}",
            f"{row.healthy:g}",
            f"{row.free:.4g}",
            f"{row.yours:.4g}",
        )
    return table
