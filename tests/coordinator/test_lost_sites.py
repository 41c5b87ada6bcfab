"""The lost-site monitor over a real SQLite store: moves, grace, keep, partition, lost races."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from structlog.testing import capture_logs

from federation.api.v1 import admin_service_pb2, jobs_pb2, resources_pb2, site_link_service_pb2
from federation.common import job_state
from federation.coordinator.jobs.events import EventHub
from federation.coordinator.jobs.records import Change, Mutation, find_task, transition
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.sites.lost import LostSites
from federation.coordinator.sites.registry import SiteRegistry, SiteSession
from federation.errors import ConflictError
from federation.store import SqliteStore


class Clock:
    """Monotonic time, moved forward by the test."""

    def __init__(self) -> None:
        self.offset_s = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset_s


class World:
    """Jobs, sites and a monitor wired together as a leader's term wires them."""

    def __init__(self, store: SqliteStore) -> None:
        self.jobs = JobRepository(store, EventHub())
        self.sites = SiteRegistry(store, lambda: None)
        self.clock = Clock()
        self.wakes = 0
        self.monitor = LostSites(
            self.jobs, self.sites, self._wake, 1.0, heartbeat_s=1.0, clock=self.clock
        )
        self.sessions: dict[str, SiteSession] = {}

    def _wake(self) -> None:
        self.wakes += 1

    def connect(self, name: str) -> None:
        self.sites.registered(admin_service_pb2.Site(name=name))
        session = SiteSession(name)
        view = resources_pb2.SiteView(site=name)
        self.sites.attach(session, site_link_service_pb2.Hello(view=view))
        self.sessions[name] = session

    def lose(self, name: str, *, goodbye: bool = False) -> None:
        session = self.sessions.pop(name)
        session.said_goodbye = goodbye
        session.close()
        self.sites.detach(session)

    async def running(
        self, job_id: str, site: str, disconnect: dict[str, object] | None = None
    ) -> jobs_pb2.Job:
        """A one-task job whose task runs at ``site`` with epoch 1."""
        job = jobs_pb2.Job(id=job_id, state=job_state.PENDING)
        job.spec.id = job.spec.name = job_id
        job.spec.tasks.add(name="t", command=["x"])
        if disconnect is not None:
            policy = job.spec.disconnect
            policy.lost_after_s = float(str(disconnect.get("lost_after_s", 0)))
            if "replace" in disconnect:
                policy.replace = bool(disconnect["replace"])
            policy.stop_after_s = float(str(disconnect.get("stop_after_s", 0)))
        job.tasks.add(name="t", state=job_state.PENDING)
        await self.jobs.create([job])
        return await self.jobs.update(job_id, _to_running(site))


def _to_running(site: str) -> Mutation:
    def mutate(job: jobs_pb2.Job) -> list[Change]:
        task = find_task(job, "t")
        task.epoch = task.issued_epoch = 1
        changes = [transition(job, "t", job_state.SCHEDULING, "offered")]
        task.site = site
        changes.append(transition(job, "t", job_state.DELEGATED, "accepted"))
        changes.append(transition(job, "t", job_state.RUNNING, "running"))
        task.checkpoint.path, task.checkpoint.bytes, task.checkpoint.site = "/ck/1", 10, site
        return changes

    return mutate


@pytest_asyncio.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    store = await SqliteStore.open(tmp_path / "db")
    yield World(store)
    await store.close()


async def test_task_moves_after_its_grace_with_a_new_epoch(world: World) -> None:
    """After lost_after_s the task is PENDING, epoch bumped, original remembered, move recorded."""
    for name in ("a", "b", "c"):
        world.connect(name)
    await world.running("j", "a", {"lost_after_s": 5})
    world.lose("a")
    world.clock.offset_s = 4.0
    assert await world.monitor.check() == []
    world.clock.offset_s = 6.0
    with capture_logs() as logs:
        (move,) = await world.monitor.check()
    assert (move.job_id, move.site, move.epoch) == ("j", "a", 1)
    job = await world.jobs.get("j")
    task = job.tasks[0]
    assert (task.state, task.site) == (job_state.PENDING, "")
    assert (task.epoch, task.issued_epoch, task.moves) == (2, 2, 1)
    assert (task.displaced.site, task.displaced.epoch) == ("a", 1)
    assert task.reason == "site a unreachable for 6s; placing again from checkpoint /ck/1"
    last = (await world.jobs.events("j"))[-1]
    assert (last.moved_from, last.site, last.state) == ("a", "a", job_state.PENDING)
    assert world.wakes == 1
    (moved,) = [e for e in logs if e["event"] == "task_moved_off_lost_site"]
    assert (moved["old_epoch"], moved["epoch"], moved["log_level"]) == (1, 2, "warning")
    assert await world.monitor.check() == []  # moved once


async def test_with_stop_after_the_task_waits_until_its_copy_is_surely_gone(
    world: World,
) -> None:
    """stop_after_s as long as lost_after_s: the task moves only after the margin too (at a
    1 s heartbeat: 1 + 1 s watchdog + 5 s stop grace + 1 s exit + clock drift); a job that
    says nothing of stop_after moves at lost_after_s, as before."""
    for name in ("a", "b"):
        world.connect(name)
    await world.running("stops", "a", {"lost_after_s": 5, "stop_after_s": 5})
    await world.running("keeps", "a", {"lost_after_s": 5})
    world.lose("a")
    world.clock.offset_s = 5.5
    assert [move.job_id for move in await world.monitor.check()] == ["keeps"]
    world.clock.offset_s = 12.9
    assert await world.monitor.check() == []
    assert (await world.jobs.get("stops")).tasks[0].state == job_state.RUNNING
    world.clock.offset_s = 13.1
    (move,) = await world.monitor.check()
    assert (move.job_id, move.epoch) == ("stops", 1)
    assert move.reason == "site a unreachable for 13s; placing again from checkpoint /ck/1"


async def test_default_grace_is_sixty_seconds(world: World) -> None:
    """Without a policy the task waits 60 s for its site."""
    world.connect("a")
    world.connect("b")
    await world.running("j", "a")
    world.lose("a")
    world.clock.offset_s = 59.0
    assert await world.monitor.check() == []
    world.clock.offset_s = 61.0
    assert len(await world.monitor.check()) == 1


async def test_replace_false_leaves_the_task_waiting(world: World) -> None:
    """A job that says replace: false keeps its task at the lost site however long it is away."""
    world.connect("a")
    world.connect("b")
    await world.running("j", "a", {"lost_after_s": 1, "replace": False})
    world.lose("a")
    world.clock.offset_s = 3600.0
    assert await world.monitor.check() == []
    assert (await world.jobs.get("j")).tasks[0].state == job_state.RUNNING


async def test_a_site_that_said_goodbye_is_disconnected_and_its_tasks_move_too(
    world: World,
) -> None:
    """After a goodbye the site is DISCONNECTED (not counted as unreachable); its tasks move."""
    world.connect("a")
    world.connect("b")
    await world.running("j", "a", {"lost_after_s": 1})
    world.lose("a", goodbye=True)
    assert world.sites.describe("a").state == admin_service_pb2.SITE_STATE_DISCONNECTED
    world.clock.offset_s = 2.0
    (move,) = await world.monitor.check()
    assert "site a disconnected for 2s" in move.reason


async def test_most_sites_lost_at_once_pauses_moving(world: World) -> None:
    """With 2 of 3 sites unreachable nothing moves and the pause is explained, until one returns."""
    for name in ("a", "b", "c"):
        world.connect(name)
    await world.running("j", "a", {"lost_after_s": 1})
    world.lose("a")
    world.lose("b")
    world.clock.offset_s = 10.0
    with capture_logs() as logs:
        assert await world.monitor.check() == []
        assert await world.monitor.check() == []
    assert world.monitor.paused
    assert "2 of 3 sites are unreachable (a, b)" in world.monitor.note
    assert [e["event"] for e in logs].count("rescheduling_paused") == 1  # logged once
    assert (await world.jobs.get("j")).tasks[0].state == job_state.RUNNING
    world.connect("b")
    with capture_logs() as logs:
        assert len(await world.monitor.check()) == 1
    assert (world.monitor.paused, world.monitor.note) == (False, "")
    assert "rescheduling_resumed" in [e["event"] for e in logs]


async def test_cordoning_a_gone_site_lifts_the_pause(world: World) -> None:
    """A cordoned unreachable site is not counted, so an operator can end the pause."""
    for name in ("a", "b", "c"):
        world.connect(name)
    await world.running("j", "a", {"lost_after_s": 1})
    world.lose("a")
    world.lose("b")
    world.clock.offset_s = 10.0
    assert await world.monitor.check() == []
    world.sites.get("b").record.cordoned = True
    assert len(await world.monitor.check()) == 1


async def test_a_lost_race_is_logged_and_retried(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A move whose write loses a compare-and-swap race is logged, and done at the next look."""
    world.connect("a")
    world.connect("b")
    await world.running("j", "a", {"lost_after_s": 1})
    world.lose("a")
    world.clock.offset_s = 2.0
    real_update = world.jobs.update

    async def racing(job_id: str, mutate: Mutation) -> jobs_pb2.Job:
        raise ConflictError(f"job {job_id} changed concurrently; retry")

    monkeypatch.setattr(world.jobs, "update", racing)
    with capture_logs() as logs:
        assert await world.monitor.check() == []
    (failed,) = [e for e in logs if e["event"] == "task_move_failed"]
    assert (failed["code"], failed["site"]) == ("CONFLICT", "a")
    monkeypatch.setattr(world.jobs, "update", real_update)
    assert len(await world.monitor.check()) == 1


async def test_a_task_that_moved_on_is_left_alone(world: World) -> None:
    """A task reported finished before the move is written is not moved."""
    world.connect("a")
    world.connect("b")
    await world.running("j", "a", {"lost_after_s": 1})
    world.lose("a")

    def finish(job: jobs_pb2.Job) -> list[Change]:
        return [transition(job, "t", job_state.SUCCEEDED, "exited 0")]

    await world.jobs.update("j", finish)
    world.clock.offset_s = 5.0
    assert await world.monitor.check() == []


async def test_a_term_presumes_sites_holding_tasks_unreachable(world: World) -> None:
    """Sites that hold tasks but have not said hello to this term show UNREACHABLE, with a time."""
    world.sites.registered(admin_service_pb2.Site(name="a"))
    world.sites.registered(admin_service_pb2.Site(name="idle"))
    world.sites.presume_unreachable(["a"])
    assert world.sites.describe("a").state == admin_service_pb2.SITE_STATE_UNREACHABLE
    assert world.sites.describe("a").unreachable_s >= 0
    assert world.sites.describe("idle").state == admin_service_pb2.SITE_STATE_DISCONNECTED
    world.connect("a")
    assert world.sites.describe("a").state == admin_service_pb2.SITE_STATE_CONNECTED
    assert world.sites.describe("a").unreachable_s == 0


async def test_a_cancelled_task_at_a_lost_site_ends_after_the_grace(world: World) -> None:
    """A cancel that could not reach a lost site completes after lost_after_s, not placed again."""
    world.connect("a")
    world.connect("b")
    await world.running("j", "a", {"lost_after_s": 2, "replace": False})

    def cancel(job: jobs_pb2.Job) -> list[Change]:
        job.cancel_requested = True  # the cancel was sent to a, which was lost before answering
        return []

    await world.jobs.update("j", cancel)
    world.lose("a")
    world.clock.offset_s = 1.0
    assert await world.monitor.check() == []
    world.clock.offset_s = 3.0
    (move,) = await world.monitor.check()
    assert move.is_cancel
    job = await world.jobs.get("j")
    assert job.state == job_state.CANCELLED
    assert job.tasks[0].reason == "cancelled; site a unreachable for 3s"
