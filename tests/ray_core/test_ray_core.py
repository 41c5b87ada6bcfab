"""The Ray core against a real Ray head: view, offers as placement groups, jobs, restart.

The head's ``GPU_A100`` devices are declared (a custom Ray resource; this machine has no GPU).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from agent.decisions import CASES, Case, play

from datacenter_agent.ray_cluster.core import RayCore
from federation.agent.core import gang_refusal
from federation.api.v1 import jobs_pb2, resources_pb2, site_link_service_pb2
from federation.testing.ray_head import LocalRayHead

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(180)]

FINAL = (jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED)
GRACE_S = 3.0
sites = itertools.count(1)

Reports = list[site_link_service_pb2.TaskReport]
MakeCore = Callable[[], Awaitable[tuple[RayCore, Reports]]]


def gang(command: list[str], replicas: int = 2, a100s: int = 1) -> jobs_pb2.TaskSpec:
    return jobs_pb2.TaskSpec(
        command=command,
        replicas=replicas,
        resources=jobs_pb2.ResourceRequest(
            cpu=0.5,
            accelerator=jobs_pb2.AcceleratorRequest(
                kind=resources_pb2.DEVICE_KIND_GPU, count=a100s, models=["A100-80GB"]
            ),
        ),
    )


def free_a100s(core: RayCore) -> int:
    return sum(not d.allocated for n in core.nodes() for d in n.devices if d.model == "A100-80GB")


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> float:
    """Waits for a real state to hold; returns the seconds it took."""
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"not {what} after {timeout_s:g}s")
        await asyncio.sleep(0.05)
    return time.monotonic() - began


def last(reports: Reports, job_id: str) -> site_link_service_pb2.TaskReport | None:
    return next((r for r in reversed(reports) if r.job_id == job_id), None)


def offer(
    job_id: str, spec: jobs_pb2.TaskSpec, lease_s: float = 30.0
) -> site_link_service_pb2.Offer:
    return site_link_service_pb2.Offer(
        job_id=job_id, task="main", epoch=1, spec=spec, lease_s=lease_s
    )


def commit(job_id: str, reservation_id: str) -> site_link_service_pb2.Commit:
    return site_link_service_pb2.Commit(
        reservation_id=reservation_id, job_id=job_id, task="main", epoch=1
    )


@pytest.fixture
async def make_core(ray_head: LocalRayHead, tmp_path: Path) -> AsyncIterator[MakeCore]:
    site = f"ray{next(sites)}"
    cores: list[RayCore] = []

    async def make() -> tuple[RayCore, Reports]:
        reports: Reports = []
        core = RayCore(
            ray_head.settings(),
            site=site,
            work_dir=tmp_path / "work",
            on_status=reports.append,
            on_change=lambda: None,
            kill_grace_s=GRACE_S,
        )
        await core.start()
        cores.append(core)
        return core, reports

    yield make
    for core in cores[-1:]:  # the newest core follows every job of the site
        for report in core.tasks():
            if report.state not in FINAL:
                await core.cancel(report.job_id, report.task, 0, "test over")
    for core in cores:
        await core.close()


async def test_view_names_the_declared_a100s(make_core: MakeCore) -> None:
    core, _ = await make_core()
    [node] = core.nodes()
    devices = [d for d in node.devices if d.model == "A100-80GB"]
    assert [d.id for d in devices] == ["GPU_A100-0", "GPU_A100-1"]
    assert {d.provenance for d in devices} == {resources_pb2.PROVENANCE_DECLARED}
    assert node.cpu_cores == 4


async def test_gang_holds_both_a100s_then_runs_and_succeeds(make_core: MakeCore) -> None:
    core, reports = await make_core()
    command = ["sh", "-c", 'echo "replica $FEDERATION_REPLICA of $FEDERATION_REPLICAS in $PWD"']
    answer = await core.offer(offer("j-gang", gang(command)))
    assert answer.accepted, answer.reason
    assert free_a100s(core) == 0
    began = time.monotonic()
    assert (await core.commit(commit("j-gang", answer.reservation_id))).started
    # A retried commit finds the job it submitted.
    assert (await core.commit(commit("j-gang", answer.reservation_id))).started
    running = await until(
        lambda: any(r.state == jobs_pb2.JOB_STATE_RUNNING for r in reports), "running"
    )
    assert running < 5.0
    await until(lambda: (r := last(reports, "j-gang")) is not None and r.state in FINAL, "ended")
    report = last(reports, "j-gang")
    assert report is not None
    assert report.state == jobs_pb2.JOB_STATE_SUCCEEDED, report
    assert "replica 0 of 2" in report.output_tail
    assert "replica 1 of 2" in report.output_tail
    assert "replica-1" in report.output_tail  # each replica in its own work folder
    [node] = core.nodes()
    assert sorted(report.devices) == [f"{node.name}:GPU_A100-0", f"{node.name}:GPU_A100-1"]
    await until(lambda: free_a100s(core) == 2, "A100s free again")
    print(f"commit to running: {running:.2f}s, to end: {time.monotonic() - began:.2f}s")


async def test_uncommitted_offer_lapses_within_its_lease(make_core: MakeCore) -> None:
    core, _ = await make_core()
    answer = await core.offer(offer("j-lapse", gang(["true"], replicas=1), lease_s=1.0))
    assert answer.accepted, answer.reason
    began = time.monotonic()
    assert free_a100s(core) == 1
    await until(lambda: free_a100s(core) == 2, "capacity freed")
    assert time.monotonic() - began < 1.0 + 1.0
    refused = await core.commit(commit("j-lapse", answer.reservation_id))
    assert not refused.started
    assert refused.reason == f"unknown reservation {answer.reservation_id!r} (lapsed or released)"
    # Ray holds it no more either: a gang of both A100s is placed.
    again = await core.offer(offer("j-after", gang(["true"]), lease_s=5.0))
    assert again.accepted, again.reason
    await core.release(again.reservation_id)


async def test_a_part_of_a_gang_across_sites_is_declined(make_core: MakeCore) -> None:
    core, _ = await make_core()
    part = gang(["true"], replicas=1)
    part.spread.all_or_nothing = True
    answer = await core.offer(offer("j-gang-part", part))
    assert not answer.accepted
    assert answer.reason == gang_refusal("Ray")
    assert free_a100s(core) == 2


async def test_more_than_the_cluster_has_is_declined_at_once(make_core: MakeCore) -> None:
    core, _ = await make_core()
    began = time.monotonic()
    answer = await core.offer(offer("j-big", gang(["true"], replicas=3)))
    took = time.monotonic() - began
    assert not answer.accepted
    assert took < 1.0, took
    assert "Ray cannot place the group" in answer.reason
    assert "INFEASIBLE" in answer.reason or "NO_RESOURCES" in answer.reason, answer.reason
    assert free_a100s(core) == 2


async def test_cancel_runs_the_sigterm_handler_within_the_grace(
    make_core: MakeCore, tmp_path: Path
) -> None:
    core, reports = await make_core()
    mark, started = tmp_path / "terminated", tmp_path / "started"
    script = (
        f"trap 'echo saved > {mark}; echo caught TERM; exit 0' TERM; "
        f"touch {started}; while true; do sleep 0.1; done"
    )
    answer = await core.offer(offer("j-cancel", gang(["sh", "-c", script], replicas=1)))
    assert answer.accepted, answer.reason
    assert (await core.commit(commit("j-cancel", answer.reservation_id))).started
    await until(lambda: any(r.state == jobs_pb2.JOB_STATE_RUNNING for r in reports), "running")
    await until(started.exists, "the task's process started")
    began = time.monotonic()
    await core.cancel("j-cancel", "main", 0, "cancelled by the tenant")
    took = time.monotonic() - began
    report = last(reports, "j-cancel")
    assert report is not None
    assert report.state == jobs_pb2.JOB_STATE_CANCELLED, report
    assert report.reason == "cancelled by the tenant"
    assert mark.exists(), report.output_tail
    assert mark.read_text() == "saved\n"
    assert took < GRACE_S + 2.0, took


async def test_restarted_core_adopts_the_running_job(make_core: MakeCore, tmp_path: Path) -> None:
    core, reports = await make_core()
    gate = tmp_path / "go"
    script = f"echo waiting; while [ ! -e {gate} ]; do sleep 0.1; done; echo done"
    answer = await core.offer(offer("j-adopt", gang(["sh", "-c", script], replicas=1)))
    assert answer.accepted, answer.reason
    stale = await core.offer(offer("j-stale", gang(["true"], replicas=1), lease_s=60))
    assert stale.accepted, stale.reason
    assert (await core.commit(commit("j-adopt", answer.reservation_id))).started
    await until(lambda: any(r.state == jobs_pb2.JOB_STATE_RUNNING for r in reports), "running")
    await core.close()  # as an agent that stops: the job stays with Ray

    again, later = await make_core()
    [adopted] = again.tasks()
    assert (adopted.job_id, adopted.state) == ("j-adopt", jobs_pb2.JOB_STATE_RUNNING)
    [node] = again.nodes()
    assert len(adopted.devices) == 1
    assert adopted.devices[0].startswith(f"{node.name}:GPU_A100-")
    gate.touch()
    await until(lambda: (r := last(later, "j-adopt")) is not None and r.state in FINAL, "ended")
    report = last(later, "j-adopt")
    assert report is not None
    assert report.state == jobs_pb2.JOB_STATE_SUCCEEDED, report
    assert "done" in report.output_tail


@pytest.mark.parametrize("case", [pytest.param(c, id=name) for name, c in CASES.items()])
async def test_ray_core_decides_as_every_core(make_core: MakeCore, case: Case) -> None:
    """The Ray core answers offers and commits as every core does (``agent.decisions``)."""
    core, _ = await make_core()
    assert await play(core, case) == case.answers
