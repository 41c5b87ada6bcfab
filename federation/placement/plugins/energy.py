"""Consolidation: among the sites that finish a task about as soon as the best one, prefer
those already busy, so that work lands on nodes that are powered anyway and whole nodes (and
sites) can idle.

It is a tie-breaker weighed against completion time, not a rival to it: a site whose
estimated completion (queue + transfer + run, as ``CompletionTime`` reads it) is more than
``slack`` (5 %) later than the best feasible site's scores 0, whatever its load. Within the
slack a site scores

    100 x (0.9 x warm + 0.1 x busy)

where ``warm`` is the share of the task's replicas that fit on nodes with a device already in
use (so the task wakes no idle node there; the site's packer fills the fullest node that fits
first) and ``busy`` is the site's share of devices in use (unavailable devices count as in
use). Nothing else is read, so the score is a pure function of the snapshot.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import numpy.typing as npt

from federation.placement.estimates import estimate
from federation.placement.plugins.capacity_fit import replicas_per_node
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot

F64 = npt.NDArray[np.float64]
Bool = npt.NDArray[np.bool_]
SLACK = 0.05
"""How much later than the best estimate a site may finish and still be preferred."""
WARM_WEIGHT = 0.9
"""Weight of room on nodes already in use; the site's share of devices in use has the rest."""


def in_use(snap: Snapshot) -> tuple[Bool, F64]:
    """Per node: whether any of its devices is in use; per site: the share of devices in use
    (memoised on the snapshot)."""
    cached = snap.memo.get("consolidation_in_use")
    if cached is None:
        busy = (~snap.device_available).astype(np.float64)
        node_busy = np.bincount(snap.device_node, weights=busy, minlength=snap.n_nodes) > 0
        site = snap.device_site
        total = np.bincount(site, minlength=snap.n_sites).astype(np.float64)
        used = np.bincount(site, weights=busy, minlength=snap.n_sites)
        share = np.divide(used, total, out=np.zeros(snap.n_sites), where=total > 0)
        cached = snap.memo["consolidation_in_use"] = (node_busy, share)
    return cached  # type: ignore[return-value]


def near_best(req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64], slack: float) -> Bool:
    """Feasible sites whose estimated completion is within ``slack`` of the best one's."""
    total = estimate(req, snap).total_s[feasible]
    if not len(total):
        return np.zeros(0, dtype=bool)
    best = float(total.min())
    if not np.isfinite(best):
        return np.zeros(len(total), dtype=bool)
    return np.asarray(total <= best * (1.0 + slack) + 1e-9, dtype=bool)


class Consolidation:
    """Prefer busy sites and nodes already in use, among sites within ``slack`` of the
    soonest estimated completion (see the module's docstring)."""

    name: ClassVar[str] = "Consolidation"

    def __init__(self, slack: float = SLACK) -> None:
        if not slack >= 0:
            raise ValueError(f"slack must be >= 0, got {slack}")
        self.slack = slack

    def score(self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]) -> F64:
        if not len(feasible):
            return np.zeros(0)
        node_busy, busy_share = in_use(snap)
        room = np.where(node_busy, replicas_per_node(req, snap), 0.0)
        warm_room = np.bincount(snap.node_site, weights=room, minlength=snap.n_sites)
        warm = np.minimum(warm_room, req.replicas) / max(req.replicas, 1)
        score = 100.0 * (WARM_WEIGHT * warm + (1.0 - WARM_WEIGHT) * busy_share)
        near = near_best(req, snap, feasible, self.slack)
        return np.asarray(np.where(near, score[feasible], 0.0), dtype=np.float64)
