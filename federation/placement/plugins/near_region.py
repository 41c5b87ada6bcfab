"""Prefer the sites with the shortest measured round trip to a region, for a service that asks
(``ServicePolicy.near_region``): a latency-sensitive service is best near its clients, and a
service never completes, so its estimated completion time says little about where it should go.

A site's RTT to the region is 0 when it is in the region, else its RTT to the nearest site of
the region over the link matrix (links the agents measured or declared; one way stands for the
other until that is measured too, as ``build_snapshot`` fills it). RTTs are compared in steps
of ``STEP_MS``: a link's RTT jitters by a few ms, so sites within one step tie and the rest of
the profile (completion time, cost, balance) picks among them. A site with no measured link to
any site of the region ranks after every measured one (the assumed ``UNKNOWN_RTT_MS`` is not
used). With no ``near_region``, or no known site in it yet, every site scores alike.

The framework orders sites by this score before the weighted total (``ranks_first``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from federation.placement.request import Request
from federation.placement.snapshot import Snapshot

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]

STEP_MS = 5.0
"""RTTs in the same step tie (0 to 4.9 ms, 5 to 9.9 ms, ...): within a step, the rest decides."""
HALF_SCORE_MS = 100.0
"""The RTT that scores 50 (0 ms scores 100); unmeasured scores 0."""
MAX_LISTED = 10
"""Sites whose RTT ``describe`` names (best ranked first)."""


def rtt_to_region(snap: Snapshot, region: str) -> tuple[F64, I64]:
    """Per site: its RTT in ms to ``region`` (0 inside it, inf with no measured link to any
    site of it) and the site of the region that RTT is to (-1: none); memoised."""
    key = ("rtt_to_region", region)
    cached = snap.memo.get(key)
    if cached is None:
        inside = np.asarray(snap.region == region, dtype=bool)
        rtt = np.full(snap.n_sites, np.inf)
        via = np.full(snap.n_sites, -1, dtype=np.int64)
        members = np.flatnonzero(inside)
        if len(members):
            to_members = np.where(snap.link_known[:, members], snap.rtt_ms[:, members], np.inf)
            nearest = np.argmin(to_members, axis=1)
            rtt = to_members[np.arange(snap.n_sites), nearest]
            via = np.where(np.isfinite(rtt), members[nearest], -1)
            rtt[inside] = 0.0
            via[inside] = members
        cached = snap.memo[key] = (rtt, via)
    return cached  # type: ignore[return-value]


def has_region(snap: Snapshot, region: str) -> bool:
    """Whether any known site is in ``region``."""
    return bool(np.any(snap.region == region))


class NearRegion:
    """Sites by their RTT to the task's ``near_region`` (see the module's docstring)."""

    name: ClassVar[str] = "NearRegion"
    ranks_first: ClassVar[bool] = True

    def score(self, req: Request, snap: Snapshot, feasible: npt.NDArray[np.int64]) -> F64:
        if not req.near_region or not has_region(snap, req.near_region):
            return np.full(len(feasible), 100.0)
        rtt, _ = rtt_to_region(snap, req.near_region)
        stepped = np.floor(rtt[feasible] / STEP_MS) * STEP_MS
        # 100 at 0 ms, falling with the RTT; inf (unmeasured) gives 0.
        return np.asarray(100.0 * HALF_SCORE_MS / (HALF_SCORE_MS + stepped), dtype=np.float64)


def describe(req: Request, snap: Snapshot, ranked: Sequence[str]) -> str:
    """For ``fedctl jobs explain``: the RTT ``NearRegion`` used for each of the ``ranked``
    sites (best first, the first ``MAX_LISTED``), or that no site is in the region."""
    region = req.near_region
    if not has_region(snap, region):
        return f"no site in region {region}: near_region weighs nothing until one joins"
    rtt, via = rtt_to_region(snap, region)
    parts = []
    for name in ranked[:MAX_LISTED]:
        i = snap.site_index(name)
        if i is None:
            continue
        if snap.region[i] == region:
            parts.append(f"{name} 0 ms (in {region})")
        elif via[i] < 0:
            parts.append(f"{name} unmeasured (ranked after measured sites)")
        else:
            parts.append(f"{name} {rtt[i]:.1f} ms (to {snap.site_ids[via[i]]})")
    if len(ranked) > MAX_LISTED:
        parts.append(f"{len(ranked) - MAX_LISTED} more")
    return f"near region {region}, RTT first (a tie within {STEP_MS:g} ms steps): " + ", ".join(
        parts
    )
