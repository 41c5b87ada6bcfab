"""Site-to-site links for the simulator: declared, measured between regions, or a default.

The loaders read the shapes of the measured data in ``../shared/data/network/``:

- a throughput table with one row per run (``src_region``, ``dst_region``,
  ``throughput_received_bps``; Skyplane's iperf3 runs): the median per region pair is used;
- an RTT table with one row per pair (``src_region``, ``dst_region``, ``avg_rtt`` in ms;
  Skyplane's pings), or an RTT matrix whose first column names the source region and whose
  header names the destinations, empty where unknown (Azure's inter-region statistics).
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from federation.sim.fields import InputFileError, read_text

RegionPair = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Link:
    """Bandwidth in Mbit/s and round-trip time in ms."""

    bandwidth_mbps: float
    rtt_ms: float


@dataclass(frozen=True, slots=True)
class DeclaredLink:
    """A link the topology states for one pair of sites."""

    source: str
    target: str
    link: Link
    both_ways: bool = True


@dataclass(frozen=True, slots=True)
class LinkPlan:
    """How the topology's links are made; ``link_matrix`` turns it into arrays."""

    default: Link = Link(100.0, 100.0)
    """Pairs nothing else covers (the same assumption the coordinator makes)."""
    same_region: Link | None = None
    """Sites in one region with no measurement of their own, when set."""
    measured_bandwidth: Mapping[RegionPair, float] = field(default_factory=dict)
    measured_rtt: Mapping[RegionPair, float] = field(default_factory=dict)
    edge_scale: float = 0.1
    """Measured bandwidth is multiplied by this where either end is an edge site."""
    declared: Sequence[DeclaredLink] = ()


def _rows(path: Path) -> tuple[list[str], list[list[str]]]:
    rows = list(csv.reader(io.StringIO(read_text(path), newline="")))
    if not rows:
        raise InputFileError(f"{path}: empty file")
    return [h.strip() for h in rows[0]], rows[1:]


def _column(path: Path, header: list[str], *names: str) -> int:
    for name in names:
        if name in header:
            return header.index(name)
    raise InputFileError(f"{path}: no column {' or '.join(names)} (columns: {', '.join(header)})")


def _float(path: Path, line: int, column: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise InputFileError(f"{path}:{line}: column {column!r}: not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise InputFileError(f"{path}:{line}: column {column!r}: must be >= 0, got {text!r}")
    return value


def load_throughput_csv(path: Path) -> dict[RegionPair, float]:
    """Median throughput in Mbit/s per (source, destination) region from a table of runs."""
    header, rows = _rows(path)
    src = _column(path, header, "src_region")
    dst = _column(path, header, "dst_region")
    bps = _column(path, header, "throughput_received_bps", "throughput_bps")
    runs: dict[RegionPair, list[float]] = defaultdict(list)
    for line, row in enumerate(rows, start=2):
        if not any(cell.strip() for cell in row):
            continue
        value = _float(path, line, header[bps], row[bps])
        runs[row[src].strip(), row[dst].strip()].append(value / 1e6)
    return {pair: statistics.median(values) for pair, values in runs.items()}


def load_rtt_csv(path: Path) -> dict[RegionPair, float]:
    """RTT in ms per (source, destination) region, from a table of pairs or a matrix."""
    header, rows = _rows(path)
    if "src_region" in header:
        src = _column(path, header, "src_region")
        dst = _column(path, header, "dst_region")
        rtt = _column(path, header, "avg_rtt", "rtt_ms", "min_rtt")
        pings: dict[RegionPair, list[float]] = defaultdict(list)
        for line, row in enumerate(rows, start=2):
            if any(cell.strip() for cell in row):
                value = _float(path, line, header[rtt], row[rtt])
                pings[row[src].strip(), row[dst].strip()].append(value)
        return {pair: statistics.median(values) for pair, values in pings.items()}
    # A matrix: first column the source, header the destinations.
    out: dict[RegionPair, float] = {}
    for line, row in enumerate(rows, start=2):
        if not row or not row[0].strip():
            continue
        for column, cell in zip(header[1:], row[1:], strict=False):
            if cell.strip():
                out[row[0].strip(), column] = _float(path, line, column, cell)
    return out


def _region_matrix(
    values: Mapping[RegionPair, float], region_index: Mapping[str, int]
) -> npt.NDArray[np.float64]:
    """Region x region values, NaN where unmeasured; one direction stands for both."""
    out = np.full((len(region_index), len(region_index)), np.nan)
    for (a, b), value in values.items():
        if a in region_index and b in region_index:
            out[region_index[a], region_index[b]] = value
    return np.where(np.isnan(out), out.T, out)


def link_matrix(
    names: Sequence[str], regions: Sequence[str], is_edge: Sequence[bool], plan: LinkPlan
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.bool_]]:
    """(from, to) bandwidth (Mbit/s), RTT (ms) and whether each is measured or declared.

    Declared links win, then measurements between the sites' regions (a pair measured only
    one way stands for both), then ``same_region``, then ``default``. Unknown pairs keep the
    default and are marked unknown, as the coordinator marks them.
    """
    n = len(names)
    region_names = sorted(set(regions))
    region_index = {r: i for i, r in enumerate(region_names)}
    of_site = np.array([region_index[r] for r in regions], dtype=np.int64)
    site_pairs = np.ix_(of_site, of_site)
    bandwidth = np.full((n, n), plan.default.bandwidth_mbps)
    rtt = np.full((n, n), plan.default.rtt_ms)
    known = np.zeros((n, n), dtype=bool)
    if plan.same_region is not None:
        same = of_site[:, None] == of_site[None, :]
        bandwidth[same] = plan.same_region.bandwidth_mbps
        rtt[same] = plan.same_region.rtt_ms
        known |= same
    measured_bw = _region_matrix(plan.measured_bandwidth, region_index)[site_pairs]
    measured_rtt = _region_matrix(plan.measured_rtt, region_index)[site_pairs]
    edge = np.asarray(is_edge, dtype=bool)
    scale = np.where(edge[:, None] | edge[None, :], plan.edge_scale, 1.0)
    has_bw = np.isfinite(measured_bw) & (measured_bw > 0)
    bandwidth[has_bw] = (measured_bw * scale)[has_bw]
    known |= has_bw
    has_rtt = np.isfinite(measured_rtt)
    rtt[has_rtt] = measured_rtt[has_rtt]
    index = {name: i for i, name in enumerate(names)}
    for declared in plan.declared:
        i, j = index[declared.source], index[declared.target]
        for a, b in [(i, j), (j, i)] if declared.both_ways else [(i, j)]:
            bandwidth[a, b] = declared.link.bandwidth_mbps
            rtt[a, b] = declared.link.rtt_ms
            known[a, b] = True
    np.fill_diagonal(bandwidth, np.inf)
    np.fill_diagonal(rtt, 0.0)
    np.fill_diagonal(known, True)
    return bandwidth, rtt, known
