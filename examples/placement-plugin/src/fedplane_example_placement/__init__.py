"""Example placement plugins: a filter and a scorer over the framework's snapshot arrays."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from federation.placement.framework import Verdict
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot


def _sites_with_label(snap: Snapshot, key: str, value: str) -> npt.NDArray[np.bool_]:
    """Per site: whether any of its nodes has the label ``key: value``."""
    marked = np.zeros(snap.n_sites, dtype=bool)
    for node, labels in enumerate(snap.node_labels):
        if labels.get(key) == value:
            marked[snap.node_site[node]] = True
    return marked


class AvoidMaintenance:
    """Rejects sites any of whose nodes an operator labelled ``maintenance: "true"``."""

    name = "AvoidMaintenance"

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        return Verdict(
            mask=~_sites_with_label(snap, "maintenance", "true"),
            default_reason='a node of the site is labelled maintenance: "true"',
            default_code="IN_MAINTENANCE",
        )


class RenewablePower:
    """Prefers sites with a node labelled ``power: renewable``."""

    name = "RenewablePower"

    def score(
        self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float64]:
        green = _sites_with_label(snap, "power", "renewable")
        return np.where(green[feasible], 100.0, 0.0)
