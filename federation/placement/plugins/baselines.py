"""Placement rules that stand for what federations run today, as plugins for comparison.

None of these is a default: the simulator (``federation/sim``) builds profiles from them to
measure the completion-time policy against round-robin, static weights (KubeFed's
ReplicaSchedulingPreference), least-loaded, data-local and a bandwidth-unaware greedy.
Karmada's dynamic weights by available replicas is the existing ``FreeCapacity`` scorer.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import numpy.typing as npt

from federation.placement.estimates import estimate
from federation.placement.framework import Code, Verdict
from federation.placement.plugins.capacity_fit import matching_classes
from federation.placement.plugins.completion_time import lower_is_better
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot

F64 = npt.NDArray[np.float64]
# Frac(n * phi) is evenly spread over [0, 1) for n = 0, 1, 2... (a low-discrepancy sequence),
# so turns taken by sequence number land on each site in proportion to its weight.
GOLDEN = (5**0.5 - 1) / 2
RUNNER_UP = 99.0
"""Highest score of a site that is not the one whose turn it is."""


class RoundRobin:
    """Sites take turns by the task's sequence number; declines go on to the next site."""

    name: ClassVar[str] = "RoundRobin"

    def score(self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]) -> F64:
        n = max(snap.n_sites, 1)
        distance = (feasible - req.sequence % n) % n
        return np.asarray(100.0 * (1.0 - distance / n), dtype=np.float64)


def total_devices(req: Request, snap: Snapshot) -> F64:
    """Per site: every device of the kind asked for, busy or not (nodes for CPU-only work)."""
    if not req.wants_accelerator or not len(snap.classes):
        return np.bincount(snap.node_site, minlength=snap.n_sites).astype(np.float64)
    matching = matching_classes(req, snap)[snap.device_class]
    counts = np.bincount(snap.device_site, weights=matching, minlength=snap.n_sites)
    return np.asarray(counts, dtype=np.float64)


class StaticWeights:
    """KubeFed-style static weights: each site's share is its declared size, whatever its load.

    The site whose turn it is (by the task's sequence number, in proportion to the weights of
    the sites that can take the task) scores 100; the others follow by weight.
    """

    name: ClassVar[str] = "StaticWeights"

    def score(self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]) -> F64:
        weights = total_devices(req, snap)[feasible]
        if not len(feasible) or weights.sum() <= 0:
            return np.full(len(feasible), 100.0)
        turn = (req.sequence * GOLDEN) % 1.0
        bounds = np.cumsum(weights) / weights.sum()
        chosen = min(int(np.searchsorted(bounds, turn, side="right")), len(feasible) - 1)
        scores = RUNNER_UP * weights / weights.max()
        scores[chosen] = 100.0
        return np.asarray(scores, dtype=np.float64)


class LeastLoaded:
    """Prefer the site with the largest share of its devices free (all kinds)."""

    name: ClassVar[str] = "LeastLoaded"

    def score(self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]) -> F64:
        site = snap.device_site
        total = np.bincount(site, minlength=snap.n_sites).astype(np.float64)
        free = np.bincount(site, weights=snap.device_available, minlength=snap.n_sites)
        share = np.divide(free, total, out=np.ones(snap.n_sites), where=total > 0)
        return np.asarray(100.0 * share[feasible], dtype=np.float64)


class RunTimeOnly:
    """Bandwidth-unaware greedy: the soonest finish counting queue and run time, no transfer."""

    name: ClassVar[str] = "RunTimeOnly"

    def score(self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]) -> F64:
        est = estimate(req, snap)
        return lower_is_better((est.queue_s + est.run_s)[feasible])


class DataLocal:
    """Run where the data is: only sites that hold every input of the task (if it has any)."""

    name: ClassVar[str] = "DataLocal"

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        mask = np.ones(snap.n_sites, dtype=bool)
        for item in req.inputs:
            holders = np.zeros(snap.n_sites, dtype=bool)
            if item.site:
                source = snap.site_index(item.site)
                if source is not None:
                    holders[source] = True
            else:
                holders[snap.holders(item.dataset)] = True
            mask &= holders
        names = ", ".join(sorted({i.dataset for i in req.inputs}))
        return Verdict(
            mask=mask,
            default_reason=f"data-local: site does not hold {names}",
            default_code=Code.DATA_NOT_LOCAL,
        )
