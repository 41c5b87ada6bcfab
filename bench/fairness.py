"""Fair share under contention, and urgent work that preempts it, over real agents.

A real coordinator and three sites (24 declared GPUs by default, ``--gpus``) as processes over
mTLS on loopback. Three tenants own queues of weights 1:1:2 (nominal GPU quotas a quarter, a
quarter and half of the fleet, each may borrow a quarter more). While one job per GPU (in no
queue) holds the fleet, each tenant submits, at once, more one-GPU jobs than fit: real
processes that work 5-9 s (seeded), write a checkpoint each second of work (the agent reports
them), and restart from the newest reported checkpoint after a preemption; then the holding
jobs all end, so every queue waits as the GPUs free. Once every GPU runs a tenant's job, and
while every queue has jobs waiting, the run is sampled every 0.25 s. Each task process records
when it started and ended and on which GPU, and the tenants' shares come from those records:
the share of the fleet's GPU time each tenant's processes held over the 2 s up to each sample
(``share_deviation_max``), and at the sample itself (``share_deviation_instant_max``). Then a
burst of urgent jobs (a priority class that may preempt; no queue) arrives on the full fleet;
the agents give victims ``kill_grace_s`` = 2 s after SIGTERM. At the end every job must have
finished, once. Baselines from the same run: the same burst of urgent jobs on the idle fleet
(a start without preemption), the work victims would have lost without checkpoints, one GPU's
share of the fleet.

    python bench/fairness.py [--gpus 24] [--seconds 60] [--work 5 9] [--urgent N]
        [--reclaim-min-run-s 120] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from federation.api.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    job_service_pb2,
    job_service_pb2_grpc,
    jobs_pb2,
    queues_pb2,
)
from federation.jobspec import job_spec_from_dict
from federation.local import LocalFederation, SiteSpec
from federation.security.identity import Identity, Role
from federation.security.pki import issue_client_files
from federation.security.tls import TlsFiles, channel_credentials
from federation.watch import events_of

KILL_GRACE_S = 2.0
"""The agents' SIGTERM-to-SIGKILL grace for a victim's last checkpoint."""
START_GOAL_MARGIN_S = 5.0
SHARE_GOAL = 0.05
SAMPLE_EVERY_S = 0.25
SHARE_WINDOW_S = 2.0
"""The goal's share is a tenant's GPU time over this long up to each sample (see README)."""
CHECKPOINT_EVERY_S = 1.0
"""Seconds of work between a task's checkpoints; the agent looks for new ones as often."""
WORK_S = (5.0, 9.0)
"""A tenant job's work, drawn uniformly (seeded) so the jobs do not end in lockstep."""
URGENT_WORK_S = 3.0
TAIL_S = 15.0
"""Work each queue has left, per GPU of its share, when the contention sampling ends: the
urgent burst must still find the fleet full and every queue waiting."""
DRAIN_MARGIN_S = 60.0

TENANTS = {"team-a": 1.0, "team-b": 1.0, "team-c": 2.0}
"""Tenant (and its queue's name) -> weight."""
BORROW_SHARE = 0.25
"""What each queue may borrow beyond its nominal quota, as a share of the fleet."""
RECLAIM_MIN_RUN_S = 120.0
"""The coordinator's default, longer than any job here: a lent GPU comes back when the job
that borrowed it ends. At 0 the queues took GPUs back from each other all through the
contention, about as often as jobs ended (see README)."""

NODE_GPUS = 8
SITE_LAYOUT = (
    ("dc-1", "datacenter", "dgx", "A100-80GB", 3),
    ("dc-2", "datacenter", "hgx", "A100-80GB", 2),
    ("cloud-1", "cloud", "p5", "H100-80GB", 1),
)
"""Site, domain, node name, GPU model, and the site's part of the fleet (3:2:1)."""


def gpu_node(name: str, gpus: int, model: str) -> dict[str, Any]:
    device = {"kind": "GPU", "vendor": "nvidia", "model": model, "memory_mib": 81920}
    return {
        "name": name,
        "cpu_cores": 16 * gpus,
        "memory_mib": 262144,
        "devices": [{**device, "count": gpus}],
    }


def fleet(gpus: int) -> list[SiteSpec]:
    """``gpus`` declared GPUs over the three sites (3:2:1), in nodes of up to 8."""
    parts = [layout[4] for layout in SITE_LAYOUT]
    counts = [gpus * part // sum(parts) for part in parts]
    counts[0] += gpus - sum(counts)
    settings = {"kill_grace_s": KILL_GRACE_S}
    sites = []
    for (site, domain, node, model, _), count in zip(SITE_LAYOUT, counts, strict=True):
        nodes = [
            gpu_node(f"{node}-{i}", min(NODE_GPUS, count - first), model)
            for i, first in enumerate(range(0, count, NODE_GPUS))
        ]
        sites.append(SiteSpec(site, domain, nodes, settings=settings))
    return sites


COORDINATOR_CONFIG = """\
preemption_min_run_s = 0.0
reclaim_min_run_s = {reclaim_min_run_s!r}
[priority_classes.urgent]
value = 900
may_preempt = true
preemptible = false
[priority_classes.batch]
value = -100
"""

# Works ``work`` seconds in all, counting from the progress its restore point holds; writes
# a checkpoint (its progress) each ``every`` seconds of work when the task declares a policy.
# Markers in the folder argv[1], KIND-NAME-EPOCH, each a JSON object: the progress, the wall
# clock, the GPU (site/devices) and the job's id when written. start- (restored progress),
# stopped- (progress when SIGTERM came), done- (progress at the end).
MARK = """
import json, os, signal, sys, time
env = os.environ
tag = sys.argv[2] + "-" + env["FEDERATION_EPOCH"]
gpu = env["FEDERATION_SITE"] + "/" + env["FEDERATION_DEVICES"]
def mark(kind, value):
    with open(os.path.join(sys.argv[1], kind + "-" + tag), "w") as f:
        at = time.time()
        json.dump({"progress": value, "at": at, "gpu": gpu, "job": env["FEDERATION_JOB_ID"]}, f)
"""
TASK = (
    MARK
    + """
work, every = float(sys.argv[3]), float(sys.argv[4])
t0 = time.time()
restore = os.environ.get("FEDERATION_RESTORE_FROM", "")
base = float(open(restore).read()) if restore else 0.0
def progress():
    return base + time.time() - t0
def stop(*_):
    mark("stopped", progress())
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
mark("start", base)
folder = os.environ.get("FEDERATION_CHECKPOINT_DIR")
n = 0
while progress() < work:
    now = progress()
    nxt = min(work, (int(now / every) + 1) * every) if folder else work
    time.sleep(max(0.0, nxt - now))
    if folder and progress() < work:
        n += 1
        path = os.path.join(folder, "ckpt-%04d" % n)
        with open(path, "w") as f:
            f.write(repr(progress()))
        open(path + ".done", "w").close()
mark("done", progress())
"""
)
# Holds its GPU until the file argv[3] exists.
HOLD = (
    MARK
    + """
mark("start", 0.0)
while not os.path.exists(sys.argv[3]):
    time.sleep(0.02)
mark("done", 0.0)
"""
)


def tenant_channel(fed: LocalFederation, tenant: str) -> grpc.aio.Channel:
    cert, key = issue_client_files(fed.pki, Identity(Role.TENANT, tenant))
    tls = TlsFiles(ca=fed.pki.ca_cert, cert=cert, key=key)
    return grpc.aio.secure_channel(fed.address, channel_credentials(tls))


def job(
    name: str, markers: Path, work_s: float, *, queue: str = "", urgent: bool = False
) -> jobs_pb2.JobSpec:
    every = str(CHECKPOINT_EVERY_S)
    task: dict[str, Any] = {
        "name": "t",
        "command": [sys.executable, "-c", TASK, str(markers), name, f"{work_s:.3f}", every],
        "resources": {"cpu": 1, "memory_mib": 128, "accelerator": {"kind": "GPU", "count": 1}},
    }
    if not urgent:
        task["checkpoint"] = {"interval_s": CHECKPOINT_EVERY_S}
    doc: dict[str, Any] = {"name": name, "tasks": [task]}
    doc["priority_class"] = "urgent" if urgent else "batch"
    if queue:
        doc["queue"] = queue
    return job_spec_from_dict(doc)


def hold_job(name: str, markers: Path, release: Path) -> jobs_pb2.JobSpec:
    """A job in no queue that holds one GPU until ``release`` exists."""
    task = {
        "name": "t",
        "command": [sys.executable, "-c", HOLD, str(markers), name, str(release)],
        "resources": {"cpu": 1, "memory_mib": 128, "accelerator": {"kind": "GPU", "count": 1}},
    }
    return job_spec_from_dict({"name": name, "tasks": [task], "priority_class": "batch"})


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else math.nan


def quantile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


class Phases:
    """A progress bar per phase on a terminal (stderr); plain lines otherwise."""

    def __init__(self, enabled: bool, console: Console) -> None:
        self._enabled = enabled
        self._console = console
        self._bar: Progress | None = None
        self._task: Any = None

    @contextlib.contextmanager
    def running(self) -> Iterator[Phases]:
        if not self._enabled:
            yield self
            return
        columns = (
            TextColumn("{task.description:<34}", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=self._console, transient=True) as bar:
            self._bar = bar
            yield self
        self._bar = None

    def start(self, what: str, total: float | None) -> None:
        if self._bar is None:
            print(f"[fairness] {what}", file=sys.stderr, flush=True)
            return
        if self._task is not None:
            self._bar.update(self._task, visible=False)
        self._task = self._bar.add_task(what, total=total)

    def update(self, done: float) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=done)


@dataclass
class Tracker:
    """Every job's state as WatchJobs tells it, and when it was first seen RUNNING."""

    state: dict[str, int] = field(default_factory=dict)
    running_at: dict[str, float] = field(default_factory=dict)
    reclaims: int = 0
    """Victims back to PENDING whose event says a queue took back its nominal quota..."""
    for_urgent: int = 0
    """... or that a job of a higher priority (an urgent one) took their room."""
    found_no_room: set[str] = field(default_factory=set)
    """Jobs the coordinator once found no room for ('no site can take it now')."""

    def see(self, event: jobs_pb2.JobEvent) -> None:
        self.state[event.job_id] = event.job_state
        if event.job_state == jobs_pb2.JOB_STATE_RUNNING:
            self.running_at.setdefault(event.job_id, time.perf_counter())
        if event.reason.startswith("preempted by "):  # a victim back to PENDING
            self.reclaims += "taking back the nominal quota" in event.reason
            self.for_urgent += "a job of priority" in event.reason
        if event.reason.startswith("no site can take it now"):
            self.found_no_room.add(event.job_id)

    def running(self, ids: set[str]) -> int:
        return sum(1 for i in ids if self.state.get(i) == jobs_pb2.JOB_STATE_RUNNING)

    def finished(self, ids: set[str]) -> int:
        return sum(1 for i in ids if self.state.get(i, 0) in FINAL)


FINAL = frozenset(
    {jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED}
)


@dataclass(frozen=True)
class Setup:
    """What one run measures with."""

    gpus: int
    seconds: float
    work_s: tuple[float, float]
    jobs: dict[str, int]
    """Jobs per tenant."""
    urgent: int
    reclaim_min_run_s: float
    seed: int

    @property
    def target(self) -> dict[str, float]:
        """Each tenant's weight share."""
        return {name: w / sum(TENANTS.values()) for name, w in TENANTS.items()}


async def queues_now(admin: admin_service_pb2_grpc.AdminServiceAsyncStub) -> dict[str, Any]:
    reply = await admin.ListQueues(admin_service_pb2.ListQueuesRequest())
    return {q.queue.name: q for q in reply.queues if q.queue.name in TENANTS}


async def burst(
    stub: job_service_pb2_grpc.JobServiceAsyncStub,
    tracker: Tracker,
    specs: list[jobs_pb2.JobSpec],
    phases: Phases,
) -> dict[str, float]:
    """Submit the jobs at once; seconds from submit to RUNNING for each, by job id."""
    submitted = time.perf_counter()
    reply = await stub.SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=specs))
    ids = {j.id for j in reply.jobs}
    deadline = submitted + 120.0
    while (started := len(ids & tracker.running_at.keys())) < len(ids):
        phases.update(started)
        if time.perf_counter() > deadline:
            break
        await asyncio.sleep(0.05)
    phases.update(len(ids & tracker.running_at.keys()))
    return {i: tracker.running_at[i] - submitted for i in ids if i in tracker.running_at}


async def measure(setup: Setup, phases: Phases, workdir: Path | None = None) -> dict[str, Any]:
    rng = random.Random(setup.seed)
    gpus = setup.gpus
    with contextlib.ExitStack() as stack:
        if workdir is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-fairness-")))
        else:
            root = workdir
            root.mkdir(parents=True)
        markers = root / "markers"
        markers.mkdir()
        config = root / "coordinator.toml"
        config.write_text(COORDINATOR_CONFIG.format(reclaim_min_run_s=setup.reclaim_min_run_s))
        sites = fleet(gpus)
        fed = LocalFederation(root / "fed", sites, coordinator_args=["--config", str(config)])
        tracker = Tracker()
        follower: asyncio.Task[None] | None = None
        channels: list[grpc.aio.Channel] = []
        try:
            phases.start(f"starting coordinator and {len(sites)} sites", None)
            await fed.start()
            operator = fed.operator().channel()
            channels.append(operator)
            admin = admin_service_pb2_grpc.AdminServiceStub(operator)
            ops = job_service_pb2_grpc.JobServiceStub(operator)
            for name, weight in TENANTS.items():
                quota = queues_pb2.Quota(
                    resource="gpu",
                    nominal=gpus * setup.target[name],
                    borrowing_limit=gpus * BORROW_SHARE,
                )
                queue = queues_pb2.Queue(name=name, tenant=name, weight=weight, quotas=[quota])
                await admin.CreateQueue(admin_service_pb2.CreateQueueRequest(queue=queue))
            watch = ops.WatchJobs(job_service_pb2.WatchJobsRequest())

            async def follow() -> None:
                with contextlib.suppress(grpc.aio.AioRpcError):  # the federation stopped
                    async for event in events_of(watch):
                        tracker.see(event)

            follower = asyncio.create_task(follow())
            await asyncio.sleep(0.2)  # the watch subscribes before the first submit

            # Baseline: the same burst of urgent jobs on the idle fleet (no preemption).
            idle_n = min(setup.urgent, gpus)
            phases.start("urgent burst on the idle fleet", idle_n)
            specs = [job(f"idle-{i:02d}", markers, 0.5, urgent=True) for i in range(idle_n)]
            idle = await burst(ops, tracker, specs, phases)
            phases.start("idle fleet: waiting for the burst to end", idle_n)
            while tracker.finished(set(idle)) < len(idle):
                phases.update(tracker.finished(set(idle)))
                await asyncio.sleep(0.1)

            # The fleet is busy while the tenants submit, and frees at once after: every
            # queue waits when the GPUs free, and the first submit to arrive does not take
            # (borrow) the fleet before the others are in.
            phases.start("keeping the fleet busy", gpus)
            release = root / "release"
            specs = [hold_job(f"hold-{i:02d}", markers, release) for i in range(gpus)]
            holds = await burst(ops, tracker, specs, phases)

            # Contention: every tenant submits more than fits, all at once.
            submits = []
            for name in TENANTS:
                channel = tenant_channel(fed, name)
                channels.append(channel)
                specs = [
                    job(f"{name}-{i:03d}", markers, rng.uniform(*setup.work_s), queue=name)
                    for i in range(setup.jobs[name])
                ]
                stub = job_service_pb2_grpc.JobServiceStub(channel)
                submits.append(stub.SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=specs)))
            replies = await asyncio.gather(*submits)
            owner = {j.id: j.spec.queue for reply in replies for j in reply.jobs}
            await asyncio.sleep(0.5)  # a scheduling pass finds every tenant's jobs waiting
            release.touch()
            # Steady: every GPU runs a tenant's job.
            phases.start("filling the fleet", gpus)
            deadline = time.perf_counter() + 60.0
            while (busy := tracker.running(set(owner))) < gpus:
                phases.update(busy)
                if time.perf_counter() > deadline:
                    break
                await asyncio.sleep(0.1)

            phases.start(f"contention, sampling every {SAMPLE_EVERY_S} s", setup.seconds)
            samples: list[dict[str, Any]] = []
            start = time.perf_counter()
            while (elapsed := time.perf_counter() - start) < setup.seconds:
                at = time.time()
                held = await queues_now(admin)
                if any(q.waiting_jobs == 0 for q in held.values()):
                    break  # a queue ran dry: no longer contended
                samples.append(
                    {
                        "at": at,
                        "admitted": {n: q.usage.get("gpu", 0.0) for n, q in held.items()},
                        "admitted_share": {
                            n: q.dominant_share * TENANTS[n] for n, q in held.items()
                        },
                    }
                )
                phases.update(elapsed)
                await asyncio.sleep(
                    max(0.0, start + len(samples) * SAMPLE_EVERY_S - time.perf_counter())
                )
            held = await queues_now(admin)
            busy_at_burst = sum(q.usage.get("gpu", 0.0) for q in held.values())

            phases.start("urgent burst on the full fleet", setup.urgent)
            specs = [
                job(f"urgent-{i:02d}", markers, URGENT_WORK_S, urgent=True)
                for i in range(setup.urgent)
            ]
            starts = await burst(ops, tracker, specs, phases)

            everything = set(owner) | set(idle) | set(holds) | set(starts)
            total = len(owner) + idle_n + gpus + setup.urgent
            work_left = sum(setup.work_s) / 2 * len(owner) / gpus
            phases.start("draining: jobs finished", total)
            deadline = time.perf_counter() + work_left + DRAIN_MARGIN_S
            while tracker.finished(everything) < total and time.perf_counter() < deadline:
                phases.update(tracker.finished(everything))
                await asyncio.sleep(0.2)
            phases.update(tracker.finished(everything))
            final: dict[str, jobs_pb2.Job] = {}
            token = ""
            while True:
                page = await ops.ListJobs(
                    job_service_pb2.ListJobsRequest(page_size=1000, page_token=token)
                )
                final.update({j.id: j for j in page.jobs})
                if not (token := page.next_page_token):
                    break
        finally:
            if follower is not None:
                follower.cancel()
            for channel in channels:
                await channel.close()
            fed.stop()
        return report(
            setup=setup,
            marks=read_markers(markers),
            final=final,
            tracker=tracker,
            idle=idle,
            starts=starts,
            samples=samples,
            busy_at_burst=busy_at_burst,
        )


Marks = dict[str, dict[str, dict[int, dict[str, Any]]]]


def read_markers(folder: Path) -> Marks:
    """kind -> job name -> epoch -> the marker (progress, wall clock, GPU)."""
    out: Marks = {}
    for path in folder.iterdir():
        kind, rest = path.name.split("-", 1)
        name, epoch = rest.rsplit("-", 1)
        out.setdefault(kind, {}).setdefault(name, {})[int(epoch)] = json.loads(path.read_text())
    return out


@dataclass(frozen=True)
class Run:
    """One task process: its job, GPU, and when it started and ended (wall clock)."""

    name: str
    gpu: str
    start: float
    end: float
    """``math.inf`` when the process left no end marker."""


def process_runs(marks: Marks) -> list[Run]:
    """Every task process the markers tell of."""
    ended = {**marks.get("done", {})}
    for name, epochs in marks.get("stopped", {}).items():
        ended[name] = {**ended.get(name, {}), **epochs}
    runs = []
    for name, epochs in marks.get("start", {}).items():
        for epoch, mark in epochs.items():
            end = ended.get(name, {}).get(epoch)
            runs.append(Run(name, mark["gpu"], mark["at"], end["at"] if end else math.inf))
    return runs


def tenant_of(name: str) -> str | None:
    return next((t for t in TENANTS if name.startswith(f"{t}-")), None)


def held_over(runs: list[Run], since: float, until: float) -> float:
    """GPU-seconds ``runs`` held between ``since`` and ``until`` (one GPU each)."""
    return sum(max(0.0, min(r.end, until) - max(r.start, since)) for r in runs)


def running_at(runs: list[Run], at: float) -> int:
    return sum(1 for r in runs if r.start <= at < r.end)


def turnover(runs: list[Run], since: float, until: float) -> tuple[list[float], int]:
    """Per GPU, the idle time from each process's end within [since, until] to the next
    start on that GPU; and how many processes started on a GPU still held by another."""
    by_gpu: dict[str, list[Run]] = {}
    for r in runs:
        by_gpu.setdefault(r.gpu, []).append(r)
    gaps, overlaps = [], 0
    for line in by_gpu.values():
        line.sort(key=lambda r: r.start)
        for before, after in itertools.pairwise(line):
            if after.start < before.end:
                overlaps += 1
            elif since <= before.end <= until:
                gaps.append(after.start - before.end)
    return gaps, overlaps


def shares(
    setup: Setup, runs: list[Run], samples: list[dict[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The share figures from the task processes at the samples, and the samples with them."""
    gpus, target = setup.gpus, setup.target
    by_tenant: dict[str, list[Run]] = {t: [] for t in TENANTS}
    for r in runs:
        if (tenant := tenant_of(r.name)) is not None:
            by_tenant[tenant].append(r)
    if not samples:
        return {}, []
    first, last = samples[0]["at"], samples[-1]["at"]
    rows = []
    instant, windowed, steady, admitted = [], [], [], []
    worst: dict[str, Any] = {}
    worst_instant: dict[str, Any] = {}
    for s in samples:
        at = s["at"]
        running = {t: running_at(by_tenant[t], at) for t in TENANTS}
        row = {
            "t": round(at - first, 2),
            "at": round(at, 3),
            "running": running,
            "idle_gpus": gpus - running_at(runs, at),
            "admitted": s["admitted"],
        }
        instant.append(max(abs(running[t] / gpus - target[t]) for t in TENANTS))
        if instant[-1] > worst_instant.get("deviation", -1.0):
            worst_instant = {"t": row["t"], "deviation": instant[-1], "running": running}
        admitted.append(max(abs(s["admitted_share"][t] - target[t]) for t in TENANTS))
        if at - SHARE_WINDOW_S >= first:  # the window lies within the contention
            window = {
                t: held_over(by_tenant[t], at - SHARE_WINDOW_S, at) / (gpus * SHARE_WINDOW_S)
                for t in TENANTS
            }
            gap = max(abs(window[t] - target[t]) for t in TENANTS)
            windowed.append(gap)
            if at - first >= setup.work_s[1]:  # every job placed at the fill has ended
                steady.append(gap)
            row["window_share"] = {t: round(v, 4) for t, v in window.items()}
            if gap > worst.get("deviation", -1.0):
                worst = {"t": row["t"], "deviation": gap, "window_share": row["window_share"]}
        rows.append(row)
    span = max(last - first, 1e-9)
    mean_share = {t: held_over(by_tenant[t], first, last) / (gpus * span) for t in TENANTS}
    gaps, overlaps = turnover(runs, first, last)
    idle = [row["idle_gpus"] for row in rows]
    figures = {
        "share_deviation_max": max(windowed, default=math.nan),
        "share_deviation_mean": float(np.mean(windowed)) if windowed else math.nan,
        "share_over_goal": sum(1 for d in windowed if d > SHARE_GOAL) / max(1, len(windowed)),
        "share_deviation_steady_max": max(steady, default=math.nan),
        "share_deviation_instant_max": max(instant),
        "share_deviation_instant_mean": float(np.mean(instant)),
        "share_deviation_instant_p95": quantile(instant, 95),
        "share_deviation_instant_max_at": worst_instant,
        "share_deviation_admitted_max": max(admitted),
        "share_deviation_admitted_mean": float(np.mean(admitted)),
        "share_deviation_of_mean": max(abs(mean_share[t] - target[t]) for t in TENANTS),
        "mean_share": mean_share,
        "share_deviation_max_at": worst,
        "share_samples": len(samples),
        "share_window_samples": len(windowed),
        "gpus_idle_mean": float(np.mean(idle)),
        "gpus_idle_max": max(idle),
        "turnover_gaps": len(gaps),
        "turnover_gap_p50_s": quantile(gaps, 50),
        "turnover_gap_p95_s": quantile(gaps, 95),
        "turnover_gap_max_s": max(gaps, default=math.nan),
        "gpu_overlaps": overlaps,
    }
    return figures, rows


def report(
    *,
    setup: Setup,
    marks: Marks,
    final: dict[str, jobs_pb2.Job],
    tracker: Tracker,
    idle: dict[str, float],
    starts: dict[str, float],
    samples: list[dict[str, Any]],
    busy_at_burst: float,
) -> dict[str, Any]:
    names = {j.id: j.spec.name for j in final.values()}
    runs = process_runs(marks)
    share_figures, rows = shares(setup, runs, samples)
    done, started, stopped = (marks.get(k, {}) for k in ("done", "start", "stopped"))
    lost = sorted(
        n
        for i, n in names.items()
        if final[i].state != jobs_pb2.JOB_STATE_SUCCEEDED or not done.get(n)
    )
    twice = sorted(n for n in names.values() if len(done.get(n, {})) > 1)
    # Work lost: a victim's progress when SIGTERM came, less the progress of the checkpoint
    # its next epoch restored (all of it when nothing restored it).
    lost_s: list[float] = []
    no_checkpoint_s = 0.0
    for name, epochs in stopped.items():
        for epoch, at_stop in epochs.items():
            later = [e for e in started.get(name, {}) if e > epoch]
            restored = started[name][min(later)]["progress"] if later else 0.0
            lost_s.append(max(0.0, at_stop["progress"] - restored))
            no_checkpoint_s += at_stop["progress"]
    # An urgent job that found no free room can start only once some task stops: the
    # coordinator preempts for it (or a task ends by itself first).
    needed = [s for i, s in starts.items() if i in tracker.found_no_room]
    contended_s = samples[-1]["at"] - samples[0]["at"] if samples else 0.0
    return {
        "gpus": setup.gpus,
        "sites": [
            (s.name, sum(n["devices"][0]["count"] for n in s.nodes)) for s in fleet(setup.gpus)
        ],
        "tenants": dict(TENANTS),
        "jobs_per_tenant": setup.jobs,
        "work_s": list(setup.work_s),
        "urgent_jobs": setup.urgent,
        "reclaim_min_run_s": setup.reclaim_min_run_s,
        "share_goal": SHARE_GOAL,
        "one_gpu_share": 1 / setup.gpus,
        "share_window_s": SHARE_WINDOW_S,
        "sample_every_s": SAMPLE_EVERY_S,
        **share_figures,
        "contended_s": contended_s,
        "gpus_busy_at_burst": busy_at_burst,
        "urgent_start_p99_s": p99(needed),
        "urgent_start_max_s": max(needed, default=math.nan),
        "urgent_start_all_p99_s": p99(list(starts.values())),
        "urgent_needing_preemption": len(needed),
        "urgent_started": len(starts),
        "urgent_start_goal_s": KILL_GRACE_S + START_GOAL_MARGIN_S,
        "urgent_start_idle_p99_s": p99(list(idle.values())),
        "preemptions": sum(t.preemptions for j in final.values() for t in j.tasks),
        "preemptions_for_urgent": tracker.for_urgent,
        "preemptions_reclaiming_quota": tracker.reclaims,
        "victim_stops_seen": sum(len(e) for e in stopped.values()),
        "processes_without_end": sum(1 for r in runs if math.isinf(r.end)),
        "lost_tasks": len(lost),
        "lost_task_names": lost,
        "run_twice": len(twice),
        "run_twice_names": twice,
        "work_lost_gpu_s": sum(lost_s),
        "work_lost_max_per_preemption_s": max(lost_s, default=0.0),
        "work_lost_without_checkpoints_gpu_s": no_checkpoint_s,
        "checkpoint_every_s": CHECKPOINT_EVERY_S,
        "kill_grace_s": KILL_GRACE_S,
        "samples": rows,
    }


def no_nan(value: Any) -> Any:
    """``value`` with NaN (a figure with nothing to measure) as null, for strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: no_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [no_nan(v) for v in value]
    return value


def table(r: dict[str, Any]) -> str:
    def ok(value: float, goal: float) -> str:
        return "-" if math.isnan(value) else "yes" if value <= goal else "NO"

    nan = math.nan
    rows = [
        (
            "share_deviation_max",
            f"{r.get('share_deviation_max', nan):.3f}",
            f"<= {SHARE_GOAL}",
            ok(r.get("share_deviation_max", nan), SHARE_GOAL),
            f"over {r['share_window_s']:g} s; one GPU = {r['one_gpu_share']:.3f}; "
            f"mean {r.get('share_deviation_mean', nan):.3f}; "
            f"{r.get('share_over_goal', nan):.0%} of samples over; "
            f"of the mean shares {r.get('share_deviation_of_mean', nan):.3f}",
        ),
        (
            "  after the fill",
            f"{r.get('share_deviation_steady_max', nan):.3f}",
            "",
            "",
            f"the same from {r['work_s'][1]:g} s on (every job placed at the fill ended)",
        ),
        (
            "  instant",
            f"{r.get('share_deviation_instant_max', nan):.3f}",
            "",
            "",
            f"processes at the sample; mean {r.get('share_deviation_instant_mean', nan):.3f}, "
            f"p95 {r.get('share_deviation_instant_p95', nan):.3f}; "
            f"admitted (ListQueues) {r.get('share_deviation_admitted_max', nan):.3f}",
        ),
        (
            "  turnover gap p50",
            f"{r.get('turnover_gap_p50_s', nan):.2f}",
            "",
            "",
            f"s a freed GPU idles; p95 {r.get('turnover_gap_p95_s', nan):.2f}, "
            f"max {r.get('turnover_gap_max_s', nan):.2f}; "
            f"GPUs idle mean {r.get('gpus_idle_mean', nan):.2f}, "
            f"max {r.get('gpus_idle_max', 0)}; overlaps {r.get('gpu_overlaps', 0)}",
        ),
        (
            "urgent_start_p99_s",
            f"{r['urgent_start_p99_s']:.2f}",
            f"<= {r['urgent_start_goal_s']:g}",
            ok(r["urgent_start_p99_s"], r["urgent_start_goal_s"]),
            f"idle fleet p99 {r['urgent_start_idle_p99_s']:.2f}; "
            f"{r['urgent_needing_preemption']} of {r['urgent_jobs']} found no free GPU; "
            f"whole burst p99 {r['urgent_start_all_p99_s']:.2f}",
        ),
        (
            "preemptions",
            f"{r['preemptions']}",
            "",
            "",
            f"{r['preemptions_for_urgent']} for urgent jobs, "
            f"{r['preemptions_reclaiming_quota']} reclaiming quota; "
            f"{r['victim_stops_seen']} stops seen by tasks",
        ),
        ("lost_tasks", f"{r['lost_tasks']}", "0", ok(r["lost_tasks"], 0), ""),
        ("run_twice", f"{r['run_twice']}", "0", ok(r["run_twice"], 0), ""),
        (
            "work_lost_gpu_s",
            f"{r['work_lost_gpu_s']:.2f}",
            "",
            "",
            f"without checkpoints {r['work_lost_without_checkpoints_gpu_s']:.2f}; "
            f"max per preemption {r['work_lost_max_per_preemption_s']:.2f}",
        ),
    ]
    lines = [f"{'figure':<22} {'measured':>9} {'goal':>7} {'met':>4}  baseline / detail"]
    lines += [f"{a:<22} {b:>9} {c:>7} {d:>4}  {e}" for a, b, c, d, e in rows]
    jobs = "/".join(str(n) for n in r["jobs_per_tenant"].values())
    lines.append(
        f"({r['gpus']} GPUs, weights 1:1:2, {jobs} jobs of {r['work_s'][0]:g}-"
        f"{r['work_s'][1]:g} s; {r.get('share_samples', 0)} samples over "
        f"{r['contended_s']:.1f} s of contention; {r['gpus_busy_at_burst']:g} GPUs busy when "
        f"{r['urgent_jobs']} urgent jobs came; reclaim_min_run_s {r['reclaim_min_run_s']:g})"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=24, help="declared GPUs over the 3 sites")
    parser.add_argument("--seconds", type=float, default=60.0, help="contention to sample")
    parser.add_argument(
        "--work",
        type=float,
        nargs=2,
        default=WORK_S,
        metavar=("MIN", "MAX"),
        help="seconds of work of a tenant's job, drawn uniformly",
    )
    parser.add_argument(
        "--jobs-per-tenant",
        type=int,
        default=None,
        help="jobs of a weight-1 tenant (team-c submits twice as many); default: enough for "
        "every queue to stay busy through the contention and the burst",
    )
    parser.add_argument(
        "--urgent", type=int, default=None, help="urgent jobs in the burst (default: one per GPU)"
    )
    parser.add_argument(
        "--reclaim-min-run-s",
        type=float,
        default=RECLAIM_MIN_RUN_S,
        help="the coordinator's reclaim_min_run_s",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--workdir",
        type=Path,
        help="a new folder to keep the federation's logs and the tasks' markers in "
        "(default: a temporary one, removed at the end)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    low, high = args.work
    if args.gpus < 6 or args.seconds <= 0 or not 0 < low <= high:
        parser.error("--gpus must be >= 6, --seconds > 0 and 0 < --work MIN <= MAX")
    urgent = args.urgent or args.gpus
    if urgent < 1 or args.reclaim_min_run_s < 0:
        parser.error("--urgent must be >= 1 and --reclaim-min-run-s >= 0")
    weights = sum(TENANTS.values())
    if args.jobs_per_tenant:
        jobs = {t: math.ceil(args.jobs_per_tenant * w) for t, w in TENANTS.items()}
    else:
        # Each queue's GPUs, busy from the fill through the contention and the tail.
        generations = 1 + (args.seconds + TAIL_S) / ((low + high) / 2)
        jobs = {t: math.ceil(args.gpus * w / weights * generations) for t, w in TENANTS.items()}
    setup = Setup(
        gpus=args.gpus,
        seconds=args.seconds,
        work_s=(low, high),
        jobs=jobs,
        urgent=urgent,
        reclaim_min_run_s=args.reclaim_min_run_s,
        seed=args.seed,
    )
    console = Console(stderr=True)
    phases = Phases(console.is_terminal, console)
    with phases.running():
        results = asyncio.run(measure(setup, phases, args.workdir))
    if args.json:
        json.dump(no_nan(results), sys.stdout, indent=2)
        print()
        return
    print(table(results))


if __name__ == "__main__":
    main()
