"""Estimated completion time at every site: queue wait + input transfer + run time.

Also the cost (cloud price x devices x run time) and energy (device power x run time) of one
run. Computed once per (request, snapshot) and shared by every plugin that needs it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import resources

import numpy as np
import numpy.typing as npt
import yaml

from federation.placement.plugins.capacity_fit import accelerator_room, matching_devices
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot

F64 = npt.NDArray[np.float64]
REFERENCE_TFLOPS_FP16 = 312.0  # the A100's, which the speed table calls 1.0


@dataclass(frozen=True, slots=True)
class Estimates:
    """Per site, in seconds, USD and kWh; ``unknown_links`` marks assumed bandwidths."""

    queue_s: F64
    transfer_s: F64
    run_s: F64
    cost_usd: F64
    energy_kwh: F64
    transfer_bytes: F64
    unknown_links: npt.NDArray[np.bool_]

    @property
    def total_s(self) -> F64:
        return self.queue_s + self.transfer_s + self.run_s


@functools.lru_cache(maxsize=1)
def speed_table() -> dict[str, dict[str, float]]:
    text = resources.files("federation.placement").joinpath("data/speed.yaml").read_text()
    doc: dict[str, dict[str, float]] = yaml.safe_load(text)
    return doc


def device_speed(req: Request, snap: Snapshot) -> F64:
    """Speed of each device for the task's workload class (1.0 = A100-80GB)."""
    table = {**speed_table().get(req.workload_class, speed_table()["training"]), **dict(req.speed)}
    by_tflops = snap.device_tflops_fp16 / REFERENCE_TFLOPS_FP16
    known = np.array([table.get(m, np.nan) for m in snap.device_model], dtype=np.float64)
    speed = np.where(np.isnan(known), np.where(by_tflops > 0, by_tflops, 1.0), known)
    return np.asarray(speed, dtype=np.float64)


def _run_s(req: Request, snap: Snapshot) -> tuple[F64, F64]:
    """Run time at each site on its fastest usable devices, and their power per device."""
    if not req.wants_accelerator or not len(snap.device_node):
        return np.full(snap.n_sites, req.duration_s), np.zeros(snap.n_sites)
    usable = matching_devices(req, snap)
    if req.accelerator_count:
        usable &= snap.device_available
    else:
        usable &= accelerator_room(req, snap)[snap.device_node] > 0
    speed = np.where(usable, device_speed(req, snap), 0.0)
    best = np.zeros(snap.n_sites)
    np.maximum.at(best, snap.device_site, speed)
    power = np.zeros(snap.n_sites)
    np.maximum.at(power, snap.device_site, np.where(usable, snap.device_power_watts, 0.0))
    run = np.where(best > 0, req.duration_s / np.where(best > 0, best, 1.0), req.duration_s)
    return run, power


def _transfer(req: Request, snap: Snapshot) -> tuple[F64, F64, npt.NDArray[np.bool_]]:
    seconds = np.zeros(snap.n_sites)
    moved = np.zeros(snap.n_sites)
    unknown = np.zeros(snap.n_sites, dtype=bool)
    for item in req.inputs:
        if item.site:
            source = snap.site_index(item.site)
            holders = [] if source is None else [source]
            sizes = [float(item.bytes)]
        else:
            holders = [i for i, held in enumerate(snap.datasets) if item.dataset in held]
            sizes = [float(item.bytes or snap.datasets[i][item.dataset]) for i in holders]
        if not holders:
            continue  # nowhere known to fetch from: the submit check refuses such inputs
        # From the holder that gets it here soonest.
        bits = np.array(sizes)[:, None] * 8.0
        time_s = bits / (snap.bandwidth_mbps[holders] * 1e6) + snap.rtt_ms[holders] / 1000.0
        best = np.argmin(time_s, axis=0)
        seconds += time_s[best, np.arange(snap.n_sites)]
        local = time_s[best, np.arange(snap.n_sites)] == 0
        moved += np.where(local, 0.0, np.array(sizes)[best])
        unknown |= ~snap.link_known[np.array(holders)[best], np.arange(snap.n_sites)]
    return seconds, moved, unknown


def estimate(req: Request, snap: Snapshot) -> Estimates:
    """Estimates for every site (memoised on the snapshot)."""
    key = ("estimate", req)
    cached = snap.memo.get(key)
    if cached is None:
        run_s, power = _run_s(req, snap)
        transfer_s, moved, unknown = _transfer(req, snap)
        devices = req.devices_per_replica * req.replicas
        cost = snap.price_per_device_hour * devices * run_s / 3600.0
        energy = power * devices * run_s / 3.6e6
        cached = Estimates(
            queue_s=snap.queue_wait_s.copy(),
            transfer_s=transfer_s,
            run_s=run_s,
            cost_usd=cost,
            energy_kwh=energy,
            transfer_bytes=moved,
            unknown_links=unknown,
        )
        snap.memo[key] = cached
    result: Estimates = cached  # type: ignore[assignment]
    return result
