"""Per-site forecast from history: how often tasks come to a site and how long they run there.

Kept by the leader in memory (a new leader starts learning again): exponentially decayed
counts of delegations and an exponentially weighted mean of measured run times, per site.
Together with what the coordinator predicts of the tasks there now (``waits.occupants``),
``fedctl sites`` shows when room should next free at each site and how loaded it has been.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from federation.api.v1 import admin_service_pb2
from federation.coordinator.scheduling.waits import Occupant

ARRIVALS_TAU_S = 3600.0
"""Arrivals older than this count 1/e as much: the rate follows the last hours."""
RUN_WEIGHT = 0.1
"""Weight of the newest run time in the mean (about the last 10 tasks)."""


@dataclass(slots=True)
class _Site:
    arrivals: float = 0.0
    arrived_at: float = 0.0
    mean_run_s: float = 0.0
    runs: int = 0


class SiteHistory:
    """Arrivals and run times per site (``arrived``, ``ended``), and the forecast built on them."""

    def __init__(self) -> None:
        self._sites: dict[str, _Site] = {}

    def arrived(self, site: str, now: float | None = None) -> None:
        """A task was delegated to ``site``."""
        now = time.time() if now is None else now
        entry = self._sites.setdefault(site, _Site(arrived_at=now))
        entry.arrivals = _decayed(entry, now) + 1.0
        entry.arrived_at = now

    def ended(self, site: str, ran_s: float) -> None:
        """A task ended at ``site`` after running ``ran_s`` seconds."""
        if not (math.isfinite(ran_s) and ran_s >= 0):
            return
        entry = self._sites.setdefault(site, _Site(arrived_at=time.time()))
        weight = max(RUN_WEIGHT, 1.0 / (entry.runs + 1))  # a plain mean until it has 10
        entry.mean_run_s += weight * (ran_s - entry.mean_run_s)
        entry.runs += 1

    def forecasts(
        self,
        sites: Iterable[str],
        holding: Mapping[str, Iterable[Occupant]],
        waiting: Mapping[str, int],
        now: float | None = None,
    ) -> dict[str, admin_service_pb2.SiteForecast]:
        """Per site: its tasks now and when the first should end, the tasks waiting for it,
        and its arrival rate and mean run time from history."""
        now = time.time() if now is None else now
        out = {}
        for site in sites:
            held = list(holding.get(site, ()))
            ends = [h.end - now for h in held if math.isfinite(h.end)]
            entry = self._sites.get(site)
            out[site] = admin_service_pb2.SiteForecast(
                tasks=len(held),
                next_free_s=max(0.0, min(ends)) if ends else -1.0,
                waiting=waiting.get(site, 0),
                arrivals_per_hour=(
                    _decayed(entry, now) * 3600.0 / ARRIVALS_TAU_S if entry is not None else 0.0
                ),
                mean_run_s=entry.mean_run_s if entry is not None else 0.0,
            )
        return out


def _decayed(entry: _Site, now: float) -> float:
    """The site's arrival count as of ``now``, older arrivals counting less."""
    return entry.arrivals * math.exp(-max(0.0, now - entry.arrived_at) / ARRIVALS_TAU_S)
