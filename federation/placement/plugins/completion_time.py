"""Prefer the site where the task will finish soonest (queue + transfer + run)."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import numpy.typing as npt

from federation.placement.estimates import estimate
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot


def lower_is_better(values: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """Map costs to scores in [0, 100]: the cheapest 100, others by how close they come."""
    if not len(values):
        return values
    best = float(values.min())
    if not np.isfinite(best):
        return np.zeros(len(values))
    finite = np.where(np.isfinite(values), values, np.inf)
    if best <= 0:
        return np.where(finite <= 0, 100.0, 100.0 * 1.0 / (1.0 + finite))
    return np.asarray(100.0 * (best / finite), dtype=np.float64)  # best / best is exactly 1


class CompletionTime:
    name: ClassVar[str] = "CompletionTime"

    def score(
        self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float64]:
        return lower_is_better(estimate(req, snap).total_s[feasible])
