"""Which acceptance gets the commit when a site answers a slower run time than estimated."""

from __future__ import annotations

import pytest

from federation.api.v1 import jobs_pb2
from federation.coordinator.scheduling.offers import (
    Negotiation,
    by_promise,
    commit_estimate,
    sooner_untried,
)

RANK = ["x", "y"]
ANSWERS = [("y", "r-y"), ("x", "r-x")]  # in the order they arrived


def negotiation() -> Negotiation:
    """x ranks first and should finish at 100 s; y at 150 s."""
    estimates = {
        "x": jobs_pb2.Estimate(queue_s=10, transfer_s=10, run_s=80, total_s=100, cost_usd=8),
        "y": jobs_pb2.Estimate(queue_s=0, transfer_s=50, run_s=100, total_s=150, cost_usd=1),
    }
    return Negotiation("job", "t", tuple(RANK), [], estimates)


def test_sites_that_keep_their_estimate_go_by_rank() -> None:
    n = negotiation()
    commit_estimate(n, "x", 80.0)
    commit_estimate(n, "y", 0.0)  # said nothing: placement's estimate stands
    assert [site for site, _ in by_promise(n, RANK, ANSWERS)] == ["x", "y"]


def test_a_site_slower_than_the_next_one_loses_the_commit() -> None:
    """x can only run it in 180 s (finishing at 200 s): y, which keeps its 150 s, wins; x's
    estimate is what x committed to, cost scaled with the run time."""
    n = negotiation()
    commit_estimate(n, "x", 180.0)
    assert [site for site, _ in by_promise(n, RANK, ANSWERS)] == ["y", "x"]
    assert n.estimates["x"].total_s == 200
    assert n.estimates["x"].cost_usd == pytest.approx(18)
    assert n.slower == {"x"}


def test_a_slower_site_that_still_finishes_first_keeps_it() -> None:
    n = negotiation()
    commit_estimate(n, "x", 120.0)  # finishes at 140 s, before y's 150 s
    assert [site for site, _ in by_promise(n, RANK, ANSWERS)] == ["x", "y"]


@pytest.mark.parametrize("run_s", [float("nan"), float("inf"), -5.0])
def test_a_nonsense_run_time_leaves_the_estimate(run_s: float) -> None:
    n = negotiation()
    commit_estimate(n, "x", run_s)
    assert n.estimates["x"].run_s == 80
    assert not n.slower


def test_a_lone_slower_acceptance_gives_way_to_an_untried_site_estimated_sooner() -> None:
    """x alone was offered (the first round) and can only finish at 200 s: y, not asked yet,
    was estimated at 150 s, so y is asked first and x again last; once only."""
    n = negotiation()
    commit_estimate(n, "x", 180.0)
    assert sooner_untried(n, "x", ["x"]) == "y"
    assert sooner_untried(n, "x", ["x", "y"]) is None  # y was asked in the same round
    n.deferred.add("x")
    assert sooner_untried(n, "x", ["x"]) is None  # let go once already
    fast = negotiation()
    commit_estimate(fast, "x", 120.0)  # 140 s: still sooner than y
    assert sooner_untried(fast, "x", ["x"]) is None
