"""The placement framework: filters narrow the sites, scorers rank the survivors.

Plugins are pure functions of an immutable ``Snapshot``; the framework checks their output
(shapes, finiteness, score range), applies weights and breaks ties by site name. A scorer that
sets ``ranks_first`` orders the sites before the weighted total does (see ``ScorePlugin``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from federation.placement.request import Request
from federation.placement.snapshot import Snapshot


class Code(StrEnum):
    """Machine-readable reasons a filter rejects a site, one per check (see ``REASON_CODES``).

    ``fedctl jobs explain`` shows them beside each reason, and API clients may branch on them:
    a code keeps its name and meaning, while the reason text beside it may change.
    """

    SITE_UNREACHABLE = "SITE_UNREACHABLE"
    SITE_CORDONED = "SITE_CORDONED"
    DOMAIN_NOT_ALLOWED = "DOMAIN_NOT_ALLOWED"
    REGION_NOT_ALLOWED = "REGION_NOT_ALLOWED"
    SITE_NOT_ALLOWED = "SITE_NOT_ALLOWED"
    NO_NODES = "NO_NODES"
    REQUIREMENTS_UNMET = "REQUIREMENTS_UNMET"
    NO_DEVICE_OF_MODEL = "NO_DEVICE_OF_MODEL"
    INSUFFICIENT_DEVICE_MEMORY = "INSUFFICIENT_DEVICE_MEMORY"
    DEVICE_SELECTOR_UNMATCHED = "DEVICE_SELECTOR_UNMATCHED"
    NODE_LABELS_UNMATCHED = "NODE_LABELS_UNMATCHED"
    TOPOLOGY_UNMET = "TOPOLOGY_UNMET"
    INSUFFICIENT_FREE_CAPACITY = "INSUFFICIENT_FREE_CAPACITY"
    OVER_BUDGET = "OVER_BUDGET"
    DATA_NOT_LOCAL = "DATA_NOT_LOCAL"
    IMAGE_REFUSED = "IMAGE_REFUSED"
    FILTER_REJECTED = "FILTER_REJECTED"


REASON_CODES: Mapping[Code, tuple[str, str]] = {
    Code.SITE_UNREACHABLE: ("SiteState", "the site's agent is not connected"),
    Code.SITE_CORDONED: ("SiteState", "an operator cordoned the site: it takes no new work"),
    Code.DOMAIN_NOT_ALLOWED: ("Constraints", "the site is outside the job's domains"),
    Code.REGION_NOT_ALLOWED: ("Constraints", "the site is outside the job's regions"),
    Code.SITE_NOT_ALLOWED: ("Constraints", "the site is not among the job's sites"),
    Code.NO_NODES: ("Compatibility, CapacityFit", "the site reports no nodes"),
    Code.REQUIREMENTS_UNMET: (
        "Compatibility, CapacityFit",
        "no node meets the task's software requirements (drivers, runtimes, frameworks), or"
        " only such nodes have room",
    ),
    Code.NO_DEVICE_OF_MODEL: (
        "CapacityFit",
        "the site has no device of the kind, vendor and model(s) asked for, free or not",
    ),
    Code.INSUFFICIENT_DEVICE_MEMORY: (
        "CapacityFit",
        "the site has devices of that model, but none with the memory asked for",
    ),
    Code.DEVICE_SELECTOR_UNMATCHED: (
        "CapacityFit",
        "the site's devices of that model and memory all fail the task's device selector",
    ),
    Code.NODE_LABELS_UNMATCHED: ("CapacityFit", "no node has the job's node labels"),
    Code.TOPOLOGY_UNMET: (
        "CapacityFit",
        "the site has room for every replica, but not within one value of the topology level"
        " the task requires (one rack, say)",
    ),
    Code.INSUFFICIENT_FREE_CAPACITY: (
        "CapacityFit",
        "matching hardware exists, but not enough of its CPU, memory or devices is free now"
        " for every replica",
    ),
    Code.OVER_BUDGET: ("CostCap", "the estimated cost of one run exceeds the job's max_cost_usd"),
    Code.DATA_NOT_LOCAL: ("DataLocal", "the site does not hold every input of the task"),
    Code.IMAGE_REFUSED: (
        "ImagePolicy",
        "the site runs no task that names an image (its config, or no Podman), or not from"
        " the image's registry",
    ),
    Code.FILTER_REJECTED: ("any", "a filter that gives no code of its own rejected the site"),
}
"""Every reason code: the filters that give it, and what it means."""


CAPACITY_FILTER = "CapacityFit"
"""The filter that checks free room (``plugins.capacity_fit``)."""


class LazyReasons(Mapping[int, str]):
    """Reasons for the failing sites, each written when first read."""

    def __init__(self, failing: npt.NDArray[np.int64], explain: Callable[[int], str]) -> None:
        self._failing = failing
        self._explain = explain
        self._keys: frozenset[int] | None = None
        self._cache: dict[int, str] = {}

    def _key_set(self) -> frozenset[int]:
        if self._keys is None:
            self._keys = frozenset(self._failing.tolist())
        return self._keys

    def __getitem__(self, site: int) -> str:
        if site not in self._key_set():
            raise KeyError(site)
        if site not in self._cache:
            self._cache[site] = self._explain(site)
        return self._cache[site]

    def __iter__(self) -> Iterator[int]:
        return iter(self._failing.tolist())

    def __len__(self) -> int:
        return len(self._failing)


@dataclass(frozen=True, slots=True)
class Verdict:
    """A filter's answer: which sites pass, and why each failing one fails."""

    mask: npt.NDArray[np.bool_]
    reasons: Mapping[int, str] = field(default_factory=dict)
    """Site index -> reason, for failing sites; a missing entry uses ``default_reason``."""
    default_reason: str = ""
    codes: Mapping[int, str] = field(default_factory=dict)
    """Site index -> reason code (a ``Code``), for failing sites; else ``default_code``."""
    default_code: str = Code.FILTER_REJECTED
    checks: tuple[Verdict, ...] = ()
    """The independent checks ``mask`` is the conjunction of (see ``all_of``): a site that
    fails several is rejected once by each, with each one's code and reason."""

    @classmethod
    def all_of(cls, n_sites: int, *checks: Verdict) -> Verdict:
        """Sites that pass every check; ``reasons`` and ``codes`` are the first failing
        check's, ``why`` gives them all."""
        mask = np.ones(n_sites, dtype=bool)
        for check in checks:
            mask &= check.mask
        failing = np.flatnonzero(~mask)

        def first(site: int) -> Verdict:
            return next(c for c in checks if not c.mask[site])

        return cls(
            mask=mask,
            reasons=LazyReasons(failing, lambda site: first(site).reason(site)),
            codes=LazyReasons(failing, lambda site: first(site).code(site)),
            checks=checks,
        )

    def reason(self, site: int) -> str:
        return self.reasons.get(site, self.default_reason)

    def code(self, site: int) -> str:
        return self.codes.get(site, self.default_code)

    def why(self, site: int) -> list[tuple[str, str]]:
        """(code, reason) of every check that fails ``site``, a failing site: at least one."""
        failed = [pair for c in self.checks if not c.mask[site] for pair in c.why(site)]
        return failed or [(self.code(site), self.reason(site))]


class FilterPlugin(Protocol):
    @property
    def name(self) -> str: ...

    def filter(self, req: Request, snap: Snapshot) -> Verdict: ...


class ScorePlugin(Protocol):
    """A scorer; its weighted score is added to each feasible site's total.

    One may also set ``ranks_first = True`` (a class attribute, absent means False): sites are
    then ordered by its weighted score first, and the total orders only sites whose scores
    tie. For what a task asks outright (``NearRegion``), not for one more trade-off; its
    weight still adds to the total, and 0 turns it off as for any scorer.
    """

    @property
    def name(self) -> str: ...

    def score(
        self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float64]:
        """Scores in [0, 100] for the feasible site indices, higher is better."""
        ...


class PluginContractError(RuntimeError):
    """A plugin returned something the framework cannot use: a bug in that plugin."""

    def __init__(self, plugin: str, problem: str) -> None:
        super().__init__(f"placement plugin {plugin}: {problem}")


@dataclass(frozen=True, slots=True)
class Rejection:
    site: str
    plugin: str
    reason: str
    code: str = ""
    """Machine-readable reason: a ``Code``, or a code of a third-party plugin's own."""


class Rejections(Sequence[Rejection]):
    """Rejections built only when read: at thousands of sites, writing every reason is
    the slowest part of a decision, and most decisions only need the ranking.

    ``parts`` are (plugin, the sites it rejected first, its verdict), giving the first
    rejection of each site; with ``every``, parts are (plugin, None, verdict) and every
    failing check of every filter is a rejection, by site, then in profile order.
    """

    def __init__(
        self,
        site_ids: tuple[str, ...],
        parts: Sequence[tuple[str, npt.NDArray[np.int64] | None, Verdict]],
        *,
        every: bool = False,
    ) -> None:
        self._site_ids = site_ids
        self._parts = parts
        self._every = every
        self._items: tuple[Rejection, ...] | None = None

    def _all(self) -> tuple[Rejection, ...]:
        if self._items is None:
            items: list[Rejection] = []
            for plugin, indices, verdict in self._parts:
                failing = np.flatnonzero(~verdict.mask) if indices is None else indices
                for i in failing.tolist():
                    site = self._site_ids[i]
                    if self._every:
                        items.extend(Rejection(site, plugin, r, c) for c, r in verdict.why(i))
                    else:
                        items.append(Rejection(site, plugin, verdict.reason(i), verdict.code(i)))
            # A stable sort: each site's rejections stay in profile order.
            self._items = tuple(sorted(items, key=lambda r: r.site))
        return self._items

    def __len__(self) -> int:
        if self._every:
            return len(self._all())
        return sum(len(indices) for _, indices, _ in self._parts if indices is not None)

    def __getitem__(self, index: Any) -> Any:
        return self._all()[index]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and self._all() == tuple(other)

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return repr(self._all())


@dataclass(frozen=True, slots=True)
class Decision:
    """Feasible sites best first, with their scores, and why every other site was rejected."""

    ranked: tuple[str, ...]
    scores: tuple[float, ...]
    rejections: Sequence[Rejection]
    """The first filter (and its first failing check) that rejects each infeasible site."""
    terms: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Plugin name -> its normalised score for each ranked site (the breakdown of ``scores``)."""
    every_rejection: Sequence[Rejection] = ()
    """Every filter and check that rejects each site, by site, then in profile order; built
    only when read (``fedctl jobs explain``), from the masks every decision computes anyway."""
    verdicts: tuple[tuple[str, Verdict], ...] = field(default=(), compare=False)
    """Each filter's verdict, in profile order (the masks ``every_rejection`` reads)."""

    def short_of_room(self) -> npt.NDArray[np.int64]:
        """Sites that every filter would pass but for too little free capacity now: once
        room frees there they could take the task (``coordinator.waits``)."""
        if not self.verdicts:
            return np.zeros(0, dtype=np.int64)
        failures = np.zeros(len(self.verdicts[0][1].mask), dtype=np.int64)
        room: Verdict | None = None
        for name, verdict in self.verdicts:
            failures += ~verdict.mask
            if name == CAPACITY_FILTER:
                room = verdict
        if room is None:
            return np.zeros(0, dtype=np.int64)
        short = np.flatnonzero((failures == 1) & ~room.mask)
        keep = [i for i in short.tolist() if room.code(i) == Code.INSUFFICIENT_FREE_CAPACITY]
        return np.array(keep, dtype=np.int64)


class Framework:
    """Runs a profile: filters in order, then the weighted sum of scores."""

    def __init__(
        self, filters: Sequence[FilterPlugin], scorers: Sequence[tuple[ScorePlugin, float]]
    ) -> None:
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)

    def place(self, req: Request, snap: Snapshot) -> Decision:
        alive = np.ones(snap.n_sites, dtype=bool)
        rejected: list[tuple[str, npt.NDArray[np.int64] | None, Verdict]] = []
        verdicts: list[tuple[str, npt.NDArray[np.int64] | None, Verdict]] = []
        for plugin in self.filters:
            verdict = plugin.filter(req, snap)
            if verdict.mask.shape != alive.shape or verdict.mask.dtype != np.bool_:
                raise PluginContractError(plugin.name, "filter mask has the wrong shape or dtype")
            newly_rejected = np.flatnonzero(alive & ~verdict.mask)
            if len(newly_rejected):
                rejected.append((plugin.name, newly_rejected, verdict))
            verdicts.append((plugin.name, None, verdict))
            alive &= verdict.mask
        feasible = np.flatnonzero(alive).astype(np.int64)
        total = np.zeros(len(feasible), dtype=np.float64)
        first = np.zeros(len(feasible), dtype=np.float64)
        terms: dict[str, npt.NDArray[np.float64]] = {}
        for scorer, weight in self.scorers:
            if len(feasible) == 0:
                break
            s = scorer.score(req, snap, feasible)
            if s.shape != total.shape or not np.all(np.isfinite(s) & (s >= 0) & (s <= 100)):
                raise PluginContractError(scorer.name, "score outside [0, 100] or wrong shape")
            terms[scorer.name] = s
            total += weight * s
            if getattr(scorer, "ranks_first", False):
                first += weight * s
        # Snapshot sites are sorted by name, so index order breaks ties by name.
        order = np.lexsort((feasible, -total, -first))
        names = site_names(snap)
        return Decision(
            ranked=tuple(names[feasible[order]].tolist()),
            scores=tuple(total[order].tolist()),
            rejections=Rejections(snap.site_ids, rejected),
            terms={name: tuple(v[order].tolist()) for name, v in terms.items()},
            every_rejection=Rejections(snap.site_ids, verdicts, every=True),
            verdicts=tuple((name, verdict) for name, _, verdict in verdicts),
        )


def site_names(snap: Snapshot) -> npt.NDArray[np.object_]:
    """The site names as an array (kept on the snapshot for reuse)."""
    names = snap.memo.get("site_names")
    if names is None:
        names = snap.memo["site_names"] = np.array(snap.site_ids, dtype=object)
    result: npt.NDArray[np.object_] = names  # type: ignore[assignment]
    return result
