"""Negotiation rounds as sites see them: the best site alone first, then several at once.

The three sites run the real agent runtime over mTLS with a scripted local core (declared
capacity, a decline rule, a record of every offer, commit and release). Placement ranks them
a (64 CPUs free), b (32), c (16) by free capacity; everything else about them is equal.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import pytest_asyncio

from federation.api.v1 import job_service_pb2, job_service_pb2_grpc, jobs_pb2, site_link_service_pb2
from federation.local import LocalFederation
from federation.testing.cluster import until
from federation.testing.scripted_core import (
    ScriptedCore,
    accept_all,
    restart_scripted_site,
    start_scripted_sites,
)

from .conftest import jobs, python_task, spec, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-negotiation")


def draining(offer: site_link_service_pb2.Offer) -> str:
    return "draining"


@dataclass
class ScriptedFederation:
    fed: LocalFederation
    cores: dict[str, ScriptedCore]
    runners: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    """Each site's agent, for tests that restart one."""


@pytest_asyncio.fixture
async def sites(tmp_path: Path) -> AsyncIterator[ScriptedFederation]:
    fed = LocalFederation(tmp_path / "fed", [])
    cores = {"a": ScriptedCore(cpu=64), "b": ScriptedCore(cpu=32), "c": ScriptedCore(cpu=16)}
    scripted = ScriptedFederation(fed, cores)
    try:
        await fed.start_coordinator()
        started = await start_scripted_sites(fed, cores, timeout_s=30)
        scripted.runners.update(zip(cores, started, strict=True))
        yield scripted
    finally:
        for runner in scripted.runners.values():
            runner.cancel()
        await asyncio.gather(*scripted.runners.values(), return_exceptions=True)
        fed.stop()


async def submit_and_finish(fed: LocalFederation, name: str) -> jobs_pb2.Job:
    async with fed.operator().channel() as channel:
        job_spec = spec(name, [python_task("t", "", resources={"cpu": 1, "memory_mib": 64})])
        reply = await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job_spec))
        return await wait_for_job(channel, reply.job.id, timeout_s=30)


async def submit_pinned(
    stub: job_service_pb2_grpc.JobServiceStub, pins: dict[str, str]
) -> list[str]:
    """One job per name, each allowed only at its site, submitted in one call (so placed in one
    cycle); their ids, in order."""
    task = python_task("t", "", resources={"cpu": 1})
    specs = [spec(name, [task], constraints={"sites": [site]}) for name, site in pins.items()]
    reply = await stub.SubmitJobs(job_service_pb2.SubmitJobsRequest(specs=specs))
    return [job.id for job in reply.jobs]


def offers_of(cores: dict[str, ScriptedCore], job_id: str) -> dict[str, list[int]]:
    """Site -> the epochs of the offers it got for the job."""
    return {
        name: [o.epoch for o in core.offers if o.job_id == job_id] for name, core in cores.items()
    }


async def test_the_best_site_is_offered_alone_and_committed(
    sites: ScriptedFederation,
) -> None:
    fed, cores = sites.fed, sites.cores
    job = await submit_and_finish(fed, "alone")
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED
    assert offers_of(cores, job.id) == {"a": [1], "b": [], "c": []}
    assert [(c.job_id, c.epoch) for c in cores["a"].commits] == [(job.id, 1)]
    assert (job.tasks[0].site, job.tasks[0].epoch) == ("a", 1)
    assert not any(core.releases for core in cores.values())


async def test_after_a_decline_the_next_sites_are_offered_at_once(
    sites: ScriptedFederation,
) -> None:
    """a declines; one round offers b and c under one epoch; both accept, b (ranked higher)
    gets the commit and c's reservation is released."""
    fed, cores = sites.fed, sites.cores
    cores["a"].decline = draining
    job = await submit_and_finish(fed, "declined")
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED
    assert offers_of(cores, job.id) == {"a": [1], "b": [2], "c": [2]}
    assert [(c.job_id, c.epoch) for c in cores["b"].commits] == [(job.id, 2)]
    assert not cores["c"].commits
    assert (job.tasks[0].site, job.tasks[0].epoch) == ("b", 2)

    async def released() -> bool:  # the release leaves after the commit
        return cores["c"].releases == ["r1"]

    await until(released, 10, "c's reservation released")
    assert cores["a"].releases == cores["b"].releases == []


async def test_epochs_offered_in_vain_are_recorded_and_never_reused(
    sites: ScriptedFederation,
) -> None:
    """Every site declines: the task stays PENDING with a verdict per site and the epochs its
    rounds used on record; once a site takes it, the commit carries a higher epoch."""
    fed, cores = sites.fed, sites.cores
    for core in cores.values():
        core.decline = draining
    async with fed.operator().channel() as channel:
        stub = jobs(channel)
        job_spec = spec("nowhere", [python_task("t", "", resources={"cpu": 1})])
        job_id = (await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=job_spec))).job.id

        async def declined_everywhere() -> bool:
            job = (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job
            return {v.site for v in job.tasks[0].verdicts} == {"a", "b", "c"}

        await until(declined_everywhere, 10, "a verdict from every site")
        job = (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job
        task = job.tasks[0]
        assert task.state == jobs_pb2.JOB_STATE_PENDING
        assert all("draining" in v.reason for v in task.verdicts)
        offered = sorted({e for epochs in offers_of(cores, job_id).values() for e in epochs})
        assert task.issued_epoch >= offered[-1]  # each failed negotiation records its epochs

        cores["c"].decline = accept_all
        done = await wait_for_job(channel, job_id, timeout_s=30)
    assert (done.state, done.tasks[0].site) == (jobs_pb2.JOB_STATE_SUCCEEDED, "c")
    (commit,) = cores["c"].commits
    assert commit.epoch == done.tasks[0].epoch > offered[-1]
    for name, epochs in offers_of(cores, job_id).items():
        assert epochs == sorted(set(epochs)), f"{name} was offered an epoch twice: {epochs}"
        assert max(epochs) <= commit.epoch


async def test_a_slow_site_holds_up_only_the_tasks_offered_to_it(
    sites: ScriptedFederation,
) -> None:
    """Two jobs submitted together are negotiated together, one allowed only at a, which does
    not answer yet, the other only at b: b's runs to the end while a's offer is unanswered."""
    fed, cores = sites.fed, sites.cores
    gate = asyncio.Event()
    cores["a"].gate = gate
    async with fed.operator().channel() as channel:
        stub = jobs(channel)
        at_a, at_b = await submit_pinned(stub, {"at-a": "a", "at-b": "b"})
        done = await wait_for_job(channel, at_b, timeout_s=30)
        assert (done.state, done.tasks[0].site) == (jobs_pb2.JOB_STATE_SUCCEEDED, "b")
        waiting = (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=at_a))).job.tasks[0]
        assert offers_of(cores, at_a)["a"] == [1]
        assert waiting.state == jobs_pb2.JOB_STATE_PENDING
        refusals = [v.reason for v in waiting.verdicts if v.stage == "Negotiate"]
        assert refusals == [], "a's offer timed out before b's job could end"

        gate.set()
        done = await wait_for_job(channel, at_a, timeout_s=30)
    assert (done.state, done.tasks[0].site) == (jobs_pb2.JOB_STATE_SUCCEEDED, "a")


async def test_a_task_back_in_negotiation_is_never_negotiated_twice_at_once(
    sites: ScriptedFederation,
) -> None:
    """A task delegated early in a batch that comes back to PENDING before the batch ends is
    negotiated again; when the first batch ends it must not let go of the task under its new
    negotiation, or a third would offer it too and two commits could go out at one epoch."""
    fed, cores = sites.fed, sites.cores
    slow_c, slow_a = asyncio.Event(), asyncio.Event()
    cores["c"].gate = slow_c
    cores["a"].finishes = False  # a's tasks run and never report
    async with fed.operator().channel() as channel:
        stub = jobs(channel)

        async def state_of(job_id: str) -> jobs_pb2.TaskStatus:
            reply = await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
            return reply.job.tasks[0]

        moves, waits = await submit_pinned(stub, {"moves": "a", "waits": "c"})

        async def delegated_at_a() -> bool:
            return (await state_of(moves)).state == jobs_pb2.JOB_STATE_DELEGATED

        await until(delegated_at_a, 10, "the first job delegated to a")
        # a comes back without the task: it goes back to PENDING and is offered to a again,
        # whose answers now wait, while the first batch still waits on c.
        again = ScriptedCore(cpu=64, finishes=False)
        again.gate = slow_a
        sites.runners["a"] = await restart_scripted_site(fed, "a", sites.runners["a"], again)

        async def offered_again() -> bool:
            return len(again.offers) == 1

        await until(offered_again, 10, "the task offered to a again")
        slow_c.set()  # the first batch ends
        await wait_for_job(channel, waits, timeout_s=30)
        # A job for b wakes the scheduler: with the task let go by mistake, the same round
        # would offer it to a once more, before this job could run to its end at b.
        (wake,) = await submit_pinned(stub, {"wake": "b"})
        await wait_for_job(channel, wake, timeout_s=30)
        slow_a.set()

        async def delegated_again() -> bool:
            status = await state_of(moves)
            return status.state == jobs_pb2.JOB_STATE_DELEGATED and status.epoch > 1

        await until(delegated_again, 10, "the task delegated to a again")
    assert [o.epoch for o in again.offers] == [2]
    assert [(c.job_id, c.epoch) for c in again.commits] == [(moves, 2)]
