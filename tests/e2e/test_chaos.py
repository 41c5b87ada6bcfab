"""Chaos on a real HA federation: leader SIGKILL, agent SIGKILL and a partition in one run.

An etcd, three coordinators and three agents, one of them (edge-p) reaching the leader through
a pausable proxy (``federation.testing.proxy``) that the test points at whichever coordinator
leads. While a stream of jobs arrives the leader is SIGKILLed, then one agent is SIGKILLed and
restarted; afterwards edge-p is cut off longer than its job's ``lost_after_s`` and healed. Every
accepted job must finish, each with exactly one completed run, and the copy left behind at
edge-p must be fenced.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2
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

from .conftest import admin, jobs, python_task, spec, wait_for_job

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.skipif(
        etcd_binary() is None, reason="etcd is not installed (apt-get install -y etcd-server)"
    ),
]

LEASE_S = 3.0
HEARTBEAT_S = 0.5
MISSED = 3
COORDINATORS = ("coord-a", "coord-b", "coord-c")
JOBS = 30
KILL_LEADER_AFTER = 8  # jobs accepted before the leader is SIGKILLed
KILL_AGENT_AFTER = 18  # jobs accepted before edge-y is SIGKILLed
STREAM_LOST_AFTER_S = 15.0  # longer than an agent's reconnect after failover, with backoff
HELD_LOST_AFTER_S = 2.0
PROXIED = "edge-p"
RUNS = int(os.environ.get("FEDERATION_CHAOS_RUNS", "1"))
"""How many times the chaos test runs (``make test`` runs it 20 times, two at a time)."""
KILLED_AGENT = "edge-y"

# Writes a start marker; runs its time (a held task: until the file "go"), checkpointing each
# step when it has a folder; appends its SITE-EPOCH to the job's marker file when done.
TASK = """
import os, signal, sys, time
markers, seconds = sys.argv[1], float(sys.argv[2])
job = os.environ["FEDERATION_JOB_ID"]
tag = os.environ["FEDERATION_SITE"] + "-" + os.environ["FEDERATION_EPOCH"]
def stop(*_):
    open(os.path.join(markers, "stopped-" + job + "-" + tag), "w").close()
    sys.exit(143)
signal.signal(signal.SIGTERM, stop)
open(os.path.join(markers, "start-" + job + "-" + tag), "w").close()
folder = os.environ.get("FEDERATION_CHECKPOINT_DIR", "")
restore = os.environ.get("FEDERATION_RESTORE_FROM", "")
step = int(open(restore).read()) if restore else 0
end = time.monotonic() + seconds
go = os.path.join(markers, "go")
def more():
    return not os.path.exists(go) if seconds < 0 else time.monotonic() < end
while more():
    step += 1
    if folder:
        name = os.path.join(folder, "step-%04d" % step)
        open(name, "w").write(str(step))
        open(name + ".done", "w").close()
    time.sleep(0.2)
open(os.path.join(markers, job), "a").write(tag + "\\n")
"""


def job_spec(
    job_id: str, markers: Path, seconds: float, lost_after_s: float, checkpoint: bool
) -> jobs_pb2.JobSpec:
    """One task that runs ``seconds`` (negative: until the file "go") and marks its end."""
    extra: dict[str, object] = {"checkpoint": {"interval_s": 0.2}} if checkpoint else {}
    task = python_task("t", TASK, resources={"cpu": 1, "memory_mib": 64}, **extra)
    task["command"] = [*task["command"], str(markers), str(seconds)]  # type: ignore[misc]
    policy = {"lost_after_s": lost_after_s, "reconcile": "keep_replacement"}
    return spec(job_id, [task], id=job_id, disconnect=policy)


@pytest.fixture
def fed(tmp_path: Path, etcd: LocalEtcd) -> Iterator[LocalFederation]:
    """Three sites and coordinators that share ``etcd`` and notice a lost site in 1.5 s."""
    federation = LocalFederation(
        tmp_path / "fed",
        [cpu_site("edge-x"), cpu_site(KILLED_AGENT)],
        coordinator_args=[
            *etcd_coordinator_args(etcd.endpoint, "/chaos", LEASE_S),
            "--heartbeat-interval-s",
            str(HEARTBEAT_S),
            "--missed-heartbeats",
            str(MISSED),
        ],
    )
    try:
        yield federation
    finally:
        federation.stop()


def completed_runs(markers: Path, job_id: str) -> list[str]:
    """SITE-EPOCH of every run of the job that reached its end."""
    path = markers / job_id
    return path.read_text().split() if path.exists() else []


def coordinator_events(fed: LocalFederation, event: str) -> list[dict[str, object]]:
    """Every JSON log line named ``event`` in any coordinator's log."""
    found = []
    for name in COORDINATORS:
        for line in fed.log_path(name).read_text(errors="replace").splitlines():
            if event in line and line.startswith("{"):
                record = json.loads(line)
                if record.get("event") == event:
                    found.append(record)
    return found


class Chaos:
    """The federation under test, its proxied site, and the jobs it accepted."""

    def __init__(self, fed: LocalFederation, proxy: PausableProxy, markers: Path) -> None:
        self.fed, self.proxy, self.markers = fed, proxy, markers
        self.accepted: list[str] = []
        self.leader = ""

    def channel(self) -> grpc.aio.Channel:
        return self.fed.operator().at(self.fed.address_of(self.leader)).channel()

    async def start(self) -> None:
        self.leader = await start_with_proxied_site(self.fed, self.proxy, COORDINATORS, PROXIED)

    async def stream_through_failures(self) -> float:
        """Submit the stream; SIGKILL the leader, then an agent (restarted) along the way.

        Returns:
            Seconds from the leader's SIGKILL until a follower served.
        """
        specs = [
            job_spec(f"chaos-{i}", self.markers, 1.0, STREAM_LOST_AFTER_S, checkpoint=i % 3 == 0)
            for i in range(JOBS)
        ]
        leader_gone, agent_gone = asyncio.Event(), asyncio.Event()
        failed_over = asyncio.Event()

        async def stream() -> None:
            for job in specs:
                self.accepted.append(await submit(self.fed, job))
                if len(self.accepted) == KILL_LEADER_AFTER:
                    leader_gone.set()
                    await failed_over.wait()
                if len(self.accepted) == KILL_AGENT_AFTER:
                    agent_gone.set()
                await asyncio.sleep(0.1)  # a steady stream, spread over the failures

        followers = [name for name in COORDINATORS if name != self.leader]
        async with health_watches(self.fed, followers) as streams:
            submitter = asyncio.create_task(stream())
            await asyncio.wait_for(leader_gone.wait(), 30)
            killed_at = time.monotonic()
            self.fed.kill(self.leader)
            successor = await asyncio.wait_for(first_serving(streams), LEASE_S + 10)
            failover_s = time.monotonic() - killed_at
        self.leader = successor
        self.proxy.target_port = self.fed.coordinators[successor][0]
        failed_over.set()
        await asyncio.wait_for(agent_gone.wait(), 30)
        self.fed.kill(KILLED_AGENT)
        await self.fed.start_site(cpu_site(KILLED_AGENT))
        await asyncio.wait_for(submitter, 60)
        assert self.accepted == [job.id for job in specs]
        await self.fed.wait_connected()
        return failover_s

    async def partition(self) -> str:
        """A held job runs at edge-p; cut edge-p off past lost_after, wait for the move, heal.

        Returns:
            The held job's id.
        """
        held = job_spec("held", self.markers, -1.0, HELD_LOST_AFTER_S, checkpoint=True)
        others = [s.name for s in self.fed.sites if s.name != PROXIED]
        async with self.channel() as channel:
            for name in others:  # only edge-p may take the held job
                await admin(channel).CordonSite(admin_service_pb2.CordonSiteRequest(site=name))
            self.accepted.append(await submit(self.fed, held))

            async def checkpointed_at_p() -> bool:
                reply = await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id="held"))
                task = reply.job.tasks[0]
                return task.site == PROXIED and task.checkpoint.path != ""

            await until(checkpointed_at_p, 30, "a checkpoint of the held job at edge-p")
            for name in others:
                await admin(channel).UncordonSite(admin_service_pb2.UncordonSiteRequest(site=name))
            self.proxy.pause()
            cut_at = time.monotonic()

            async def unreachable() -> bool:
                site = await site_state(channel, PROXIED)
                return site.state == admin_service_pb2.SITE_STATE_UNREACHABLE

            detected_at = await until(unreachable, 15, "edge-p to become UNREACHABLE")

            async def running_elsewhere() -> bool:
                reply = await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id="held"))
                task = reply.job.tasks[0]
                return task.site != PROXIED and task.state == jobs_pb2.JOB_STATE_RUNNING

            moved_at = await until(running_elsewhere, 30, "the held job to run elsewhere")
            print(
                f"lost-site detection {detected_at - cut_at:.2f}s, "
                f"running elsewhere {moved_at - cut_at:.2f}s after the cut"
            )
            self.proxy.heal()
            await self.fed.wait_connected([PROXIED])

            async def stale_copy_stopped() -> bool:
                return (self.markers / f"stopped-held-{PROXIED}-1").exists()

            await until(stale_copy_stopped, 30, "the stale copy at edge-p to be stopped")
        (self.markers / "go").touch()
        return "held"


@pytest.mark.slow
@pytest.mark.parametrize("run", range(RUNS))
async def test_leader_agent_and_partition_chaos_loses_no_job(
    fed: LocalFederation, tmp_path: Path, run: int
) -> None:
    """Through a leader SIGKILL, an agent SIGKILL and a partition, every accepted job finishes
    with exactly one completed run and the copy left behind at the cut-off site is fenced."""
    markers = tmp_path / "markers"
    markers.mkdir()
    async with proxy_to(0) as proxy:
        chaos = Chaos(fed, proxy, markers)
        await chaos.start()
        failover_s = await chaos.stream_through_failures()
        print(f"\nleader failover {failover_s:.2f}s (lease {LEASE_S}s)")
        assert failover_s <= LEASE_S + 3.0, f"failover took {failover_s:.2f} s"
        held = await chaos.partition()
        async with chaos.channel() as channel:
            finals = {job_id: await wait_for_job(channel, job_id) for job_id in chaos.accepted}
            listed = await jobs(channel).ListJobs(job_service_pb2.ListJobsRequest(page_size=100))
            held_reply = await jobs(channel).GetJob(
                job_service_pb2.GetJobRequest(job_id=held, include_events=True)
            )
    assert sorted(j.id for j in listed.jobs) == sorted(chaos.accepted)
    for job_id, job in finals.items():
        assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, (job_id, job.reason)
        task = job.tasks[0]
        assert completed_runs(markers, job_id) == [f"{task.site}-{task.epoch}"], job_id
    moves = [e for e in held_reply.events if e.moved_from == PROXIED]
    assert len(moves) == 1, held_reply.events
    final = held_reply.job.tasks[0]
    assert final.site != PROXIED
    assert (final.displaced.site, final.displaced.epoch) == (PROXIED, 1)
    after_move = [e for e in held_reply.events if e.sequence > moves[0].sequence]
    assert all(e.site != PROXIED for e in after_move), after_move
    fenced = coordinator_events(fed, "stale_task_report_fenced")
    print(f"stale reports fenced: {[(r.get('site'), r.get('job')) for r in fenced]}")
    assert any(r.get("site") == PROXIED and r.get("job") == held for r in fenced), fenced
