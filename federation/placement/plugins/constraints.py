"""The job's domain, region and site constraints."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from federation.jobspec import domain_name
from federation.placement.framework import Code, LazyReasons, Verdict
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot


class Constraints:
    name: ClassVar[str] = "Constraints"

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        """Each rule is a check of its own: a site that breaks two is rejected twice."""
        checks: list[Verdict] = []
        if req.domains:
            ok = np.isin(snap.domain, list(req.domains))
            wanted = ", ".join(sorted(domain_name(d) for d in req.domains))

            def domain_reason(i: int) -> str:
                return f"job wants domain {wanted}, site is {domain_name(int(snap.domain[i]))}"

            checks.append(
                Verdict(
                    mask=ok,
                    reasons=LazyReasons(np.flatnonzero(~ok), domain_reason),
                    default_code=Code.DOMAIN_NOT_ALLOWED,
                )
            )
        if req.regions:
            ok = np.isin(snap.region, list(req.regions))
            checks.append(
                Verdict(
                    mask=ok,
                    default_reason=f"job wants region {', '.join(sorted(req.regions))}",
                    default_code=Code.REGION_NOT_ALLOWED,
                )
            )
        if req.sites:
            ok = np.isin(np.array(snap.site_ids, dtype=object), list(req.sites))
            checks.append(
                Verdict(
                    mask=ok,
                    default_reason=f"job wants site {', '.join(sorted(req.sites))}",
                    default_code=Code.SITE_NOT_ALLOWED,
                )
            )
        return Verdict.all_of(snap.n_sites, *checks)
