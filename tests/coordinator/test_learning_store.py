"""Learned speeds in the store (they survive a restart and a leader change) and per site."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
import pytest_asyncio

from federation.coordinator.ha.fencing import FencedStore
from federation.coordinator.ha.leader import LEADER_KEY
from federation.coordinator.scheduling.learning import (
    MAX_PUTS_PER_COMMIT,
    MIN_TASKS,
    PREFIX,
    LearningSaver,
    SpeedLearner,
    store_key,
)
from federation.errors import NotLeaderError
from federation.store import Op, Put, SqliteStore


class CountingStore(SqliteStore):
    """A store that counts commits (and the puts in each) and can be made to fail."""

    commits: list[int]
    attempts: int
    """Commits asked for, failed ones too."""
    attempted: asyncio.Event
    fail: bool
    committed: asyncio.Event

    async def commit(self, ops: Sequence[Op]) -> int:
        self.attempts += 1
        self.attempted.set()
        if self.fail:
            raise NotLeaderError()
        revision = await super().commit(ops)
        self.commits.append(len(ops))
        self.committed.set()
        return revision


@pytest_asyncio.fixture
async def counting(tmp_path: Path) -> AsyncIterator[CountingStore]:
    store = await CountingStore.open(tmp_path / "counted")
    assert isinstance(store, CountingStore)
    store.commits, store.attempts, store.fail = [], 0, False
    store.attempted, store.committed = asyncio.Event(), asyncio.Event()
    yield store
    await store.close()


def taught(site_speeds: dict[str, float], tasks: int = MIN_TASKS) -> SpeedLearner:
    """A learner that saw ``tasks`` tasks of T4 training at each site, at that site's speed."""
    learner = SpeedLearner(metrics=False)
    for _ in range(tasks):
        for site, speed in site_speeds.items():
            learner.observe("training", "T4", 60.0, 100.0, 60.0 / speed, site=site)
    return learner


async def test_learned_speeds_survive_a_restart(store: SqliteStore) -> None:
    learner = taught({"a": 0.5, "b": 0.5})
    learner.observe("inference", "H100-80GB", 10.0, 5.0, 4.0)
    assert await learner.save(store) == 4  # the model's mean, each site's, the other class's
    fresh = SpeedLearner(metrics=False)
    assert await fresh.load(store) == 4
    assert fresh.speed("training", "T4") == pytest.approx(0.5)
    assert fresh.overrides("training", {}) == {"T4": pytest.approx(0.5)}
    assert fresh.error("training", "T4") == pytest.approx(learner.error("training", "T4"))
    # One task of the other class is kept, and counts on towards MIN_TASKS.
    assert fresh.speed("inference", "H100-80GB") is None
    for _ in range(MIN_TASKS - 1):
        fresh.observe("inference", "H100-80GB", 10.0, 5.0, 4.0)
    assert fresh.speed("inference", "H100-80GB") == pytest.approx(2.5)


async def test_a_new_leader_starts_from_what_the_old_one_saved(store: SqliteStore) -> None:
    """The leader's store view is fenced; the next leader reads the same keys back."""
    revision = await store.commit([Put(LEADER_KEY, b"one")])
    old = FencedStore(store, revision, lambda: None)
    learner = taught({"a": 2.0})
    await learner.save(old)
    taken = await store.commit([Put(LEADER_KEY, b"two")])
    learner.observe("training", "T4", 60.0, 30.0, 60.0, site="a")
    with pytest.raises(NotLeaderError):
        await learner.save(old)  # a deposed leader writes nothing, and keeps it to write
    assert learner.pending == 1
    new = SpeedLearner(metrics=False)
    await new.load(FencedStore(store, taken, lambda: None))
    assert new.speed("training", "T4") == pytest.approx(2.0)  # as last saved
    assert new.speed("training", "T4", "a") == pytest.approx(2.0)


async def test_only_what_changed_is_written_in_small_commits(counting: CountingStore) -> None:
    learner = SpeedLearner(metrics=False)
    models = [f"M{i}" for i in range(MAX_PUTS_PER_COMMIT + 20)]
    for model in models:
        learner.observe("training", model, 10.0, 10.0, 10.0)
    assert await learner.save(counting) == len(models)
    assert counting.commits == [MAX_PUTS_PER_COMMIT, 20]
    assert await learner.save(counting) == 0
    assert counting.commits == [MAX_PUTS_PER_COMMIT, 20]  # nothing changed: nothing written
    learner.observe("training", "M3", 10.0, 10.0, 5.0)
    assert await learner.save(counting) == 1
    kv = await counting.get(store_key("training", "M3"))
    assert kv is not None
    assert b'"tasks":2' in kv.value


async def test_a_failed_save_is_written_next_time(counting: CountingStore) -> None:
    learner = taught({"a": 1.0})
    counting.fail = True
    with pytest.raises(NotLeaderError):
        await learner.save(counting)
    counting.fail = False
    assert await learner.save(counting) == 2


async def test_unreadable_entries_are_skipped(store: SqliteStore) -> None:
    await store.commit(
        [
            Put(store_key("training", "T4"), b"not json"),
            Put(store_key("training", "V100"), b'{"tasks": 3, "mean": 0.0, "variance": -1}'),
            Put(PREFIX + "a/b/c/d", b'{"tasks": 3, "mean": 0.0, "variance": 0}'),
            Put(store_key("training", "L40S"), b'{"tasks": 5, "mean": 0.0, "variance": 0}'),
        ]
    )
    learner = SpeedLearner(metrics=False)
    assert await learner.load(store) == 1
    assert learner.overrides("training", {}) == {"L40S": 1.0}


def test_odd_names_make_distinct_keys() -> None:
    assert store_key("training", "a/b") != store_key("training", "a", "b")
    assert store_key("", "T4") == store_key("training", "T4") == "/learning/training/T4"
    assert store_key("training", "T4", "site-1") == "/learning/training/T4/site-1"


async def test_saver_batches_writes_and_saves_when_stopped(counting: CountingStore) -> None:
    learner = SpeedLearner(metrics=False)
    saver = LearningSaver(learner, counting, interval_s=60.0, batch=5, min_gap_s=0.0)
    task = asyncio.create_task(saver.run())
    for _ in range(4):
        learner.observe("training", "T4", 10.0, 10.0, 20.0)
        await asyncio.sleep(0.01)
    assert counting.commits == []  # fewer than a batch, long before the interval
    learner.observe("training", "T4", 10.0, 10.0, 20.0)
    async with asyncio.timeout(2.0):
        await counting.committed.wait()
    assert counting.commits == [1]  # five tasks, one put
    learner.observe("training", "V100", 10.0, 10.0, 20.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert counting.commits == [1, 1]
    fresh = SpeedLearner(metrics=False)
    assert await fresh.load(counting) == 2


async def test_saver_writes_after_an_interval_despite_failures(counting: CountingStore) -> None:
    interval_s = 0.05
    learner = SpeedLearner(metrics=False)
    saver = LearningSaver(learner, counting, interval_s=interval_s, batch=1000, min_gap_s=0.0)
    counting.fail = True
    learner.observe("training", "T4", 10.0, 10.0, 20.0)
    task = asyncio.create_task(saver.run())
    async with asyncio.timeout(2.0):
        while counting.attempts < 2:  # it tried, failed, and tried again
            counting.attempted.clear()
            await counting.attempted.wait()
    assert counting.commits == []
    assert not task.done()
    counting.fail = False
    async with asyncio.timeout(2.0):
        await counting.committed.wait()
    attempts = counting.attempts
    await asyncio.sleep(4 * interval_s)  # four intervals with nothing new: no timer writes
    assert counting.commits == [1]
    assert counting.attempts == attempts  # not even tried
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_a_slow_site_gets_its_own_factor() -> None:
    learner = taught({"slow": 0.25, "fast": 1.0, "usual": 1.0})
    model = learner.speed("training", "T4")
    assert model is not None
    assert 0.25 < model < 1.0
    assert learner.site_factor("slow", "training", "T4") == pytest.approx(0.25 / model)
    assert learner.speed("training", "T4", "slow") == pytest.approx(0.25)
    assert learner.overrides("training", {}, site="slow") == {"T4": pytest.approx(0.25)}
    assert learner.overrides("training", {}, site="fast") == {"T4": pytest.approx(1.0)}
    # A site nobody ran on, another class, or the task's own speeds: no factor.
    assert learner.site_factor("elsewhere", "training", "T4") == 1.0
    assert learner.overrides("training", {}, site="elsewhere") == {"T4": pytest.approx(model)}
    assert learner.overrides("training", {"T4": 0.3}, site="slow") == {"T4": 0.3}
    assert learner.site_factor("slow", "inference", "T4") == 1.0
    # The site's own spread is its error; the model's mixes the sites.
    assert learner.error("training", "T4", "slow") == pytest.approx(0.0)
    assert learner.error("training", "T4") > 0.1


def test_a_site_needs_a_few_tasks_of_its_own() -> None:
    learner = taught({"a": 1.0}, tasks=MIN_TASKS)
    for _ in range(MIN_TASKS - 1):
        learner.observe("training", "T4", 60.0, 60.0, 240.0, site="b")
    assert learner.site_factor("b", "training", "T4") == 1.0
    learner.observe("training", "T4", 60.0, 60.0, 240.0, site="b")
    factor = learner.site_factor("b", "training", "T4")
    model = learner.speed("training", "T4")
    assert model is not None
    assert factor * model == pytest.approx(0.25)
    assert math.isclose(learner.speed("training", "T4", "b") or 0, 0.25)


def test_the_model_api_is_unchanged_without_sites() -> None:
    """What the scheduler calls today: ``overrides(workload_class, speeds)``, ``error``."""
    learner = SpeedLearner(metrics=False)
    for _ in range(MIN_TASKS):
        learner.observe("training", "H100-80GB", 60.0, 24.0, 30.0)
    assert learner.overrides("training", {}) == {"H100-80GB": pytest.approx(2.0)}
    assert learner.error("training", "H100-80GB") == 0.0
    assert learner.learned() == {"training": {"H100-80GB": pytest.approx(2.0)}}
