"""Cloud cost: a filter for the job's budget and a score that prefers cheaper sites."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import numpy.typing as npt

from federation.placement.estimates import estimate
from federation.placement.framework import Code, LazyReasons, Verdict
from federation.placement.plugins.completion_time import lower_is_better
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot


class CostCap:
    name: ClassVar[str] = "CostCap"

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        if req.max_cost_usd <= 0:
            return Verdict(mask=np.ones(snap.n_sites, dtype=bool))
        cost = estimate(req, snap).cost_usd
        mask = cost <= req.max_cost_usd

        def reason(i: int) -> str:
            return f"estimated cost ${cost[i]:.2f} exceeds the job's ${req.max_cost_usd:.2f}"

        return Verdict(
            mask=mask,
            reasons=LazyReasons(np.flatnonzero(~mask), reason),
            default_code=Code.OVER_BUDGET,
        )


class Cost:
    name: ClassVar[str] = "Cost"

    def score(
        self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float64]:
        return lower_is_better(estimate(req, snap).cost_usd[feasible])


class Energy:
    name: ClassVar[str] = "Energy"

    def score(
        self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float64]:
        return lower_is_better(estimate(req, snap).energy_kwh[feasible])
