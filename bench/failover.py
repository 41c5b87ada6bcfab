"""How fast an HA federation recovers: leader failover, lost-site detection, a task moved.

Real processes on loopback: an etcd, three coordinators sharing it, and three agents, one of
which (edge-p) reaches the leader through a pausable TCP proxy. Each repetition measures:

- lost-site detection: proxy paused (a silent cut) until the leader lists edge-p UNREACHABLE;
- running elsewhere: the same cut until edge-p's task (lost_after_s short) RUNS at another site;
- failover: SIGKILL of the leader until a follower's JobService health turns SERVING (the
  killed coordinator is then started again, and its start-up to ready is timed too).

Baselines from the same run: the configured floors (the leader lease; missed heartbeats x the
interval; that plus lost_after_s) and a coordinator process's start-up until ready.

    python bench/failover.py [--repeat 3] [--lease-s 3] [--heartbeat-s 0.5] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from federation.api.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    job_service_pb2,
    job_service_pb2_grpc,
    jobs_pb2,
)
from federation.jobspec import job_spec_from_dict
from federation.local import LocalFederation
from federation.testing.cluster import (
    cpu_site,
    etcd_coordinator_args,
    first_serving,
    health_watches,
    site_state,
    start_with_proxied_site,
    submit,
    until,
)
from federation.testing.etcd import LocalEtcd, etcd_binary
from federation.testing.proxy import PausableProxy, proxy_to

COORDINATORS = ("coord-a", "coord-b", "coord-c")
PROXIED = "edge-p"
MISSED = 3


def summary(values: list[float]) -> dict[str, float]:
    return {"p50_s": statistics.median(values), "max_s": max(values)}


class Bench:
    def __init__(self, fed: LocalFederation, proxy: PausableProxy, lost_after_s: float) -> None:
        self.fed, self.proxy, self.lost_after_s = fed, proxy, lost_after_s
        self.leader = ""
        self.starts: list[float] = []

    async def start_coordinator(self, name: str, port: int = 0, join_port: int = 0) -> None:
        started = time.monotonic()
        await self.fed.start_coordinator(name=name, port=port, join_port=join_port)
        self.starts.append(time.monotonic() - started)

    async def start(self) -> None:
        self.leader = await start_with_proxied_site(
            self.fed, self.proxy, COORDINATORS, PROXIED, self.start_coordinator
        )

    async def cut(self, round_: int) -> tuple[float, float]:
        """A task runs at edge-p; pause its proxy; the seconds until UNREACHABLE and until moved."""
        job_id = f"held-{round_}"
        spec = job_spec_from_dict(
            {
                "name": job_id,
                "id": job_id,
                "tasks": [
                    {
                        "name": "t",
                        "command": [sys.executable, "-c", "import time; time.sleep(600)"],
                        "resources": {"cpu": 1, "memory_mib": 64},
                    }
                ],
                "disconnect": {"lost_after_s": self.lost_after_s},
            }
        )
        others = [s.name for s in self.fed.sites if s.name != PROXIED]
        conn = self.fed.operator().at(self.fed.address_of(self.leader))
        async with conn.channel() as channel:
            admin = admin_service_pb2_grpc.AdminServiceStub(channel)
            jobs = job_service_pb2_grpc.JobServiceStub(channel)
            for name in others:  # only edge-p may take it
                await admin.CordonSite(admin_service_pb2.CordonSiteRequest(site=name))
            await submit(self.fed, spec)

            async def task_at(at_p: bool) -> bool:
                reply = await jobs.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
                task = reply.job.tasks[0]
                return (task.site == PROXIED) is at_p and task.state == jobs_pb2.JOB_STATE_RUNNING

            await until(lambda: task_at(True), 30, "the task to run at edge-p")
            for name in others:
                await admin.UncordonSite(admin_service_pb2.UncordonSiteRequest(site=name))
            self.proxy.pause()
            cut_at = time.monotonic()

            async def unreachable() -> bool:
                site = await site_state(channel, PROXIED)
                return site.state == admin_service_pb2.SITE_STATE_UNREACHABLE

            detected_at = await until(unreachable, 30, "edge-p to become UNREACHABLE")
            moved_at = await until(lambda: task_at(False), 60, "the task to run elsewhere")
            self.proxy.heal()
            await self.fed.wait_connected([PROXIED])
            await jobs.CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id, reason="bench"))
        return detected_at - cut_at, moved_at - cut_at

    async def failover(self, lease_s: float) -> float:
        """SIGKILL the leader; the seconds until a follower serves; start the killed one again."""
        killed = self.leader
        followers = [name for name in COORDINATORS if name != killed]
        async with health_watches(self.fed, followers) as streams:
            killed_at = time.monotonic()
            self.fed.kill(killed)
            self.leader = await asyncio.wait_for(first_serving(streams), lease_s + 30)
            failover_s = time.monotonic() - killed_at
        self.proxy.target_port = self.fed.coordinators[self.leader][0]
        await self.start_coordinator(killed, *self.fed.coordinators[killed])  # same ports
        await self.fed.wait_connected()
        return failover_s


async def measure(
    repeat: int, lease_s: float, heartbeat_s: float, lost_after_s: float
) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="bench-failover-") as root:
        etcd_dir = Path(root) / "etcd"
        etcd_dir.mkdir()
        etcd = LocalEtcd.start(etcd_dir)
        fed = LocalFederation(
            Path(root) / "fed",
            [cpu_site("edge-x"), cpu_site("edge-y")],
            coordinator_args=[
                *etcd_coordinator_args(etcd.endpoint, "/bench", lease_s),
                "--heartbeat-interval-s",
                str(heartbeat_s),
                "--missed-heartbeats",
                str(MISSED),
            ],
        )
        try:
            async with proxy_to(0) as proxy:
                bench = Bench(fed, proxy, lost_after_s)
                await bench.start()
                detected, moved, failovers = [], [], []
                for round_ in range(repeat):
                    detection_s, moved_s = await bench.cut(round_)
                    detected.append(detection_s)
                    moved.append(moved_s)
                    failovers.append(await bench.failover(lease_s))
        finally:
            fed.stop()
            etcd.stop()
    detection_floor = MISSED * heartbeat_s
    return {
        "repeat": repeat,
        "failover": {**summary(failovers), "floor_s": lease_s},
        "lost_site_detection": {**summary(detected), "floor_s": detection_floor},
        "running_elsewhere": {**summary(moved), "floor_s": detection_floor + lost_after_s},
        "coordinator_start": summary(bench.starts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--lease-s", type=float, default=3.0)
    parser.add_argument("--heartbeat-s", type=float, default=0.5)
    parser.add_argument("--lost-after-s", type=float, default=2.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if etcd_binary() is None:
        parser.error("etcd is not installed (apt-get install -y etcd-server)")
    results = asyncio.run(measure(args.repeat, args.lease_s, args.heartbeat_s, args.lost_after_s))
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
        return
    print(f"{'measure':<22} {'p50 s':>7} {'max s':>7} {'floor s':>8} {'p50 / floor':>12}")
    for key in ("failover", "lost_site_detection", "running_elsewhere", "coordinator_start"):
        row = results[key]
        assert isinstance(row, dict)
        floor = row.get("floor_s")
        ratio = f"{row['p50_s'] / floor:>12.2f}" if floor else f"{'':>12}"
        shown = f"{floor:>8.2f}" if floor else "baseline"
        print(f"{key:<22} {row['p50_s']:>7.2f} {row['max_s']:>7.2f} {shown} {ratio}")
    print(f"({results['repeat']} repetitions; coordinator_start: process start until ready)")


if __name__ == "__main__":
    main()
