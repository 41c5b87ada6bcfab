"""The policies the simulator compares, each a placement profile of the real framework.

``completion-time`` is the coordinator's default profile, and ``energy`` is that profile
tuned to save power. The others stand for what federations run today; they share the default
filters (so every policy places only where a task fits) and differ in how they rank the sites
that can take it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from federation.config import ConfigError, read_toml
from federation.placement.framework import Framework
from federation.placement.registry import DEFAULT_FILTERS, DEFAULT_SCORERS, build_framework
from federation.placement.request import Request

# The default profile's tie-breakers (cost, energy, balance), kept where a baseline would
# otherwise leave ties to site names.
_TIE_BREAKERS = {k: v for k, v in DEFAULT_SCORERS.items() if k != "CompletionTime"}
DEFAULT_POLICY = "completion-time"
"""The policy every other is compared with (energy saved, JCT change)."""
# The default profile with the energy term weighted up (0.05 -> 0.1) and Consolidation: among
# the sites within 5 % of the soonest estimated finish, those with room on nodes already in use
# (up to 0.3 x 100 points, against at most 5 points of completion time lost).
ENERGY_SCORERS: Mapping[str, float] = {**DEFAULT_SCORERS, "Energy": 0.1, "Consolidation": 0.3}


@dataclass(frozen=True, slots=True)
class Profile:
    """Filters in order and score weights, as a coordinator config states them."""

    filters: tuple[str, ...]
    scorers: Mapping[str, float]
    summary: str
    waits: str = ""
    """How a policy that ranks by estimated finish compares waiting for a busy site with
    starting now elsewhere: ``total`` (queue, transfer and run) or ``no-transfer`` (queue
    and run); empty: it never waits while some site can take the task now."""


PROFILES: Mapping[str, Profile] = {
    "completion-time": Profile(
        DEFAULT_FILTERS,
        DEFAULT_SCORERS,
        "the default: soonest estimated finish (queue + transfer + run, a busy site's predicted"
        " wait included), then cost, energy",
        waits="total",
    ),
    "energy": Profile(
        DEFAULT_FILTERS,
        ENERGY_SCORERS,
        "the default, but among sites within 5% of the soonest finish those with room on nodes"
        " already in use (Consolidation), and energy weighted up",
        waits="total",
    ),
    "round-robin": Profile(
        DEFAULT_FILTERS, {"RoundRobin": 1.0}, "sites take turns by arrival order"
    ),
    "static-weights": Profile(
        DEFAULT_FILTERS,
        {"StaticWeights": 1.0},
        "KubeFed-style: turns in proportion to each site's declared devices",
    ),
    "dynamic-weights": Profile(
        DEFAULT_FILTERS,
        {"FreeCapacity": 1.0},
        "Karmada-style: the site with the most available replicas for the task",
    ),
    "least-loaded": Profile(
        DEFAULT_FILTERS, {"LeastLoaded": 1.0}, "the site with the largest share of devices free"
    ),
    "data-local": Profile(
        (*DEFAULT_FILTERS, "DataLocal"),
        DEFAULT_SCORERS,
        "only sites holding the task's inputs (if any), ranked as the default",
        waits="total",
    ),
    "greedy": Profile(
        DEFAULT_FILTERS,
        {"RunTimeOnly": 1.0, **_TIE_BREAKERS},
        "bandwidth-unaware: soonest finish counting queue (predicted waits too) and run time,"
        " not transfer",
        waits="no-transfer",
    ),
}
DEFAULT_POLICIES: tuple[str, ...] = tuple(PROFILES)


class UnknownPolicyError(ValueError):
    """A policy name the simulator does not know."""


def profile(name: str) -> Profile:
    """The profile called ``name``."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(PROFILES)
        raise UnknownPolicyError(f"unknown policy {name!r} (known: {known})") from None


def build_policy(name: str) -> Framework:
    """The placement framework for policy ``name``."""
    chosen = profile(name)
    return build_framework(chosen.filters, chosen.scorers)


CONFIGURED = "configured"
"""The policy of a coordinator config's placement profile (``configured_profile``)."""


def configured_profile(path: Path) -> Profile:
    """The placement profile a coordinator config states (``placement_filters`` and
    ``placement_scores``, each the coordinator's default when absent), plugins from outside
    the project included: the simulator loads them as the coordinator does."""
    settings = read_toml(path)
    filters = settings.get("placement_filters", list(DEFAULT_FILTERS))
    scorers = settings.get("placement_scores", dict(DEFAULT_SCORERS))
    if not isinstance(filters, list) or not all(isinstance(f, str) for f in filters):
        raise ConfigError(f"{path}: placement_filters must be a list of plugin names")
    if not isinstance(scorers, dict) or not all(
        isinstance(w, int | float) and not isinstance(w, bool) for w in scorers.values()
    ):
        raise ConfigError(f"{path}: placement_scores must map plugin names to weights")
    return Profile(
        tuple(filters),
        {str(k): float(v) for k, v in scorers.items()},
        f"the placement profile of {path}",
        waits="total",
    )


# Which request fields each filter reads. Waiting tasks that agree on all of them pass and
# fail the same filters at the same time, so the simulator retries only the first of each
# such group when capacity frees. A filter missing here makes every request its own group.
_CAPACITY_FIELDS = (
    "replicas",
    "cpu",
    "memory_mib",
    "accelerator_kind",
    "accelerator_count",
    "accelerator_models",
    "accelerator_vendor",
    "accelerator_min_memory_mib",
    "node_labels",
    "fraction",
    "partition",
    "selector",
    "same_interconnect",
)
FILTER_FIELDS: Mapping[str, tuple[str, ...]] = {
    "SiteState": (),
    "Constraints": ("domains", "regions", "sites"),
    "ImagePolicy": ("image",),
    "Compatibility": ("requires",),
    "CapacityFit": _CAPACITY_FIELDS,
    # A budget depends on the estimated run (duration, speed) of the whole gang.
    "CostCap": ("max_cost_usd",),
    "DataLocal": ("inputs",),
}
_COST_FIELDS = (*_CAPACITY_FIELDS, "duration_s", "workload_class", "speed")


def feasibility_key(filters: tuple[str, ...], req: Request) -> object:
    """What decides whether ``req`` passes ``filters`` on a given snapshot.

    Two requests with equal keys are feasible at exactly the same sites at any moment.
    """
    if any(name not in FILTER_FIELDS for name in filters):
        return req
    fields = {f for name in filters for f in FILTER_FIELDS[name]}
    if "CostCap" in filters and req.max_cost_usd > 0:
        fields.update(_COST_FIELDS)
    return tuple((f, getattr(req, f)) for f in sorted(fields))
