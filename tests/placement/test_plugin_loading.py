"""Placement plugins from outside the project: found by entry point or ``module:Class``, tried
on a sample federation before they are trusted, and disabled when they misbehave in a cycle."""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest

from federation.placement.framework import Verdict
from federation.placement.loading import UnknownPluginError
from federation.placement.registry import DEFAULT_FILTERS, build_framework
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot

from .builders import node, request, site, snapshot


class PassAll:
    name = "PassAll"

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        return Verdict(mask=np.ones(snap.n_sites, dtype=bool))


class WrongShape:
    name = "WrongShape"

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        return Verdict(mask=np.ones(snap.n_sites + 1, dtype=bool))


class Nameless:
    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        return Verdict(mask=np.ones(snap.n_sites, dtype=bool))


class NeedsArguments:
    name = "NeedsArguments"

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        return Verdict(mask=np.ones(snap.n_sites, dtype=bool))


class NoMethod:
    name = "NoMethod"


class Flaky:
    """Raises, is slow or answers out of range on real federations (not on the sample)."""

    name = "Flaky"
    mode = "raise"

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        if "real" in snap.site_ids:
            if Flaky.mode == "raise":
                raise RuntimeError("boom")
            time.sleep(0.05)
        return Verdict(mask=np.ones(snap.n_sites, dtype=bool))

    def score(
        self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float64]:
        top = 1000.0 if "real" in snap.site_ids else 100.0
        return np.full(len(feasible), top)


@pytest.fixture
def outside() -> Iterator[str]:
    """This module's plugins, importable as ``outside_test_plugins:NAME``."""
    module = types.ModuleType("outside_test_plugins")
    for cls in (PassAll, WrongShape, Nameless, NeedsArguments, NoMethod, Flaky):
        setattr(module, cls.__name__, cls)
    module.not_a_class = 3  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    yield module.__name__
    del sys.modules[module.__name__]


def test_a_plugin_named_by_module_and_class_joins_the_profile(outside: str) -> None:
    framework = build_framework((*DEFAULT_FILTERS, f"{outside}:PassAll"), {})
    assert [f.name for f in framework.filters][-1] == "PassAll"


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("no_such_module:Filter", "cannot be loaded: ModuleNotFoundError"),
        ("{m}:Missing", "cannot be loaded: AttributeError"),
        ("{m}:not_a_class", "is not a class"),
        ("{m}:NoMethod", "has no filter() method"),
        ("{m}:NeedsArguments", "cannot be made without arguments: TypeError"),
        ("{m}:Nameless", "has no name"),
        ("{m}:WrongShape", "failed on a sample federation: PluginContractError"),
        ("NoSuchPlugin", "none is published under that name in the entry-point group"),
    ],
)
def test_a_plugin_that_cannot_be_trusted_is_refused_naming_it(
    outside: str, name: str, problem: str
) -> None:
    name = name.format(m=outside)
    with pytest.raises(UnknownPluginError) as refused:
        build_framework((*DEFAULT_FILTERS, name), {})
    assert name in str(refused.value)
    assert problem in str(refused.value)


def test_the_example_package_is_found_by_its_entry_point_names() -> None:
    framework = build_framework((*DEFAULT_FILTERS, "AvoidMaintenance"), {"RenewablePower": 1.0})
    assert framework.filters[-1].name == "AvoidMaintenance"
    assert [s.name for s, _ in framework.scorers] == ["RenewablePower"]


@pytest.mark.parametrize("mode", ["raise", "slow"])
def test_a_filter_that_misbehaves_in_a_cycle_is_disabled_and_passes_every_site(
    outside: str, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Flaky, "mode", mode)
    told: list[tuple[str, str]] = []
    framework = build_framework(
        (*DEFAULT_FILTERS, f"{outside}:Flaky"),
        {},
        plugin_budget_s=0.01,
        on_disabled=lambda plugin, why: told.append((plugin, why)),
    )
    snap = snapshot(site("real", node()), site("other", node()))
    assert framework.place(request(cpu=1), snap).ranked == ("other", "real")
    assert len(told) == 1
    assert told[0][0] == "Flaky"
    assert ("RuntimeError: boom" if mode == "raise" else "over its 10 ms") in told[0][1]
    framework.place(request(cpu=1), snap)  # disabled: not called, not told again
    assert len(told) == 1


def test_a_scorer_out_of_range_is_disabled_and_ranks_no_site(outside: str) -> None:
    told: list[str] = []
    framework = build_framework(
        DEFAULT_FILTERS,
        {f"{outside}:Flaky": 1.0},
        on_disabled=lambda plugin, why: told.append(why),
    )
    decision = framework.place(request(cpu=1), snapshot(site("real", node()), site("b", node())))
    assert decision.ranked == ("b", "real")  # by name: the scorer gave each site 0
    assert decision.terms["Flaky"] == (0.0, 0.0)
    assert told == ["PluginContractError: placement plugin Flaky: score outside [0, 100]"]
