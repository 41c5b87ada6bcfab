"""The job's domain, region and site constraints."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from federation.jobspec import domain_name
from federation.placement.framework import Verdict
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot


class Constraints:
    name: ClassVar[str] = "Constraints"

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        mask = np.ones(snap.n_sites, dtype=bool)
        reasons: dict[int, str] = {}
        if req.domains:
            ok = np.isin(snap.domain, list(req.domains))
            wanted = ", ".join(sorted(domain_name(d) for d in req.domains))
            for i in np.flatnonzero(mask & ~ok):
                reasons[int(i)] = (
                    f"job wants domain {wanted}, site is {domain_name(int(snap.domain[i]))}"
                )
            mask &= ok
        if req.regions:
            ok = np.isin(snap.region, list(req.regions))
            for i in np.flatnonzero(mask & ~ok):
                reasons[int(i)] = f"job wants region {', '.join(sorted(req.regions))}"
            mask &= ok
        if req.sites:
            ok = np.isin(np.array(snap.site_ids, dtype=object), list(req.sites))
            for i in np.flatnonzero(mask & ~ok):
                reasons[int(i)] = f"job wants site {', '.join(sorted(req.sites))}"
            mask &= ok
        return Verdict(mask=mask, reasons=reasons)
