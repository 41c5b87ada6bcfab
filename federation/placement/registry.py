"""Plugin names to plugins, and the profile that says which run with what weight."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from federation.placement.compat import CompatTable, load_table_files
from federation.placement.framework import FilterPlugin, Framework, ScorePlugin
from federation.placement.loading import (
    BUDGET_S,
    FILTER_GROUP,
    SCORER_GROUP,
    Disabled,
    UnknownPluginError,
    construct,
    contained_filter,
    contained_scorer,
    find,
)
from federation.placement.plugins.baselines import (
    DataLocal,
    LeastLoaded,
    RoundRobin,
    RunTimeOnly,
    StaticWeights,
)
from federation.placement.plugins.capacity_fit import CapacityFit
from federation.placement.plugins.compatibility import Compatibility
from federation.placement.plugins.completion_time import CompletionTime
from federation.placement.plugins.constraints import Constraints
from federation.placement.plugins.cost import Cost, CostCap, Energy
from federation.placement.plugins.energy import Consolidation
from federation.placement.plugins.free_capacity import FreeCapacity
from federation.placement.plugins.image_policy import ImagePolicy
from federation.placement.plugins.near_region import NearRegion
from federation.placement.plugins.site_state import SiteState

FILTERS: Mapping[str, type[FilterPlugin]] = {
    p.name: p
    for p in (SiteState, Constraints, ImagePolicy, Compatibility, CapacityFit, CostCap, DataLocal)
}
SCORERS: Mapping[str, type[ScorePlugin]] = {
    p.name: p
    for p in (
        CompletionTime,
        Cost,
        Energy,
        FreeCapacity,
        RoundRobin,
        StaticWeights,
        LeastLoaded,
        RunTimeOnly,
        Consolidation,
        NearRegion,
    )
}

DEFAULT_FILTERS: tuple[str, ...] = (
    "SiteState",
    "Constraints",
    "ImagePolicy",
    "Compatibility",
    "CapacityFit",
    "CostCap",
)
# Finishing soonest dominates; cost, energy and balance break near-ties. NearRegion ranks
# first (the RTT a service asked for), and scores every site alike for other tasks.
DEFAULT_SCORERS: Mapping[str, float] = {
    "CompletionTime": 1.0,
    "Cost": 0.2,
    "Energy": 0.05,
    "FreeCapacity": 0.1,
    "NearRegion": 1.0,
}


def build_framework(
    filters: Sequence[str] = DEFAULT_FILTERS,
    scorers: Mapping[str, float] = DEFAULT_SCORERS,
    compat_table: Path | None = None,
    *,
    plugin_budget_s: float = BUDGET_S,
    on_disabled: Disabled | None = None,
) -> Framework:
    """A framework for a profile. Names are built-in plugins, plugins published in the
    entry-point groups ``fedplane.placement.filters``/``scorers``, or ``module:Class``; those
    from outside are tried on a sample federation here and contained while they run
    (``federation.placement.loading``). Unknown or failing plugins, and negative weights,
    raise ``UnknownPluginError``."""
    for name, weight in scorers.items():
        if weight < 0:
            raise UnknownPluginError(f"score plugin {name!r} has a negative weight")
    table = load_table_files((compat_table,) if compat_table else ())
    chosen_filters: list[FilterPlugin] = []
    for name in filters:
        outside = find(name, FILTERS, FILTER_GROUP, "filter")
        if outside is None:
            chosen_filters.append(_filter(name, table))
        else:
            plugin = construct(name, outside, "filter")
            chosen_filters.append(contained_filter(plugin, plugin_budget_s, on_disabled))
    chosen_scorers: list[tuple[ScorePlugin, float]] = []
    for name, weight in scorers.items():
        outside = find(name, SCORERS, SCORER_GROUP, "score")
        if outside is None:
            chosen_scorers.append((SCORERS[name](), weight))
        else:
            plugin = construct(name, outside, "score")
            chosen_scorers.append((contained_scorer(plugin, plugin_budget_s, on_disabled), weight))
    return Framework(chosen_filters, chosen_scorers)


def _filter(name: str, table: CompatTable) -> FilterPlugin:
    """A filter plugin; the two that read software requirements get the table."""
    if name == "Compatibility":
        return Compatibility(table)
    if name == "CapacityFit":
        return CapacityFit(table)
    return FILTERS[name]()
