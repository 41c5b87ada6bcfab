"""Moving a task's inputs to the site it is placed at, in the replay (``engine.Simulation``).

An input goes from the holder that gets it there soonest, as the placement estimate computes:
bytes x 8 / bandwidth + RTT. What crosses the WAN (from a holder other than the site) is
counted, and billed at the holder's egress price.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt

from federation.placement.request import Request
from federation.placement.snapshot import Snapshot


def transfer(
    req: Request,
    site: int,
    snap: Snapshot,
    site_index: Mapping[str, int],
    egress_usd_per_gb: npt.NDArray[np.float64],
) -> tuple[float, float, float]:
    """Seconds, bytes over the WAN and egress cost to bring ``req``'s inputs to ``site``
    (``site_index``: the snapshot's sites by name; ``egress_usd_per_gb``: per site)."""
    seconds = moved = egress = 0.0
    for item in req.inputs:
        if item.site:
            holders = [site_index[item.site]]
            sizes = [float(item.bytes)]
        else:
            holders = snap.holders(item.dataset)
            sizes = [float(item.bytes or snap.datasets[h][item.dataset]) for h in holders]
        if not holders:
            continue
        times = [
            size * 8.0 / (snap.bandwidth_mbps[h, site] * 1e6) + snap.rtt_ms[h, site] / 1e3
            for h, size in zip(holders, sizes, strict=True)
        ]
        best = int(np.argmin(times))
        seconds += times[best]
        if holders[best] != site:
            moved += sizes[best]
            egress += sizes[best] / 1e9 * float(egress_usd_per_gb[holders[best]])
    return seconds, moved, egress
