"""A lost site comes back with its copy of a moved task: each reconcile rule, and checkpoints."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from google.protobuf import timestamp_pb2
from structlog.testing import capture_logs

from federation.api.v1 import admin_service_pb2, jobs_pb2, resources_pb2, site_link_service_pb2
from federation.common import job_state
from federation.coordinator.jobs.events import EventHub
from federation.coordinator.jobs.manager import JobManager
from federation.coordinator.jobs.records import Change, Mutation, find_task, transition
from federation.coordinator.jobs.reports import MAX_OUTPUT_TAIL, MAX_REPORT_REASON
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.sites.lost import Move, move_off
from federation.coordinator.sites.registry import SiteRegistry, SiteSession
from federation.store import SqliteStore

RUN, OK, CAN = job_state.RUNNING, job_state.SUCCEEDED, job_state.CANCELLED


class Federation:
    """Jobs, two connected sites (a: the original's, b: the replacement's) and a job manager."""

    def __init__(self, store: SqliteStore) -> None:
        self.jobs = JobRepository(store, EventHub())
        self.sites = SiteRegistry(store, lambda: None)
        self.manager = JobManager(self.jobs, self.sites, EventHub(), lambda: None)
        self.sessions: dict[str, SiteSession] = {}
        for name in ("a", "b"):
            self.sites.registered(admin_service_pb2.Site(name=name))
            session = SiteSession(name)
            hello = site_link_service_pb2.Hello(view=resources_pb2.SiteView(site=name))
            self.sites.attach(session, hello)
            self.sessions[name] = session

    def sent(self, site: str) -> list[site_link_service_pb2.CoordinatorMessage]:
        """What the coordinator told ``site`` so far."""
        out = []
        outbox = self.sessions[site].outbox
        while not outbox.empty():
            message = outbox.get_nowait()
            assert message is not None
            out.append(message)
        return out

    async def moved(self, reconcile: str = "") -> None:
        """Job j: its task ran at a (epoch 1), was moved off a, and now runs at b (epoch 3)."""
        job = jobs_pb2.Job(id="j", state=job_state.PENDING)
        job.spec.id = job.spec.name = "j"
        job.spec.tasks.add(name="t", command=["x"])
        if reconcile:
            job.spec.disconnect.reconcile = jobs_pb2.Reconcile.Value(reconcile)
        job.tasks.add(name="t", state=job_state.PENDING)
        await self.jobs.create([job])
        await self.jobs.update("j", _run_at("a", progress_s=20.0))
        await self.jobs.update("j", move_off(Move("j", "t", "a", 1, "site a unreachable")))
        await self.jobs.update("j", _run_at("b"))

    async def task(self) -> jobs_pb2.TaskStatus:
        return find_task(await self.jobs.get("j"), "t")


def _run_at(site: str, progress_s: float = 0.0) -> Mutation:
    """Place the task at ``site`` with the next epoch, running; optionally with a checkpoint."""

    def mutate(job: jobs_pb2.Job) -> list[Change]:
        task = find_task(job, "t")
        task.issued_epoch = task.epoch = max(task.epoch, task.issued_epoch) + 1
        changes = [transition(job, "t", job_state.SCHEDULING, "offered")]
        task.site = site
        changes += [
            transition(job, "t", job_state.DELEGATED, "accepted"),
            transition(job, "t", job_state.RUNNING, "running"),
        ]
        if progress_s:
            task.checkpoint.CopyFrom(checkpoint(progress_s, site, task.epoch))
        return changes

    return mutate


def checkpoint(progress_s: float, site: str = "", epoch: int = 0) -> jobs_pb2.CheckpointRecord:
    return jobs_pb2.CheckpointRecord(
        path=f"/work/{site}/{progress_s:g}",
        bytes=100,
        time=timestamp_pb2.Timestamp(seconds=1_700_000_000 + int(progress_s)),
        site=site,
        epoch=epoch,
        progress_s=progress_s,
    )


def report(
    epoch: int, state: jobs_pb2.JobState.ValueType, progress_s: float | None = None
) -> site_link_service_pb2.TaskReport:
    out = site_link_service_pb2.TaskReport(job_id="j", task="t", epoch=epoch, state=state)
    if progress_s is not None:
        out.checkpoint.CopyFrom(checkpoint(progress_s))
    return out


@pytest_asyncio.fixture
async def fed(tmp_path: Path) -> AsyncIterator[Federation]:
    store = await SqliteStore.open(tmp_path / "db")
    yield Federation(store)
    await store.close()


def bodies(messages: list[site_link_service_pb2.CoordinatorMessage]) -> list[tuple[str, int]]:
    """(kind, epoch) of cancels and acks."""
    out = []
    for m in messages:
        kind = m.WhichOneof("body")
        if kind == "cancel":
            out.append(("cancel", m.cancel.epoch))
        elif kind == "ack":
            out.append(("ack", m.ack.epoch))
    return out


async def test_by_default_the_returning_original_is_stopped(fed: Federation) -> None:
    """keep_replacement: the original is told to stop; the replacement stays current."""
    await fed.moved()
    with capture_logs() as logs:
        await fed.manager.apply_report("a", report(1, RUN, progress_s=99))
    assert bodies(fed.sent("a")) == [("cancel", 1)]
    assert bodies(fed.sent("b")) == []
    task = await fed.task()
    assert (task.site, task.epoch, task.state) == ("b", 3, RUN)
    assert task.checkpoint.progress_s == 20  # a stale copy's checkpoint is not recorded
    events = [e["event"] for e in logs]
    assert {"original_copy_refused", "stale_task_report_fenced"} <= set(events)


async def test_a_stale_result_is_acknowledged_never_accepted(fed: Federation) -> None:
    """A finished original (keep_replacement) is acked so it is forgotten, not recorded."""
    await fed.moved()
    await fed.manager.apply_report("a", report(1, OK))
    assert bodies(fed.sent("a")) == [("ack", 1)]
    task = await fed.task()
    assert (task.state, task.site) == (RUN, "b")
    assert job_state.SUCCEEDED not in [e.state for e in await fed.jobs.events("j")]


async def test_keep_original_takes_it_back_and_stops_the_replacement(fed: Federation) -> None:
    """keep_original: the original runs on as the task; the replacement gets a cancel."""
    await fed.moved("RECONCILE_KEEP_ORIGINAL")
    with capture_logs() as logs:
        await fed.manager.apply_report("a", report(1, RUN))
    assert bodies(fed.sent("b")) == [("cancel", 3)]
    assert bodies(fed.sent("a")) == []
    task = await fed.task()
    assert (task.site, task.epoch, task.state, task.issued_epoch) == ("a", 1, RUN, 3)
    assert not task.HasField("displaced")
    *_, stopped, kept = await fed.jobs.events("j")
    assert (stopped.state, stopped.moved_from) == (job_state.PENDING, "b")
    assert (kept.state, kept.site) == (RUN, "a")
    assert "keep_original keeps it" in kept.reason
    assert "original_copy_kept" in [e["event"] for e in logs]
    # The replacement's own end is then fenced: acked, not recorded.
    await fed.manager.apply_report("b", report(3, CAN))
    assert bodies(fed.sent("b")) == [("ack", 3)]
    assert (await fed.task()).state == RUN


async def test_keep_original_accepts_its_result(fed: Federation) -> None:
    """keep_original: an original that finished while away is the task's result."""
    await fed.moved("RECONCILE_KEEP_ORIGINAL")
    await fed.manager.apply_report("a", report(1, OK))
    task = await fed.task()
    assert (task.state, task.site, task.epoch) == (OK, "a", 1)
    assert bodies(fed.sent("a")) == [("ack", 1)]
    assert bodies(fed.sent("b")) == [("cancel", 3)]


@pytest.mark.parametrize(("theirs", "kept"), [(50.0, "a"), (20.0, "b"), (5.0, "b")])
async def test_best_keeps_the_copy_with_more_progress(
    fed: Federation, theirs: float, kept: str
) -> None:
    """best: the original wins only with a checkpoint further than the task's recorded one."""
    await fed.moved("RECONCILE_BEST")
    await fed.manager.apply_report("a", report(1, RUN, progress_s=theirs))
    task = await fed.task()
    assert task.site == kept
    if kept == "a":
        assert task.checkpoint.progress_s == theirs  # its report is applied as current
        assert task.checkpoint.site == "a"


async def test_a_later_move_never_reuses_an_epoch(fed: Federation) -> None:
    """After an original with a low epoch was kept, the next epoch issued is above all before."""
    await fed.moved("RECONCILE_KEEP_ORIGINAL")
    await fed.manager.apply_report("a", report(1, RUN))
    await fed.jobs.update("j", move_off(Move("j", "t", "a", 1, "lost again")))
    task = await fed.task()
    assert (task.epoch, task.issued_epoch, task.moves) == (4, 4, 2)


async def test_the_current_copy_records_its_checkpoints(fed: Federation) -> None:
    """A checkpoint from the current copy is recorded with that copy's site and epoch."""
    await fed.moved()
    await fed.manager.apply_report("b", report(3, RUN, progress_s=31))
    task = await fed.task()
    assert (task.checkpoint.site, task.checkpoint.epoch) == ("b", 3)
    assert task.checkpoint.progress_s == 31
    await fed.manager.apply_report("b", report(3, RUN, progress_s=25))  # older: ignored
    assert (await fed.task()).checkpoint.progress_s == 31


async def test_a_reports_reason_and_output_are_cut_to_their_limits(fed: Federation) -> None:
    """A site cannot grow a job's record without bound: a result's reason keeps its start and
    its output its end, each within its limit."""
    await fed.moved()
    result = report(3, OK)
    result.reason = "r" * (MAX_REPORT_REASON + 10)
    result.output_tail = "head" + "o" * MAX_OUTPUT_TAIL
    await fed.manager.apply_report("b", result)
    task = await fed.task()
    assert (task.state, task.reason) == (OK, "r" * MAX_REPORT_REASON)
    assert task.output_tail == "o" * MAX_OUTPUT_TAIL
    assert (await fed.jobs.events("j"))[-1].reason == "r" * MAX_REPORT_REASON
