"""Speeds learned from finished tasks, per workload class and device model."""

from __future__ import annotations

import math

import pytest

from federation.coordinator.scheduling.learning import MIN_TASKS, SpeedLearner


def test_the_table_stands_until_a_few_tasks_agree() -> None:
    learner = SpeedLearner()
    for _ in range(MIN_TASKS - 1):
        learner.observe("training", "H100-80GB", 60.0, 24.0, 30.0)
    assert learner.speed("training", "H100-80GB") is None
    assert learner.overrides("training", {}) == {}
    learner.observe("training", "H100-80GB", 60.0, 24.0, 30.0)
    assert learner.speed("training", "H100-80GB") == pytest.approx(2.0)
    assert learner.error("training", "H100-80GB") == pytest.approx(0.0)
    assert learner.overrides("training", {}) == {"H100-80GB": pytest.approx(2.0)}
    assert learner.overrides("inference", {}) == {}  # another workload class learns apart


def test_the_tasks_own_speeds_win() -> None:
    learner = SpeedLearner()
    for _ in range(MIN_TASKS):
        learner.observe("", "T4", 10.0, 80.0, 50.0)
    assert learner.overrides("training", {"T4": 0.3}) == {"T4": 0.3}


def test_spread_becomes_the_expected_error() -> None:
    learner = SpeedLearner()
    for ran in (20.0, 30.0, 45.0, 30.0, 20.0, 45.0):
        learner.observe("training", "A100-80GB", 30.0, 30.0, ran)
    assert 0.1 < learner.error("training", "A100-80GB") < 0.6
    speed = learner.speed("training", "A100-80GB")
    assert speed is not None
    assert 0.6 < speed < 1.5


@pytest.mark.parametrize(
    ("model", "duration", "ran"),
    [("", 60.0, 30.0), ("T4", 0.0, 30.0), ("T4", 60.0, 0.0), ("T4", math.inf, 1.0)],
)
def test_tasks_that_say_nothing_teach_nothing(model: str, duration: float, ran: float) -> None:
    learner = SpeedLearner()
    for _ in range(MIN_TASKS):
        learner.observe("training", model, duration, 10.0, ran)
    assert learner.overrides("training", {}) == {}
