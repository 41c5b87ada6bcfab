"""The per-site forecast: arrivals fade over about an hour, run times are a recent mean, and
room frees by the committed estimates of the tasks there."""

from __future__ import annotations

import math

import pytest

from federation.coordinator.scheduling.forecast import ARRIVALS_TAU_S, SiteHistory
from federation.coordinator.scheduling.waits import Occupant

NOW = 1_000_000.0


def test_arrivals_per_hour_fade_with_age() -> None:
    history = SiteHistory()
    for i in range(6):
        history.arrived("a", NOW - 60 + 10 * i)
    (fresh,) = history.forecasts(["a"], {}, {}, NOW).values()
    assert fresh.arrivals_per_hour == pytest.approx(6.0, rel=0.02)  # a minute old at most
    (later,) = history.forecasts(["a"], {}, {}, NOW + ARRIVALS_TAU_S).values()
    assert later.arrivals_per_hour == pytest.approx(fresh.arrivals_per_hour / math.e)


def test_mean_run_time_is_plain_until_ten_tasks_then_favours_the_recent() -> None:
    history = SiteHistory()
    for ran_s in (10.0, 20.0, 30.0):
        history.ended("a", ran_s)
    history.ended("a", math.nan)  # never started: not a run time
    assert history.forecasts(["a"], {}, {})["a"].mean_run_s == pytest.approx(20.0)
    for _ in range(50):
        history.ended("a", 100.0)
    assert history.forecasts(["a"], {}, {})["a"].mean_run_s > 99.0


def test_room_frees_with_the_first_task_due_to_end() -> None:
    held = [
        Occupant(NOW + 30, ("n0",), 1.0, 0.0, 0, ""),
        Occupant(NOW + 5, ("n0",), 1.0, 0.0, 0, ""),
        Occupant(math.inf, ("n0",), 1.0, 0.0, 0, ""),  # no estimate
    ]
    forecasts = SiteHistory().forecasts(["a", "b"], {"a": held}, {"a": 2}, NOW)
    assert (forecasts["a"].tasks, forecasts["a"].waiting) == (3, 2)
    assert forecasts["a"].next_free_s == pytest.approx(5.0)
    assert forecasts["b"].next_free_s == -1.0
    assert forecasts["b"].arrivals_per_hour == 0.0
