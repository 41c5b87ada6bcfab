"""The framework's contract checks, weighting, tie-breaking and rejection bookkeeping."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import numpy as np
import numpy.typing as npt
import pytest

from federation.placement.framework import (
    Code,
    Decision,
    Framework,
    PluginContractError,
    Rejection,
    Verdict,
)
from federation.placement.loading import UnknownPluginError
from federation.placement.registry import build_framework
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot

from .builders import GPU, device, node, request, site, snapshot

SNAP = snapshot(site("c", node()), site("a", node()), site("b", node()))


class KeepAll:
    name: ClassVar[str] = "KeepAll"

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        return Verdict(mask=np.ones(snap.n_sites, dtype=bool))


class Reject:
    """Rejects the named sites, with a per-site reason for some and a default for the rest."""

    name: ClassVar[str] = "Reject"

    def __init__(
        self, sites: set[str], reasons: Mapping[str, str] | None = None, default: str = ""
    ) -> None:
        self.sites = sites
        self.reasons = dict(reasons or {})
        self.default = default

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        mask = np.array([s not in self.sites for s in snap.site_ids], dtype=bool)
        reasons = {i: self.reasons[s] for i, s in enumerate(snap.site_ids) if s in self.reasons}
        return Verdict(mask=mask, reasons=reasons, default_reason=self.default)


class RejectToo(Reject):
    name: ClassVar[str] = "RejectToo"


class BadMaskShape:
    name: ClassVar[str] = "BadMaskShape"

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        return Verdict(mask=np.ones(snap.n_sites + 1, dtype=bool))


class BadMaskDtype:
    name: ClassVar[str] = "BadMaskDtype"

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        return Verdict(mask=np.ones(snap.n_sites, dtype=np.int64))


class Fixed:
    """Scores each site from a table; sites missing from it score ``default``."""

    name: ClassVar[str] = "Fixed"

    def __init__(self, by_site: Mapping[str, float] | None = None, default: float = 50.0) -> None:
        self.by_site = dict(by_site or {})
        self.default = default
        self.calls = 0

    def score(
        self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float64]:
        self.calls += 1
        return np.array(
            [self.by_site.get(snap.site_ids[i], self.default) for i in feasible], dtype=np.float64
        )


class BadScoreShape:
    name: ClassVar[str] = "BadScoreShape"

    def score(
        self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float64]:
        return np.zeros(len(feasible) + 1)


REQ = request(cpu=1)


@pytest.mark.parametrize("plugin", [BadMaskShape(), BadMaskDtype()], ids=["shape", "dtype"])
def test_filter_with_wrong_mask_raises_contract_error(plugin: BadMaskShape) -> None:
    """A filter whose mask has the wrong shape or dtype is reported as a bug in that plugin."""
    with pytest.raises(PluginContractError, match=plugin.name):
        Framework([KeepAll(), plugin], []).place(REQ, SNAP)


@pytest.mark.parametrize("value", [100.0001, -0.5, float("nan"), float("inf"), -float("inf"), 1e9])
def test_score_outside_range_raises_contract_error(value: float) -> None:
    """A score that is not finite or falls outside [0, 100] is a bug in the scorer."""
    scorer = Fixed({"b": value})
    with pytest.raises(PluginContractError, match="Fixed"):
        Framework([KeepAll()], [(scorer, 1.0)]).place(REQ, SNAP)


@pytest.mark.parametrize("value", [0.0, 100.0])
def test_scores_on_the_range_bounds_are_accepted(value: float) -> None:
    """Scores of exactly 0 and exactly 100 are within the contract."""
    decision = Framework([KeepAll()], [(Fixed(default=value), 1.0)]).place(REQ, SNAP)
    assert decision.scores == (value, value, value)


def test_score_with_wrong_shape_raises_contract_error() -> None:
    """A scorer returning one score too many is reported as a contract error."""
    with pytest.raises(PluginContractError, match="BadScoreShape"):
        Framework([KeepAll()], [(BadScoreShape(), 1.0)]).place(REQ, SNAP)


def test_scorers_are_not_run_when_nothing_is_feasible() -> None:
    """With every site filtered out, no scorer runs and nothing is ranked."""
    scorer = Fixed()
    decision = Framework([Reject({"a", "b", "c"})], [(scorer, 1.0)]).place(REQ, SNAP)
    assert scorer.calls == 0
    assert decision.ranked == ()
    assert decision.scores == ()


def test_ties_are_broken_by_site_name() -> None:
    """Sites with equal totals are ranked in name order."""
    decision = Framework([KeepAll()], [(Fixed(default=42.0), 1.0)]).place(REQ, SNAP)
    assert decision.ranked == ("a", "b", "c")


def test_higher_total_ranks_before_name_order() -> None:
    """The best total comes first; only equal totals fall back to the name."""
    scorer = Fixed({"a": 10.0, "b": 90.0, "c": 90.0})
    decision = Framework([KeepAll()], [(scorer, 1.0)]).place(REQ, SNAP)
    assert decision.ranked == ("b", "c", "a")
    assert decision.scores == (90.0, 90.0, 10.0)


def test_weights_multiply_each_scorer_before_summing() -> None:
    """The total is the weighted sum of the scorers' scores."""
    first = Fixed({"a": 100.0, "b": 0.0, "c": 50.0})
    second = Fixed({"a": 0.0, "b": 100.0, "c": 50.0})
    decision = Framework([KeepAll()], [(first, 1.0), (second, 3.0)]).place(REQ, SNAP)
    assert dict(zip(decision.ranked, decision.scores, strict=True)) == {
        "b": 300.0,
        "c": 200.0,
        "a": 100.0,
    }


def test_rejection_carries_the_first_plugin_that_rejected() -> None:
    """A site rejected by two filters is recorded once, under the first filter to reject it."""
    framework = Framework(
        [Reject({"a"}, {"a": "first"}), RejectToo({"a", "b"}, {"a": "second", "b": "too"})], []
    )
    decision = framework.place(REQ, SNAP)
    assert decision.rejections == (
        Rejection("a", "Reject", "first", Code.FILTER_REJECTED),
        Rejection("b", "RejectToo", "too", Code.FILTER_REJECTED),
    )
    assert decision.ranked == ("c",)


def test_rejection_falls_back_to_the_default_reason() -> None:
    """A failing site without its own reason gets the verdict's default reason."""
    decision = Framework([Reject({"b", "c"}, {"c": "own"}, default="generic")], []).place(REQ, SNAP)
    assert decision.rejections == (
        Rejection("b", "Reject", "generic", Code.FILTER_REJECTED),
        Rejection("c", "Reject", "own", Code.FILTER_REJECTED),
    )


def test_rejections_are_sorted_by_site() -> None:
    """Rejections come out in site-name order, whichever filter produced them."""
    framework = Framework([Reject({"c"}), RejectToo({"a", "b"})], [])
    decision = framework.place(REQ, SNAP)
    assert [r.site for r in decision.rejections] == ["a", "b", "c"]
    assert [r.plugin for r in decision.rejections] == ["RejectToo", "RejectToo", "Reject"]


def test_empty_snapshot_gives_an_empty_decision() -> None:
    """Placing on a federation with no sites ranks and rejects nothing."""
    decision = build_framework().place(REQ, snapshot())
    assert decision == Decision(ranked=(), scores=(), rejections=())


def test_default_profile_places_on_the_roomiest_eligible_site() -> None:
    """The default profile filters by state, constraints and capacity; with completion times,
    costs and energy equal, the roomier site wins on balance."""
    snap = snapshot(
        site("busy", node(devices=[device(GPU)])),
        site("roomy", node(devices=[device(GPU)] * 4)),
        site("gone", node(devices=[device(GPU)] * 8), connected=False),
        site("cpu-only", node(cpu=64)),
    )
    decision = build_framework().place(request(cpu=1, kind=GPU, count=1), snap)
    assert decision.ranked == ("roomy", "busy")
    # CompletionTime 1.0, Cost 0.2, Energy 0.05 and NearRegion 1.0 (no region asked) give both
    # 100; FreeCapacity (0.1) splits them.
    assert decision.scores == (235.0, 227.5)
    assert decision.terms["FreeCapacity"] == (100.0, 25.0)
    assert [(r.site, r.plugin) for r in decision.rejections] == [
        ("cpu-only", "CapacityFit"),
        ("gone", "SiteState"),
    ]


def test_build_framework_follows_the_profile() -> None:
    """The profile picks the filters in order and the scorers with their weights."""
    framework = build_framework(["CapacityFit", "SiteState"], {"FreeCapacity": 2.5})
    assert [f.name for f in framework.filters] == ["CapacityFit", "SiteState"]
    assert [(s.name, w) for s, w in framework.scorers] == [("FreeCapacity", 2.5)]


@pytest.mark.parametrize(
    ("filters", "scorers", "match"),
    [
        (["SiteState", "Nope"], {}, "unknown filter plugin 'Nope'"),
        (["SiteState"], {"Nope": 1.0}, "unknown score plugin 'Nope'"),
        (["SiteState"], {"FreeCapacity": -1.0}, "negative weight"),
    ],
)
def test_build_framework_refuses_bad_profiles(
    filters: list[str], scorers: dict[str, float], match: str
) -> None:
    """Unknown plugin names and negative weights are refused when the profile is built."""
    with pytest.raises(UnknownPluginError, match=match):
        build_framework(filters, scorers)
