"""A task whose commit reached its site runs there once, whatever became of the answer.

Two sites run the real agent runtime over mTLS with a scripted local core: a (64 CPUs, ranked
first) and b (32). a takes the commit of the job's task, so the task runs there, but holds its
answer back. The coordinator wrote DELEGATED at a with the task's epoch before the commit left;
what it does next must never start a second copy:

- the answer does not come: the coordinator ends a's session rather than place the task again,
  and a's hello, which lists the task, makes it RUNNING at a;
- the leader is SIGKILLed while it waits: the next one (another coordinator of the HA group on
  etcd, or the same one restarted on its SQLite store) finds DELEGATED at a, and a's hello to it
  makes the task RUNNING there.

Each ends with the job SUCCEEDED at a, at the epoch of the one and only commit sent. And when a
comes back without the task (a new core), its hello has the task placed again at once, not
after the job's ``lost_after_s``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import pytest_asyncio

from federation.api.v1 import job_service_pb2, job_service_pb2_grpc, jobs_pb2
from federation.connection import Connection, on_leader
from federation.local import LocalFederation
from federation.testing.cluster import etcd_coordinator_args, leader_name, submit, until
from federation.testing.scripted_core import (
    ScriptedCore,
    restart_scripted_site,
    start_scripted_sites,
)

from .conftest import etcd_prefix, python_task, spec, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-exactly-once")

LEASE_S = 3.0
OFFER_TIMEOUT_S = 2.0
CONFIG = f"offer_timeout_s = {OFFER_TIMEOUT_S}\nreservation_lease_s = 4.0\n"
RUNNING = jobs_pb2.JOB_STATE_RUNNING


@dataclass
class Sites:
    """The two scripted sites: a holds its commit answers back, neither ends a task itself."""

    cores: dict[str, ScriptedCore]
    runners: dict[str, asyncio.Task[None]]
    """Each site's agent, for a test that restarts one."""

    def commits(self) -> list[tuple[str, str, int]]:
        """(site, job, epoch) of every copy a commit started: a commit sent again (same
        reservation, while no answer came) starts nothing more at a real site."""
        started = {
            (s, c.reservation_id): (s, c.job_id, c.epoch)
            for s, core in self.cores.items()
            for c in core.commits
        }
        return list(started.values())


@pytest.fixture(params=["sqlite", "etcd"])
def fed(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalFederation]:
    """A federation (not started) on the embedded store, or on the run's shared etcd."""
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


@pytest_asyncio.fixture
async def sites(fed: LocalFederation) -> AsyncIterator[Sites]:
    """Start the coordinators (two on etcd, one on SQLite), then sites a and b."""
    names = ["coord-a", "coord-b"] if is_ha(fed) else ["coordinator"]
    for name in names:
        await fed.start_coordinator(name=name)
    cores = {"a": ScriptedCore(cpu=64, finishes=False), "b": ScriptedCore(cpu=32, finishes=False)}
    gate = cores["a"].commit_gate = asyncio.Event()
    started = await start_scripted_sites(fed, cores, timeout_s=30)
    runners = dict(zip(cores, started, strict=True))
    try:
        yield Sites(cores, runners)
    finally:
        gate.set()
        for runner in runners.values():
            runner.cancel()
        await asyncio.gather(*runners.values(), return_exceptions=True)


def is_ha(fed: LocalFederation) -> bool:
    return "--store" in fed.coordinator_args


async def get_task(fed: LocalFederation, job_id: str) -> jobs_pb2.TaskStatus:
    """The job's task as the leader has it, found among the coordinators."""

    async def get(conn: Connection) -> jobs_pb2.TaskStatus:
        async with conn.channel() as channel:
            stub = job_service_pb2_grpc.JobServiceStub(channel)
            reply = await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
        return reply.job.tasks[0]

    return await on_leader(fed.operator(), get)


async def submit_one(fed: LocalFederation, sites: Sites) -> str:
    """Submit a one-task job and wait for its commit to reach a (its answer held back)."""
    job_id = await submit(fed, spec("once", [python_task("t", "", resources={"cpu": 1})]))

    async def committed_at_a() -> bool:
        return bool(sites.cores["a"].commits)

    await until(committed_at_a, 20, "the commit to reach a")
    return job_id


async def run_once_at_a(fed: LocalFederation, sites: Sites, job_id: str) -> None:
    """The task ends RUNNING at a (or a second commit went out); then a ends it, and the job
    must have succeeded at a, at the epoch of the only commit."""

    async def settled() -> bool:
        if len(sites.commits()) > 1:
            return True
        try:
            return (await get_task(fed, job_id)).state == RUNNING
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            return False  # no coordinator leads yet

    await until(settled, 30, "the task RUNNING at a, or a second commit")
    copies = sites.commits()
    assert copies == [("a", job_id, 1)], f"copies committed (site, job, epoch): {copies}"
    task = await get_task(fed, job_id)
    assert (task.site, task.epoch) == ("a", 1)
    sites.cores["a"].finish(job_id)
    async with fed.operator().at(fed.address_of(await leader(fed))).channel() as channel:
        done = await wait_for_job(channel, job_id, timeout_s=30)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
    assert (done.tasks[0].site, done.tasks[0].epoch) == ("a", 1)
    assert sites.commits() == [("a", job_id, 1)]


async def leader(fed: LocalFederation) -> str:
    return await leader_name(fed) if is_ha(fed) else "coordinator"


@pytest.mark.parametrize("fed", ["sqlite"], indirect=True)
async def test_a_commit_without_an_answer_is_not_placed_again(
    fed: LocalFederation, sites: Sites
) -> None:
    """No answer within two offer timeouts: the task stays DELEGATED at a, whose session the
    coordinator ends; a's hello lists the task, which becomes RUNNING there."""
    job_id = await submit_one(fed, sites)
    await run_once_at_a(fed, sites, job_id)


async def test_a_leader_killed_before_the_commits_answer_leaves_one_copy(
    fed: LocalFederation, sites: Sites
) -> None:
    """The leader dies with the commit at a and its answer held back: the next leader finds the
    task DELEGATED at a, and a's hello makes it RUNNING there."""
    killed = await leader(fed)
    job_id = await submit_one(fed, sites)
    fed.kill(killed)
    if not is_ha(fed):
        await fed.start_coordinator(name=killed, port=fed.port, join_port=fed.join_port)
    await run_once_at_a(fed, sites, job_id)


@pytest.mark.parametrize("fed", ["sqlite"], indirect=True)
async def test_a_site_back_without_the_committed_task_has_it_placed_again_at_once(
    fed: LocalFederation, sites: Sites
) -> None:
    """a's agent goes away with the commit unanswered and comes back without the task (a new
    core): its hello settles the task, placed again at once, not after the job's 60 s
    ``lost_after_s``; one copy runs, at the next epoch."""
    job_id = await submit_one(fed, sites)
    gone = sites.cores["a"]
    sites.cores["a"] = ScriptedCore(cpu=64, finishes=False)
    back_at = time.monotonic()
    sites.runners["a"] = await restart_scripted_site(fed, "a", sites.runners["a"], sites.cores["a"])

    async def committed_again() -> bool:
        return bool(sites.commits())

    placed_at = await until(committed_again, 15, "the task committed again")
    print(f"\nplaced again {placed_at - back_at:.2f}s after a came back without it")
    ((site, job, epoch),) = sites.commits()
    assert (job, epoch) == (job_id, 2)
    sites.cores[site].finish(job_id)
    async with fed.operator().channel() as channel:
        done = await wait_for_job(channel, job_id, timeout_s=30)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
    assert (done.tasks[0].site, done.tasks[0].epoch) == (site, 2)
    assert [(c.job_id, c.epoch) for c in gone.commits] == [(job_id, 1)]
