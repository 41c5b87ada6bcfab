"""A replay's results for people (tables), scripts (JSON, a per-task CSV) and eyes (PNG plots)."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np
from rich import box
from rich.console import Console
from rich.table import Table

from federation.common.job_state import S as JobState
from federation.sim.metrics import job_table
from federation.sim.replay import ReplayResult

PLOTS = ("jct_cdf.png", "utilisation.png", "wan_bytes.png")
MAX_POINTS = 2000
"""Points per line in the utilisation plot."""


def duration(seconds: float | None) -> str:
    """``42s``, ``3.5m``, ``7.2h``, ``3.1d``."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if abs(seconds) >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def size(num_bytes: float) -> str:
    """``12.3 TB`` and the like (decimal units)."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def warnings(result: ReplayResult) -> list[str]:
    """Lines for what the figures would otherwise hide: tasks that never ran."""
    out = []
    for name, m in result.summary["policies"].items():
        nowhere = m["tasks_that_fit_nowhere"]
        if nowhere:
            out.append(
                f"warning: {name}: {nowhere} of {result.summary['trace']['tasks']} task(s) fit "
                "nowhere (no site could hold them even idle) and never ran; their jobs are "
                "left out of the JCT figures"
            )
    return out


def print_tables(result: ReplayResult, console: Console) -> None:
    """Two tables, one row per policy: time figures, then resource figures."""
    summary = result.summary
    policies: Mapping[str, dict[str, Any]] = summary["policies"]
    topo, trace = summary["topology"], summary["trace"]
    devices = sum(topo["devices"].values())
    launchable = f" (+{topo['launchable_nodes']} launchable)" if "launchable_nodes" in topo else ""
    console.print(
        f"{trace['tasks']} tasks in {trace['jobs']} jobs over {topo['sites']} sites, "
        f"{topo['nodes']} nodes{launchable}, {devices} devices; lower bound on mean JCT "
        f"{duration(summary['lower_bound_mean_jct_s'])} (each job alone on its best device, "
        "data local)"
    )
    times = Table(title="Job completion time (JCT) and waiting", box=box.SIMPLE_HEAD)
    times.add_column("policy", no_wrap=True)
    for column in ("jobs done", "JCT mean", "p50", "p95", "p99", "x bound", "wait mean"):
        times.add_column(column, justify="right")
    for column in ("wait p95", "makespan", "slowdown", "deadline missed", "slower than est."):
        times.add_column(column, justify="right")
    for name, m in policies.items():
        jct, queue = m["jct_s"], m["queueing_delay_s"]
        ratio = m["jct_over_bound"]
        deadlines = m["deadlines"]
        times.add_row(
            name,
            f"{m['jobs_completed']}/{m['jobs']}",
            duration(jct["mean"]),
            duration(jct["p50"]),
            duration(jct["p95"]),
            duration(jct["p99"]),
            "-" if ratio is None else f"{ratio:.2f}",
            duration(queue["mean"]),
            duration(queue["p95"]),
            duration(m["makespan_s"]),
            "-" if m["slowdown"]["mean"] is None else f"{m['slowdown']['mean']:.2f}",
            f"{deadlines['missed']}/{deadlines['tasks_with_deadline']}",
            _share(m["slower_than_estimate"]["share"]),
        )
    console.print(times)
    resources = Table(title="Devices, data, money", box=box.SIMPLE_HEAD)
    resources.add_column("policy", no_wrap=True)
    for column in (
        "util",
        "util arriving",
        "alloc",
        "idle while waiting",
        "WAN",
        "transfer/JCT",
        "cost $",
        "offers",
        "declines",
    ):
        resources.add_column(column, justify="right")
    for name, m in policies.items():
        resources.add_row(
            name,
            _share(m["utilisation"]["all"]),
            _share(m["utilisation_while_arriving"]),
            _share(m["allocation"]["all"]),
            _share(m["fragmentation"]["idle_share_while_waiting"]),
            size(m["wan_bytes"]),
            _share(m["transfer_share_of_jct"]),
            f"{m['cost_usd']['total']:.2f}",
            str(m["offers"]),
            str(m["declines"]),
        )
    console.print(resources)
    console.print(energy_table(summary))
    if any("launches" in m for m in policies.values()):
        console.print(launch_table(policies))
    if any("sharing" in m for m in policies.values()):
        console.print(sharing_table(policies))
    if any("gangs_straddling" in m for m in policies.values()):
        console.print(straddle_table(policies))
    for line in warnings(result):
        console.print(line, style="bold yellow", markup=False, highlight=False)


def launch_table(policies: Mapping[str, Mapping[str, Any]]) -> Table:
    """Per policy: nodes launched, how long tasks waited for launches, the node-hours
    launched and what they cost, beside the total cost; with spot node types, the spot nodes
    taken back, the tasks stopped on them and the device-hours those lost."""
    table = Table(title="Elastic capacity (launched nodes)", box=box.SIMPLE_HEAD)
    table.add_column("policy", no_wrap=True)
    for column in ("launches", "wait mean", "wait p50", "wait p95", "node-h", "launch $"):
        table.add_column(column, justify="right")
    table.add_column("cost $", justify="right")
    spot = any("spot_reclaims" in m for m in policies.values())
    for column in ("reclaims", "interrupted", "dev-h lost") if spot else ():
        table.add_column(column, justify="right")
    for name, m in policies.items():
        wait = m["launch_wait_s"]
        reclaims = ("spot_reclaims", "spot_interruptions") if spot else ()
        table.add_row(
            name,
            str(m["launches"]),
            duration(wait["mean"]),
            duration(wait["p50"]),
            duration(wait["p95"]),
            f"{m['launched_node_hours']:.2f}",
            f"{m['cost_usd']['elastic']:.2f}",
            f"{m['cost_usd']['total']:.2f}",
            *(str(m[key]) for key in reclaims),
            *([f"{m['spot_device_hours_lost']:.2f}"] if spot else []),
        )
    return table


def straddle_table(policies: Mapping[str, Mapping[str, Any]]) -> Table:
    """Per policy and topology level: how many gangs over several nodes straddled it."""
    table = Table(title="Gangs straddling a topology level", box=box.SIMPLE_HEAD)
    for column in ("policy", "level", "gangs", "straddled", "share"):
        table.add_column(column, justify="left" if column in ("policy", "level") else "right")
    for name, m in policies.items():
        levels = m.get("gangs_straddling", {})
        for n, (level, counts) in enumerate(levels.items()):
            table.add_row(
                name if n == 0 else "",
                level,
                str(counts["gangs"]),
                str(counts["straddled"]),
                _share(counts["share"]),
            )
    return table


def _signed_share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def energy_table(summary: Mapping[str, Any]) -> Table:
    """One row per policy: energy busy, idle and in all, and against the default policy the
    kWh saved and the JCT lost, side by side."""
    default = summary.get("default_policy", "completion-time")
    idle = summary.get("idle_power_share", 0.0)
    table = Table(
        title=f"Energy (idle devices of nodes in use draw {100 * idle:.0f}% of TDP; nodes with"
        f" no task are off) against {default}",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("policy", no_wrap=True)
    for column in (
        "busy kWh",
        "idle kWh",
        "energy kWh",
        "node-h on",
        "kWh saved",
        "saved",
        "JCT mean",
        "JCT change",
    ):
        table.add_column(column, justify="right")
    for name, m in summary["policies"].items():
        saved = m.get("energy_saved_kwh_vs_default")
        table.add_row(
            name,
            f"{m['energy_kwh']:.1f}",
            f"{m['energy_idle_kwh']:.1f}",
            f"{m['energy_total_kwh']:.1f}",
            f"{m['powered_node_hours']:.0f}",
            "-" if saved is None else f"{saved:+.1f}",
            _signed_share(m.get("energy_saved_share_vs_default")),
            duration(m["jct_s"]["mean"]),
            _signed_share(m.get("jct_change_vs_default")),
        )
    return table


def sharing_table(policies: Mapping[str, Mapping[str, Any]]) -> Table:
    """One row per policy and tenant: jobs, JCT, mean dominant share while every tenant had
    work waiting, preemptions suffered and the device-hours they lost; Jain's index over the
    weight-normalised shares on each policy's first row."""
    table = Table(
        title="Tenants (shares while every tenant has a task waiting; Jain's index over share"
        " / weight)",
        box=box.SIMPLE_HEAD,
    )
    table.add_column("policy", no_wrap=True)
    table.add_column("tenant", no_wrap=True)
    for column in ("weight", "jobs done", "JCT mean", "JCT p95", "share", "preempted"):
        table.add_column(column, justify="right")
    for column in ("dev-h lost", "contended", "Jain"):
        table.add_column(column, justify="right")
    for name, m in policies.items():
        sharing = m["sharing"]
        for n, (tenant, t) in enumerate(sharing["tenants"].items()):
            jain = sharing["jain_index"]
            table.add_row(
                name if n == 0 else "",
                tenant,
                "-" if t["weight"] is None else f"{t['weight']:g}",
                f"{t['jobs_completed']}/{t['jobs']}",
                duration(t["jct_s"]["mean"]),
                duration(t["jct_s"]["p95"]),
                _share(t["mean_share"]),
                str(t["preemptions"]),
                f"{t['device_hours_lost']:.2f}",
                duration(sharing["contended_hours"] * 3600.0) if n == 0 else "",
                ("-" if jain is None else f"{jain:.3f}") if n == 0 else "",
            )
    return table


def write_json(result: ReplayResult, out: IO[str]) -> None:
    """The summary as JSON (no wall-clock times, so equal seeds give equal output)."""
    json.dump(result.summary, out, indent=2, sort_keys=True)
    out.write("\n")


def write_records(result: ReplayResult, path: Path) -> None:
    """One CSV row per (policy, task): where and when it ran, and what it moved and cost."""
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "policy",
                "job_id",
                "task",
                "state",
                "site",
                "submit_s",
                "placed_s",
                "started_s",
                "finished_s",
                "transfer_s",
                "run_s",
                "wan_bytes",
                "cost_usd",
                "energy_kwh",
                "bound_s",
            ]
        )
        for name, outcome in result.outcomes.items():
            sites = outcome.site_ids
            for run, bound in zip(outcome.tasks, result.bounds, strict=True):
                writer.writerow(
                    [
                        name,
                        run.trace.job_id,
                        run.trace.task,
                        JobState.Name(run.state).removeprefix("JOB_STATE_"),  # type: ignore[arg-type]
                        sites[run.site] if run.site >= 0 else "",
                        f"{run.trace.submit_s:.3f}",
                        *(
                            f"{v:.3f}" if math.isfinite(v) else ""
                            for v in (run.placed_s, run.started_s, run.finished_s)
                        ),
                        f"{run.transfer_s:.3f}",
                        f"{run.run_s:.3f}",
                        int(run.wan_bytes),
                        f"{run.compute_usd + run.egress_usd:.6f}",
                        f"{run.energy_kwh:.6f}",
                        f"{bound:.3f}" if math.isfinite(bound) else "",
                    ]
                )


def write_plots(result: ReplayResult, folder: Path) -> list[Path]:
    """JCT CDF per policy, devices running over time, and WAN bytes per policy, as PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, outcome in result.outcomes.items():
        jobs = job_table(outcome.tasks, result.bounds)
        jct = np.sort(jobs["jct"][jobs["done"]])
        if len(jct):
            ax.step(np.maximum(jct, 1e-3), np.arange(1, len(jct) + 1) / len(jct), label=name)
    ax.set(xscale="log", xlabel="job completion time (s)", ylabel="share of jobs")
    ax.set_title("JCT CDF per policy")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, folder / PLOTS[0]))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ends = [
        r.finished_s
        for outcome in result.outcomes.values()
        for r in outcome.tasks
        if r.finished_s >= 0
    ]
    horizon_h = float(np.percentile(ends, 99)) / 3600.0 if ends else 1.0
    for name, outcome in result.outcomes.items():
        if not outcome.series:
            continue
        series = np.array(outcome.series)
        step = max(1, len(series) // MAX_POINTS)
        capacity = max(float(outcome.capacity.sum()), 1.0)
        ax.step(series[::step, 0] / 3600.0, series[::step, 1] / capacity, where="post", label=name)
    ax.set(xlabel="simulated time (h)", ylabel="devices running / all devices", ylim=(0, 1.02))
    ax.set_xlim(0, max(horizon_h, 1e-3))
    ax.set_title("Utilisation over time (until 99% of tasks had finished)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    written.append(_save(fig, folder / PLOTS[1]))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = list(result.summary["policies"])
    wan = [result.summary["policies"][n]["wan_bytes"] / 1e12 for n in names]
    ax.bar(names, wan, color="tab:blue")
    ax.set(ylabel="bytes over the WAN (TB)")
    ax.set_title("Data moved between sites")
    ax.tick_params(axis="x", rotation=30)
    ax.grid(True, axis="y", alpha=0.3)
    written.append(_save(fig, folder / PLOTS[2]))
    return written


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
