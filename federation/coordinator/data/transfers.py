"""Stage-ins as measured by the sites that made them: the link model they feed, the lines their
events show and the bytes each link and tenant moved.

A site staging an input in reports its progress now and then, and once the input is in place
the bytes that came over the network and the seconds its connections were open reading them
(``StageProgress``, protocol 5). That throughput is what the link from the holder to the site
really gave a job's data, so it replaces the probe's figure for that pair of sites in the
placement's link matrix (``TransferLinks.bandwidth``): the next estimate of a transfer between
them reflects it. A new measurement is averaged with the one before (half each), so one slow
transfer moves the figure but does not own it. It lives in the coordinator's memory: a new
leader starts from the probes again.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import Counter

from federation.api.v1 import site_link_service_pb2

MIN_MEASURED_BYTES = 1024 * 1024
"""Smaller stage-ins are mostly round trips, not throughput: they are counted, not learnt."""
WEIGHT_NEW = 0.5

STAGED_BYTES = Counter(
    "federation_staged_bytes_total",
    "Bytes of inputs staged in from one site's store to another site, as the receiver reported",
    ["source", "site"],
)
STAGED_TENANT_BYTES = Counter(
    "federation_staged_tenant_bytes_total",
    "Bytes of inputs staged in between sites for each tenant's jobs",
    ["tenant"],
)
STAGE_RESUMES = Counter(
    "federation_stage_resumes_total",
    "Stage-in downloads resumed after their connection was cut",
    ["source", "site"],
)


class TransferLinks:
    """Measured throughput of the links stage-ins crossed, per (holder, receiver)."""

    def __init__(self) -> None:
        self._mbps: dict[tuple[str, str], float] = {}

    def observe(self, source: str, site: str, moved: int, active_s: float) -> float | None:
        """Learn from one stage-in; returns the link's figure now, or None when it was too
        small (or too odd) to say anything about the link."""
        if moved < MIN_MEASURED_BYTES or active_s <= 0 or not source or source == site:
            return None
        mbps = moved * 8 / active_s / 1e6
        before = self._mbps.get((source, site))
        now = mbps if before is None else WEIGHT_NEW * mbps + (1 - WEIGHT_NEW) * before
        self._mbps[(source, site)] = now
        return now

    def bandwidth(self) -> Mapping[tuple[str, str], float]:
        """Mbit/s per (holder, receiver) as measured by stage-ins."""
        return self._mbps


def count(progress: site_link_service_pb2.StageProgress, site: str, tenant: str) -> None:
    """Count a finished stage-in's bytes on its link and for its tenant."""
    source = progress.source_site or "unknown"
    STAGED_BYTES.labels(source, site).inc(progress.bytes_moved)
    STAGED_TENANT_BYTES.labels(tenant or "_").inc(progress.bytes_moved)
    if progress.resumes:
        STAGE_RESUMES.labels(source, site).inc(progress.resumes)


def line(progress: site_link_service_pb2.StageProgress) -> str:
    """The event's reason: ``staging 1.2 GiB of 4 GiB from edge-a, 38 MB/s`` while it runs,
    ``staged 4 GiB from edge-a in 107 s, 38 MB/s`` once in place (the input named first)."""
    source = f" from {progress.source_site}" if progress.source_site else ""
    rate = progress.bytes_done / progress.seconds if progress.seconds > 0 else 0.0
    speed = _rate(rate)
    if not progress.done:
        done, total = _size(progress.bytes_done), _size(progress.bytes_total)
        return f"staging {progress.dataset}: {done} of {total}{source}, {speed}"
    resumed = ""
    if progress.resumes:
        resumed = f", resumed {progress.resumes} time{'s' if progress.resumes > 1 else ''}"
    took = f"{progress.seconds:.3g} s"
    size = _size(progress.bytes_total)
    return f"staged {progress.dataset}: {size}{source} in {took}, {speed}{resumed}"


def _size(n: float) -> str:
    """Bytes in binary units, as files are sized: ``1.2 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def _rate(bytes_per_s: float) -> str:
    """A rate in decimal megabytes, as links are sold: ``38 MB/s``."""
    return f"{bytes_per_s / 1e6:.3g} MB/s"
