"""The placement framework: filters narrow the sites, scorers rank the survivors.

Plugins are pure functions of an immutable ``Snapshot``; the framework checks their output
(shapes, finiteness, score range), applies weights and breaks ties by site name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from federation.placement.request import Request
from federation.placement.snapshot import Snapshot


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


class FilterPlugin(Protocol):
    name: ClassVar[str]

    def filter(self, req: Request, snap: Snapshot) -> Verdict: ...


class ScorePlugin(Protocol):
    name: ClassVar[str]

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


class Rejections(Sequence[Rejection]):
    """Rejections built only when read: at thousands of sites, writing every reason is
    the slowest part of a decision, and most decisions only need the ranking."""

    def __init__(
        self, site_ids: tuple[str, ...], parts: list[tuple[str, npt.NDArray[np.int64], Verdict]]
    ) -> None:
        self._site_ids = site_ids
        self._parts = parts
        self._items: tuple[Rejection, ...] | None = None

    def _all(self) -> tuple[Rejection, ...]:
        if self._items is None:
            items = [
                Rejection(
                    self._site_ids[i],
                    plugin,
                    verdict.reasons.get(int(i), verdict.default_reason),
                )
                for plugin, indices, verdict in self._parts
                for i in indices
            ]
            self._items = tuple(sorted(items, key=lambda r: r.site))
        return self._items

    def __len__(self) -> int:
        return sum(len(indices) for _, indices, _ in self._parts)

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
    terms: dict[str, tuple[float, ...]] = field(default_factory=dict)
    """Plugin name -> its normalised score for each ranked site (the breakdown of ``scores``)."""


class Framework:
    """Runs a profile: filters in order, then the weighted sum of scores."""

    def __init__(
        self, filters: Sequence[FilterPlugin], scorers: Sequence[tuple[ScorePlugin, float]]
    ) -> None:
        self.filters = tuple(filters)
        self.scorers = tuple(scorers)

    def place(self, req: Request, snap: Snapshot) -> Decision:
        alive = np.ones(snap.n_sites, dtype=bool)
        rejected: list[tuple[str, npt.NDArray[np.int64], Verdict]] = []
        for plugin in self.filters:
            verdict = plugin.filter(req, snap)
            if verdict.mask.shape != alive.shape or verdict.mask.dtype != np.bool_:
                raise PluginContractError(plugin.name, "filter mask has the wrong shape or dtype")
            newly_rejected = np.flatnonzero(alive & ~verdict.mask)
            if len(newly_rejected):
                rejected.append((plugin.name, newly_rejected, verdict))
            alive &= verdict.mask
        feasible = np.flatnonzero(alive).astype(np.int64)
        total = np.zeros(len(feasible), dtype=np.float64)
        terms: dict[str, npt.NDArray[np.float64]] = {}
        for scorer, weight in self.scorers:
            if len(feasible) == 0:
                break
            s = scorer.score(req, snap, feasible)
            if s.shape != total.shape or not np.all(np.isfinite(s) & (s >= 0) & (s <= 100)):
                raise PluginContractError(scorer.name, "score outside [0, 100] or wrong shape")
            terms[scorer.name] = s
            total += weight * s
        # Snapshot sites are sorted by name, so index order breaks ties by name.
        order = np.lexsort((feasible, -total))
        names = site_names(snap)
        return Decision(
            ranked=tuple(names[feasible[order]].tolist()),
            scores=tuple(total[order].tolist()),
            rejections=Rejections(snap.site_ids, rejected),
            terms={name: tuple(v[order].tolist()) for name, v in terms.items()},
        )


def site_names(snap: Snapshot) -> npt.NDArray[np.object_]:
    """The site names as an array (kept on the snapshot for reuse)."""
    names = snap.memo.get("site_names")
    if names is None:
        names = snap.memo["site_names"] = np.array(snap.site_ids, dtype=object)
    result: npt.NDArray[np.object_] = names  # type: ignore[assignment]
    return result
