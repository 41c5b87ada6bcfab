"""Fair share under contention, and urgent work that preempts it, over real agents.

A real coordinator and three sites (8 declared GPUs in all) as processes over mTLS on
loopback. Three tenants own queues of weights 1:1:2 (nominal GPU quotas 2, 2 and 4, each may
borrow 2 more) and each submits more one-GPU jobs than fit: real processes that work 5-9 s,
writing a checkpoint each second of work (the agent reports them), and that restart from the
newest reported checkpoint after a preemption. Once every GPU runs a tenant's job, and while
every queue has jobs waiting, the queues' dominant shares are sampled every 0.5 s
(ListQueues). Then a burst of urgent jobs (a priority class that may preempt; no queue)
arrives on the full fleet; the agents give victims ``kill_grace_s`` = 2 s after SIGTERM. At
the end every job must have finished, once. Baselines from the same run: the same burst of
urgent jobs on the idle fleet (a start without preemption), the work victims would have lost
without checkpoints, one GPU's share of the fleet.

    python bench/fairness.py [--seconds 30] [--jobs-per-tenant N] [--urgent 8] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
SAMPLE_EVERY_S = 0.5
CHECKPOINT_EVERY_S = 1.0
"""Seconds of work between a task's checkpoints; the agent looks for new ones as often."""
WORK_S = (5.0, 9.0)
"""A tenant job's work, drawn uniformly (seeded) so the jobs do not end in lockstep."""
URGENT_WORK_S = 3.0
DRAIN_MARGIN_S = 60.0

TENANTS = {"team-a": 1.0, "team-b": 1.0, "team-c": 2.0}
"""Tenant (and its queue's name) -> weight."""
BORROW = 2.0


def gpu_node(name: str, gpus: int, model: str) -> dict[str, Any]:
    device = {"kind": "GPU", "vendor": "nvidia", "model": model, "memory_mib": 81920}
    return {
        "name": name,
        "cpu_cores": 32,
        "memory_mib": 262144,
        "devices": [{**device, "count": gpus}],
    }


SETTINGS = {"kill_grace_s": KILL_GRACE_S}
SITES = [
    SiteSpec("dc-1", "datacenter", [gpu_node("dgx", 4, "A100-80GB")], settings=SETTINGS),
    SiteSpec("dc-2", "datacenter", [gpu_node("hgx", 2, "A100-80GB")], settings=SETTINGS),
    SiteSpec("cloud-1", "cloud", [gpu_node("p5", 2, "H100-80GB")], settings=SETTINGS),
]
GPUS = sum(d["count"] for s in SITES for n in s.nodes for d in n["devices"])

COORDINATOR_CONFIG = """\
preemption_min_run_s = 0.0
[priority_classes.urgent]
value = 900
may_preempt = true
preemptible = false
[priority_classes.batch]
value = -100
"""

# Works ``work`` seconds in all, counting from the progress its restore point holds; writes
# a checkpoint (its progress) each ``every`` seconds of work when the task declares a policy.
# Markers in the folder argv[1], NAME-EPOCH: start- (restored progress), stopped- (progress
# when SIGTERM came), done- (progress at the end).
TASK = """
import os, signal, sys, time
markers, name, work, every = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
tag = name + "-" + os.environ["FEDERATION_EPOCH"]
t0 = time.time()
restore = os.environ.get("FEDERATION_RESTORE_FROM", "")
base = float(open(restore).read()) if restore else 0.0
def progress():
    return base + time.time() - t0
def mark(kind, value):
    with open(os.path.join(markers, kind + "-" + tag), "w") as f:
        f.write(repr(value))
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


def p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else math.nan


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
            self.reclaims += "takes back its nominal quota" in event.reason
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


async def queues_now(admin: admin_service_pb2_grpc.AdminServiceAsyncStub) -> dict[str, Any]:
    reply = await admin.ListQueues(admin_service_pb2.ListQueuesRequest())
    return {q.queue.name: q for q in reply.queues if q.queue.name in TENANTS}


async def urgent_burst(
    stub: job_service_pb2_grpc.JobServiceAsyncStub,
    tracker: Tracker,
    names: list[str],
    markers: Path,
    work_s: float,
    phases: Phases,
) -> dict[str, float]:
    """Submit the urgent jobs at once; seconds from submit to RUNNING for each, by job id."""
    specs = [job(name, markers, work_s, urgent=True) for name in names]
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


async def measure(
    seconds: float,
    jobs_per_tenant: int,
    urgent: int,
    seed: int,
    phases: Phases,
    workdir: Path | None = None,
) -> dict[str, Any]:
    rng = random.Random(seed)
    weight_sum = sum(TENANTS.values())
    target = {name: w / weight_sum for name, w in TENANTS.items()}
    with contextlib.ExitStack() as stack:
        if workdir is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-fairness-")))
        else:
            root = workdir
            root.mkdir(parents=True)
        markers = root / "markers"
        markers.mkdir()
        config = root / "coordinator.toml"
        config.write_text(COORDINATOR_CONFIG)
        fed = LocalFederation(root / "fed", SITES, coordinator_args=["--config", str(config)])
        tracker = Tracker()
        follower: asyncio.Task[None] | None = None
        channels: list[grpc.aio.Channel] = []
        try:
            phases.start("starting coordinator and 3 sites", None)
            await fed.start()
            operator = fed.operator().channel()
            channels.append(operator)
            admin = admin_service_pb2_grpc.AdminServiceStub(operator)
            ops = job_service_pb2_grpc.JobServiceStub(operator)
            for name, weight in TENANTS.items():
                nominal = GPUS * target[name]
                quota = queues_pb2.Quota(resource="gpu", nominal=nominal, borrowing_limit=BORROW)
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
            idle_n = min(urgent, GPUS)
            phases.start("urgent burst on the idle fleet", idle_n)
            idle_names = [f"idle-{i:02d}" for i in range(idle_n)]
            idle = await urgent_burst(ops, tracker, idle_names, markers, 0.5, phases)

            # Contention: every tenant submits more than fits, all at once.
            submits = []
            for name in TENANTS:
                channel = tenant_channel(fed, name)
                channels.append(channel)
                specs = [
                    job(f"{name}-{i:03d}", markers, rng.uniform(*WORK_S), queue=name)
                    for i in range(jobs_per_tenant)
                ]
                stub = job_service_pb2_grpc.JobServiceStub(channel)
                submits.append(stub.SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=specs)))
            replies = await asyncio.gather(*submits)
            owner = {j.id: j.spec.queue for reply in replies for j in reply.jobs}
            # Steady: every GPU runs a tenant's job (offers in flight count in a queue's
            # usage, and the first ones may ask more than the sites have).
            phases.start("filling the fleet", GPUS)
            deadline = time.perf_counter() + 60.0
            while (busy := tracker.running(set(owner))) < GPUS:
                phases.update(busy)
                if time.perf_counter() > deadline:
                    break
                await asyncio.sleep(0.1)

            phases.start(f"contention, sampling every {SAMPLE_EVERY_S} s", seconds)
            by_tenant = {name: {i for i, o in owner.items() if o == name} for name in TENANTS}
            samples: list[dict[str, Any]] = []
            start = time.perf_counter()
            while (elapsed := time.perf_counter() - start) < seconds:
                held = await queues_now(admin)
                if any(q.waiting_jobs == 0 for q in held.values()):
                    break  # a queue ran dry: no longer contended
                samples.append(
                    {
                        "t": round(elapsed, 2),
                        "held": {n: q.usage.get("gpu", 0.0) for n, q in held.items()},
                        "share": {n: q.dominant_share * TENANTS[n] for n, q in held.items()},
                        "running": {n: tracker.running(by_tenant[n]) for n in TENANTS},
                    }
                )
                phases.update(elapsed)
                await asyncio.sleep(
                    max(0.0, start + len(samples) * SAMPLE_EVERY_S - time.perf_counter())
                )
            contended_s = time.perf_counter() - start
            held = await queues_now(admin)
            busy_at_burst = sum(q.usage.get("gpu", 0.0) for q in held.values())

            phases.start("urgent burst on the full fleet", urgent)
            urgent_names = [f"urgent-{i:02d}" for i in range(urgent)]
            starts = await urgent_burst(ops, tracker, urgent_names, markers, URGENT_WORK_S, phases)

            everything = set(owner) | set(idle) | set(starts)
            total = len(owner) + idle_n + urgent
            work_left = sum(WORK_S) / 2 * len(owner) / GPUS
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
            markers=markers,
            final=final,
            names={j.id: j.spec.name for j in final.values()},
            tracker=tracker,
            idle=idle,
            starts=starts,
            samples=samples,
            contended_s=contended_s,
            busy_at_burst=busy_at_burst,
            jobs_per_tenant=jobs_per_tenant,
            urgent=urgent,
        )


def read_markers(folder: Path) -> dict[str, dict[str, dict[int, float]]]:
    """kind -> job name -> epoch -> the progress the marker holds."""
    out: dict[str, dict[str, dict[int, float]]] = {}
    for path in folder.iterdir():
        kind, rest = path.name.split("-", 1)
        name, epoch = rest.rsplit("-", 1)
        out.setdefault(kind, {}).setdefault(name, {})[int(epoch)] = float(path.read_text())
    return out


def report(
    *,
    markers: Path,
    final: dict[str, jobs_pb2.Job],
    names: dict[str, str],
    tracker: Tracker,
    idle: dict[str, float],
    starts: dict[str, float],
    samples: list[dict[str, Any]],
    contended_s: float,
    busy_at_burst: float,
    jobs_per_tenant: int,
    urgent: int,
) -> dict[str, Any]:
    marks = read_markers(markers)
    target = {name: w / sum(TENANTS.values()) for name, w in TENANTS.items()}
    deviation = [max(abs(s["share"][n] - target[n]) for n in TENANTS) for s in samples]
    mean_share = {n: sum(s["share"][n] for s in samples) / max(1, len(samples)) for n in TENANTS}
    deviation_running = [
        max(abs(s["running"][n] / GPUS - target[n]) for n in TENANTS) for s in samples
    ]
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
            restored = started[name][min(later)] if later else 0.0
            lost_s.append(max(0.0, at_stop - restored))
            no_checkpoint_s += at_stop
    # An urgent job that found no free room can start only once some task stops: the
    # coordinator preempts for it (or a task ends by itself first).
    needed = [s for i, s in starts.items() if i in tracker.found_no_room]
    return {
        "gpus": GPUS,
        "tenants": dict(TENANTS),
        "jobs_per_tenant": jobs_per_tenant,
        "urgent_jobs": urgent,
        "share_deviation_max": max(deviation, default=math.nan),
        "share_deviation_mean": float(np.mean(deviation)) if deviation else math.nan,
        "share_deviation_running_max": max(deviation_running, default=math.nan),
        "share_deviation_of_mean": max(abs(mean_share[n] - target[n]) for n in TENANTS)
        if samples
        else math.nan,
        "mean_share": mean_share,
        "share_goal": SHARE_GOAL,
        "one_gpu_share": 1 / GPUS,
        "share_samples": len(deviation),
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
        "lost_tasks": len(lost),
        "lost_task_names": lost,
        "run_twice": len(twice),
        "run_twice_names": twice,
        "work_lost_gpu_s": sum(lost_s),
        "work_lost_max_per_preemption_s": max(lost_s, default=0.0),
        "work_lost_without_checkpoints_gpu_s": no_checkpoint_s,
        "checkpoint_every_s": CHECKPOINT_EVERY_S,
        "kill_grace_s": KILL_GRACE_S,
        "samples": samples,
    }


def no_nan(value: Any) -> Any:
    """``value`` with NaN (a figure with nothing to measure) as null, for strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [no_nan(v) for v in value]
    return value


def table(r: dict[str, Any]) -> str:
    def ok(value: float, goal: float) -> str:
        return "-" if math.isnan(value) else "yes" if value <= goal else "NO"

    rows = [
        (
            "share_deviation_max",
            f"{r['share_deviation_max']:.3f}",
            f"<= {SHARE_GOAL}",
            ok(r["share_deviation_max"], SHARE_GOAL),
            f"one GPU = {r['one_gpu_share']:.3f}; mean {r['share_deviation_mean']:.3f}; "
            f"of the mean shares {r['share_deviation_of_mean']:.3f}; "
            f"by running jobs {r['share_deviation_running_max']:.3f}",
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
    lines.append(
        f"({r['gpus']} GPUs, weights 1:1:2, {r['jobs_per_tenant']} jobs per tenant; "
        f"{r['share_samples']} share samples over {r['contended_s']:.1f} s of contention; "
        f"{r['gpus_busy_at_burst']:g} GPUs busy when {r['urgent_jobs']} urgent jobs came)"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="contention to sample")
    parser.add_argument(
        "--jobs-per-tenant",
        type=int,
        default=None,
        help="default: enough for the heaviest queue to stay busy through the contention "
        "and the burst",
    )
    parser.add_argument(
        "--urgent", type=int, default=GPUS, help="urgent jobs in the burst (default: one per GPU)"
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
    if args.seconds <= 0 or args.urgent < 1:
        parser.error("--seconds must be > 0 and --urgent >= 1")
    heaviest = GPUS * max(TENANTS.values()) / sum(TENANTS.values())
    jobs = args.jobs_per_tenant or math.ceil(heaviest * (args.seconds + 15) / (sum(WORK_S) / 2))
    console = Console(stderr=True)
    phases = Phases(console.is_terminal, console)
    with phases.running():
        results = asyncio.run(
            measure(args.seconds, jobs, args.urgent, args.seed, phases, args.workdir)
        )
    if args.json:
        json.dump(no_nan(results), sys.stdout, indent=2)
        print()
        return
    print(table(results))


if __name__ == "__main__":
    main()
