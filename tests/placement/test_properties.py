"""Properties of placement over random federations and random demands."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from federation.placement.framework import Framework
from federation.placement.plugins.free_capacity import FreeCapacity
from federation.placement.registry import build_framework
from federation.placement.request import Request
from federation.placement.snapshot import build_snapshot

from .strategies import PlacementCase, placement_cases

SETTINGS = settings(max_examples=80, deadline=None)
FRAMEWORK = build_framework()


def _request(case: PlacementCase) -> Request:
    return Request.from_spec(case.job, case.task)


@SETTINGS
@given(placement_cases())
def test_every_ranked_site_passes_every_filter_on_its_own(case: PlacementCase) -> None:
    """A ranked site (the chosen one first) passes each filter in a snapshot of itself alone."""
    req = _request(case)
    decision = FRAMEWORK.place(req, build_snapshot(case.sites))
    by_name = {s.view.site: s for s in case.sites}
    for name in decision.ranked:
        alone = build_snapshot([by_name[name]])
        for plugin in FRAMEWORK.filters:
            assert plugin.filter(req, alone).mask.tolist() == [True], (name, plugin.name)


@SETTINGS
@given(placement_cases())
def test_every_rejection_is_upheld_by_its_plugin_alone(case: PlacementCase) -> None:
    """The plugin named in a rejection rejects that site in a snapshot of the site alone."""
    req = _request(case)
    decision = FRAMEWORK.place(req, build_snapshot(case.sites))
    by_name = {s.view.site: s for s in case.sites}
    filters = {p.name: p for p in FRAMEWORK.filters}
    for rejection in decision.rejections:
        alone = build_snapshot([by_name[rejection.site]])
        assert filters[rejection.plugin].filter(req, alone).mask.tolist() == [False]
        assert rejection.reason


@SETTINGS
@given(placement_cases())
def test_every_site_is_ranked_or_rejected_exactly_once(case: PlacementCase) -> None:
    """The ranked sites and the rejected sites partition the federation, with no repeats."""
    decision = FRAMEWORK.place(_request(case), build_snapshot(case.sites))
    rejected = [r.site for r in decision.rejections]
    everything = list(decision.ranked) + rejected
    assert sorted(everything) == sorted(s.view.site for s in case.sites)
    assert len(decision.scores) == len(decision.ranked)


@SETTINGS
@given(
    placement_cases(),
    st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=3),
)
def test_scores_are_finite_bounded_and_best_first(
    case: PlacementCase, weights: list[float]
) -> None:
    """Totals are finite, within [0, 100 * sum(weights)], sorted best first then by name."""
    framework = Framework(FRAMEWORK.filters, [(FreeCapacity(), w) for w in weights])
    decision = framework.place(_request(case), build_snapshot(case.sites))
    bound = 100.0 * sum(weights)
    for score in decision.scores:
        assert math.isfinite(score)
        assert 0.0 <= score <= bound * (1 + 1e-12)
    keys = [(-s, name) for s, name in zip(decision.scores, decision.ranked, strict=True)]
    assert keys == sorted(keys)


@SETTINGS
@given(placement_cases(), st.randoms(use_true_random=False))
def test_site_order_does_not_change_the_decision(case: PlacementCase, rnd: object) -> None:
    """Shuffling the site inputs before building the snapshot gives the same decision."""
    req = _request(case)
    shuffled = list(case.sites)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert FRAMEWORK.place(req, build_snapshot(shuffled)) == FRAMEWORK.place(
        req, build_snapshot(case.sites)
    )


@SETTINGS
@given(placement_cases())
def test_same_snapshot_gives_same_decision(case: PlacementCase) -> None:
    """Placing twice on one snapshot, or on a rebuilt one, gives equal decisions."""
    req = _request(case)
    snap = build_snapshot(case.sites)
    first = FRAMEWORK.place(req, snap)
    assert FRAMEWORK.place(req, snap) == first
    assert build_framework().place(req, build_snapshot(case.sites)) == first
