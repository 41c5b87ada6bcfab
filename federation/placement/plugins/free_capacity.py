"""Prefer sites with the most room left for this kind of task (spreads load)."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import numpy.typing as npt

from federation.placement.plugins.capacity_fit import replicas_per_node
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot


class FreeCapacity:
    name: ClassVar[str] = "FreeCapacity"

    def score(
        self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float64]:
        per_node = replicas_per_node(req, snap, cap=float(1 << 20))
        per_site = np.bincount(snap.node_site, weights=per_node, minlength=snap.n_sites)[feasible]
        top = per_site.max() if len(per_site) else 0.0
        if top <= 0 or not np.isfinite(top):
            return np.full(len(feasible), 100.0)
        return np.asarray(100.0 * per_site / top, dtype=np.float64)
