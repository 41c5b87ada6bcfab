"""A leader failover in the middle of a preemption loses nothing, on SQLite and on etcd.

Three GPU sites each run a low-priority victim that checkpoints, and an urgent job is pinned to
each. The leader marks the three victims (``preempted_by``, visible through GetJob) and sends
their stops; it is SIGKILLed while no victim's end has been reported:

- gpu-a: the stop arrived; its victim traps SIGTERM and holds in its grace until the leader
  is dead, then ends: its final report waits in the agent for the next leader's hello.
- gpu-b: the stop never arrived: gpu-b talks to the coordinators through a proxy, paused just
  before the urgent jobs came and cut (held bytes and all) after the kill. Only the stop sent
  again at its hello stops the victim, which ends at once.
- gpu-c: the stop arrived and its victim is still in its grace when gpu-c is back with the next
  leader; it is let go only once gpu-b's urgent job has started too.

gpu-b and gpu-c have two GPUs, the second held by a bystander of a priority between the two:
the next leader must see that the stopping victim makes the room and stop nothing more.

On etcd a second coordinator of the HA group takes over. The embedded SQLite store serves one
coordinator only (it is always the leader), so there the coordinator restarts on the same
store instead. Afterwards every urgent job runs, each victim restarts from the checkpoint its
preemption names and finishes once, no task (and no GPU) is ever held by two runs at once, the
bystanders run undisturbed, and every job succeeds.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2
from federation.local import LocalFederation
from federation.testing.cluster import etcd_coordinator_args, leader_name, site_state
from federation.testing.proxy import proxy_to

from .conftest import etcd_prefix, gpu_site, jobs, spec, until, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-preemption-failover")

LEASE_S = 2.0
GRACE_S = 60.0  # the agents' kill_grace_s: never reached, the victims end sooner
HOLD_S = 30.0  # how long a stopped task waits for its site's release file at most
SUCCEEDED = jobs_pb2.JOB_STATE_SUCCEEDED
RUNNING = jobs_pb2.JOB_STATE_RUNNING
SITES = {"gpu-a": 1, "gpu-b": 2, "gpu-c": 2}  # GPUs of each
PROXIED = "gpu-b"
VICTIMS = {site: f"low-{site}" for site in SITES}
URGENT = {site: f"urgent-{site}" for site in SITES}
BYSTANDERS = {site: f"mid-{site}" for site, gpus in SITES.items() if gpus > 1}

# Appends "WHAT EPOCH TIME [DETAIL]" lines to the file named after its job: start (with the
# checkpoint it restored from, or -), term (SIGTERM came), exit (left in its grace, after a
# last checkpoint, once the file release-SITE exists), done (finished: the file "go" exists).
# Checkpoints a step every 0.2 s; a restart reads its step back from the checkpoint.
TASK = """
import os, signal, sys, time
markers, hold_s = sys.argv[1], float(sys.argv[2])
log = os.path.join(markers, os.environ["FEDERATION_JOB_ID"])
release = os.path.join(markers, "release-" + os.environ["FEDERATION_SITE"])
epoch = os.environ["FEDERATION_EPOCH"]
def note(what, detail=""):
    with open(log, "a") as f:
        f.write("%s %s %r %s\\n" % (what, epoch, time.time(), detail))
stopping = []
def stop(*_):
    if not stopping:
        note("term")
    stopping.append(1)
signal.signal(signal.SIGTERM, stop)
folder = os.environ["FEDERATION_CHECKPOINT_DIR"]
def checkpoint(step):
    name = os.path.join(folder, "step-%04d" % step)
    with open(name, "w") as f:
        f.write(str(step))
    open(name + ".done", "w").close()
restore = os.environ.get("FEDERATION_RESTORE_FROM", "")
step = int(open(restore).read()) if restore else 0
note("start", restore or "-")
while not os.path.exists(os.path.join(markers, "go")):
    if stopping:
        end = time.monotonic() + hold_s
        while not os.path.exists(release) and time.monotonic() < end:
            time.sleep(0.05)
        checkpoint(step)
        note("exit", step)
        sys.exit(143)
    step += 1
    checkpoint(step)
    time.sleep(0.2)
note("done", step)
"""

# The urgent task: a start and a done line, a moment's work between them.
URGENT_TASK = """
import os, sys, time
log = os.path.join(sys.argv[1], os.environ["FEDERATION_JOB_ID"])
epoch = os.environ["FEDERATION_EPOCH"]
open(log, "a").write("start %s %r -\\n" % (epoch, time.time()))
time.sleep(0.5)
open(log, "a").write("done %s %r 0\\n" % (epoch, time.time()))
"""

CONFIG = (
    "preemption_min_run_s = 0.0\n"
    "[priority_classes.urgent]\nvalue = 900\nmay_preempt = true\npreemptible = false\n"
    "[priority_classes.batch]\nvalue = -100\n"
)


@pytest.fixture(params=["sqlite", "etcd"])
def fed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalFederation]:
    """A federation (not started yet) on the embedded store, or on the run's shared etcd."""
    config = tmp_path / "coordinator.toml"
    config.write_text(CONFIG)
    args = ["--config", str(config)]
    if request.param == "etcd":
        etcd = request.getfixturevalue("shared_etcd")
        args += etcd_coordinator_args(etcd.endpoint, etcd_prefix(), LEASE_S)
    federation = LocalFederation(tmp_path / "fed", [], coordinator_args=args)
    try:
        yield federation
    finally:
        federation.stop()


@dataclass
class Run:
    """One run of a task, from its marker lines."""

    epoch: int
    started: float
    restored: str
    ended: float = float("inf")
    how: str = ""
    """``exit`` (stopped in its grace) or ``done`` (finished)."""
    termed: float | None = None


def runs_of(markers: Path, job_id: str) -> list[Run]:
    """Every run of the job's task, in start order."""
    path = markers / job_id
    runs: dict[int, Run] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        what, epoch_text, at_text, *detail = line.split(" ", 3)
        epoch, at = int(epoch_text), float(at_text)
        if what == "start":
            assert epoch not in runs, f"{job_id} started twice at epoch {epoch}"
            runs[epoch] = Run(epoch, at, detail[0] if detail else "")
        elif what == "term":
            runs[epoch].termed = at
        else:
            runs[epoch].ended, runs[epoch].how = at, what
    return sorted(runs.values(), key=lambda run: run.started)


def task_spec(job_id: str, code: str, site: str, markers: Path, cls: str) -> jobs_pb2.JobSpec:
    """A one-GPU task pinned to ``site``, checkpointing unless it is urgent; ``cls`` "" is
    no class: priority 0, preemptible."""
    task: dict[str, object] = {
        "name": "t",
        "command": [sys.executable, "-c", code, str(markers), str(HOLD_S)],
        "resources": {"accelerator": {"kind": "GPU", "count": 1}},
    }
    if cls != "urgent":
        task["checkpoint"] = {"interval_s": 0.2}
    return spec(job_id, [task], id=job_id, priority_class=cls, constraints={"sites": [site]})


async def get(channel: grpc.aio.Channel, job_id: str) -> jobs_pb2.Job:
    reply = await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
    return reply.job


async def event_reasons(channel: grpc.aio.Channel, job_id: str) -> list[str]:
    request = job_service_pb2.GetJobRequest(job_id=job_id, include_events=True)
    return [event.reason for event in (await jobs(channel).GetJob(request)).events]


async def finished(channel: grpc.aio.Channel, job_id: str, timeout_s: float = 30) -> jobs_pb2.Job:
    """The job once it has ended; fails naming where its task stands if it does not."""
    try:
        return await wait_for_job(channel, job_id, timeout_s=timeout_s)
    except TimeoutError:
        task = (await get(channel, job_id)).tasks[0]
        state = jobs_pb2.JobState.Name(task.state)
        raise AssertionError(
            f"{job_id} not done in {timeout_s} s: {state}, {task.reason}"
        ) from None


async def test_a_failover_mid_preemption_loses_nothing(
    fed: LocalFederation, tmp_path: Path
) -> None:
    ha = "--store" in fed.coordinator_args
    names = ["coord-a", "coord-b"] if ha else ["coordinator"]
    for name in names:
        await fed.start_coordinator(name=name)
    leader = await leader_name(fed) if ha else names[0]
    successor = next(n for n in names if n != leader) if ha else leader
    markers = tmp_path / "markers"
    markers.mkdir()
    low = [*VICTIMS.values(), *BYSTANDERS.values()]

    async with proxy_to(fed.coordinators[leader][0]) as proxy:
        for site, gpus in SITES.items():
            settings = {"coordinator": f"127.0.0.1:{proxy.port}"} if site == PROXIED else {}
            fed.sites.append(gpu_site(site, gpus, kill_grace_s=GRACE_S, **settings))
            await fed.start_site(fed.sites[-1])
        await fed.wait_connected()

        async with fed.operator().at(fed.address_of(leader)).channel() as channel:
            stub = jobs(channel)
            # Victims are of the lowest priority, so the leader picks them over bystanders.
            specs = [task_spec(job, TASK, site, markers, "batch") for site, job in VICTIMS.items()]
            specs += [task_spec(job, TASK, site, markers, "") for site, job in BYSTANDERS.items()]
            await stub.SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=specs))

            async def checkpointed() -> bool:
                tasks = [(await get(channel, job)).tasks[0] for job in low]
                return all(t.state == RUNNING and t.checkpoint.path for t in tasks)

            await until(checkpointed, "every low task running with a checkpoint")
            proxy.pause()  # what the leader sends gpu-b from now on stays in the proxy
            specs = [
                task_spec(job, URGENT_TASK, site, markers, "urgent") for site, job in URGENT.items()
            ]
            await stub.SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=specs))

            async def in_the_window() -> bool:
                tasks = [(await get(channel, job)).tasks[0] for job in VICTIMS.values()]
                marked = all(t.preempted_by and t.state == RUNNING for t in tasks)
                told = [runs_of(markers, VICTIMS[s])[0].termed for s in ("gpu-a", "gpu-c")]
                return marked and None not in told

            await until(in_the_window, "every victim marked, gpu-a's and gpu-c's stopping", 10)
        killed_at = time.time()
        fed.kill(leader)

        # No victim could report its end: each waits for its release; gpu-b's was never told.
        for victim in VICTIMS.values():
            (run,) = runs_of(markers, victim)
            assert run.ended == float("inf"), f"{victim} ended before the failover"
        assert runs_of(markers, VICTIMS[PROXIED])[0].termed is None  # its stop is in the proxy
        (markers / "release-gpu-a").touch()  # it ends with no leader to report to
        (markers / "release-gpu-b").touch()  # it ends as soon as it is told
        proxy.cut()
        proxy.target_port = fed.coordinators[successor][0]
        proxy.heal()
        if not ha:
            await fed.start_coordinator(name=leader, port=fed.port, join_port=fed.join_port)

        async with fed.operator().at(fed.address_of(successor)).channel() as channel:

            async def serving() -> bool:
                try:
                    await get(channel, URGENT["gpu-c"])
                except grpc.aio.AioRpcError as err:
                    if err.code() != grpc.StatusCode.UNAVAILABLE:
                        raise
                    return False  # not leading yet
                return True

            await until(serving, f"{successor} to lead", timeout_s=LEASE_S + 10)

            async def told_again() -> bool:
                """gpu-b's victim got the stop sent again at its hello, urgent-gpu-b started in
                the room it left, and gpu-c is back (its victim still in its grace)."""
                gpu_c = await site_state(channel, "gpu-c")
                again = runs_of(markers, VICTIMS[PROXIED])[0].termed is not None
                started = bool(runs_of(markers, URGENT[PROXIED]))
                return again and started and gpu_c.state == admin_service_pb2.SITE_STATE_CONNECTED

            await until(told_again, "gpu-b's victim stopped again, gpu-c back", timeout_s=20)
            (markers / "release-gpu-c").touch()
            for job_id in URGENT.values():
                done = await finished(channel, job_id)
                assert done.state == SUCCEEDED, (job_id, done.reason)

            async def restarted() -> bool:
                return all(len(runs_of(markers, v)) == 2 for v in VICTIMS.values())

            await until(restarted, "every victim started again", timeout_s=30)
            (markers / "go").touch()
            ended = {job: await finished(channel, job) for job in low}
            told = {v: await event_reasons(channel, v) for v in VICTIMS.values()}
            if ha:
                assert await leader_name(fed) == successor

    # The new leader counted the room of each victim being stopped: no other task was stopped.
    for bystander in BYSTANDERS.values():
        assert ended[bystander].state == SUCCEEDED, (bystander, ended[bystander].reason)
        assert ended[bystander].tasks[0].preemptions == 0, bystander
        (only,) = runs_of(markers, bystander)
        assert (only.termed, only.how) == (None, "done"), bystander
    for site, victim in VICTIMS.items():
        job = ended[victim]
        assert job.state == SUCCEEDED, (victim, job.reason)
        assert job.tasks[0].preemptions == 1, victim
        first, second = runs_of(markers, victim)
        # Stopped once, in the failover, then restarted from its checkpoint.
        assert (first.restored, first.how) == ("-", "exit"), victim
        assert first.termed is not None
        assert first.ended > killed_at
        if site == PROXIED:
            assert first.termed > killed_at  # only the stop sent again at its hello reached it
        events = [r for r in told[victim] if r.startswith("preempted by")]
        assert len(events) == 1, told[victim]
        assert events[0].startswith("preempted by a job of priority 900; restarts from checkpoint")
        assert events[0].endswith(second.restored), (events[0], second.restored)
        assert "/step-" in second.restored
        assert second.how == "done"  # finished exactly once
        assert second.epoch > first.epoch
        # Never two runs of the task at once, and its GPU never held by two tasks at once:
        # the urgent job ran after the victim left it and before the victim came back.
        (urgent,) = runs_of(markers, URGENT[site])
        assert first.ended <= urgent.started < urgent.ended <= second.started, (site, urgent)
