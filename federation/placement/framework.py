"""The placement framework: filters narrow the sites, scorers rank the survivors.

Plugins are pure functions of an immutable ``Snapshot``; the framework checks their output
(shapes, finiteness, score range), applies weights and breaks ties by site name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from federation.placement.request import Request
from federation.placement.snapshot import Snapshot


@dataclass(frozen=True, slots=True)
class Verdict:
    """A filter's answer: which sites pass, and why each failing one fails."""

    mask: npt.NDArray[np.bool_]
    reasons: dict[int, str] = field(default_factory=dict)
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


@dataclass(frozen=True, slots=True)
class Decision:
    """Feasible sites best first, with their scores, and why every other site was rejected."""

    ranked: tuple[str, ...]
    scores: tuple[float, ...]
    rejections: tuple[Rejection, ...]
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
        rejections: list[Rejection] = []
        for plugin in self.filters:
            verdict = plugin.filter(req, snap)
            if verdict.mask.shape != alive.shape or verdict.mask.dtype != np.bool_:
                raise PluginContractError(plugin.name, "filter mask has the wrong shape or dtype")
            newly_rejected = np.flatnonzero(alive & ~verdict.mask)
            for i in newly_rejected:
                reason = verdict.reasons.get(int(i), verdict.default_reason)
                rejections.append(Rejection(snap.site_ids[i], plugin.name, reason))
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
        names = np.array([snap.site_ids[i] for i in feasible], dtype=object)
        order = np.lexsort((names, -total)) if len(feasible) else np.array([], dtype=np.int64)
        return Decision(
            ranked=tuple(str(names[i]) for i in order),
            scores=tuple(float(total[i]) for i in order),
            rejections=tuple(sorted(rejections, key=lambda r: r.site)),
            terms={name: tuple(float(v[i]) for i in order) for name, v in terms.items()},
        )
