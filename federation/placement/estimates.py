"""Estimated completion time at every site: queue wait + transfer (inputs and image) + run time.

A task's image counts like an input: nothing where a node of the site holds it, else the bytes
a pull moves (as a node that holds it reports them) over the site's measured link to the
coordinator, the best figure the federation has for the way out to a registry (Kubernetes'
ImageLocality, in time rather than a score). Until some node holds the image its size is
unknown and no site is charged for it.

Also the cost (cloud price x devices x run time) and energy (device power x run time) of one
run. Computed once per (request, snapshot) and shared by every plugin that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from federation.placement.devices import device_speeds
from federation.placement.plugins.capacity_fit import (
    matching_classes,
    matching_devices,
    replicas_per_device,
    replicas_per_node,
)
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot

F64 = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class Estimates:
    """Per site, in seconds, USD and kWh; ``unknown_links`` marks assumed bandwidths."""

    queue_s: F64
    transfer_s: F64
    run_s: F64
    device_speed: F64
    """Speed of the devices ``run_s`` assumes (the fastest free matching ones); 0: none asked."""
    cost_usd: F64
    energy_kwh: F64
    transfer_bytes: F64
    unknown_links: npt.NDArray[np.bool_]
    provision_s: F64
    """Launch delay of the nodes an elastic site would start for the task; 0 elsewhere."""
    pull_s: F64 = field(default_factory=lambda: np.zeros(0))
    """Of ``transfer_s``: pulling the task's image."""
    pull_bytes: F64 = field(default_factory=lambda: np.zeros(0))
    image_held: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, bool))
    """A node of the site holds the task's image."""

    @property
    def total_s(self) -> F64:
        return self.queue_s + self.provision_s + self.transfer_s + self.run_s


def class_speed(req: Request, snap: Snapshot) -> F64:
    """Speed of each device class for the task's workload class (1.0 = A100-80GB)."""
    speed = device_speeds(req.workload_class, req.speed)
    return np.array(
        [speed(c.model, float(c.attributes.get("tflops_fp16", 0.0))) for c in snap.classes],
        dtype=np.float64,
    )


def _groups(
    snap: Snapshot, site_of: npt.NDArray[np.int64], name: str
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """Where each site's run starts in ``site_of`` (sorted), and which sites have any."""
    key = ("groups", name)
    cached = snap.memo.get(key)
    if cached is None:
        starts = np.searchsorted(site_of, np.arange(snap.n_sites))
        present = np.bincount(site_of, minlength=snap.n_sites) > 0
        cached = snap.memo[key] = (np.minimum(starts, max(len(site_of) - 1, 0)), present)
    return cached  # type: ignore[return-value]


def _site_max(values: F64, groups: tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]) -> F64:
    """Per-site maximum of non-negative ``values`` laid out in site order."""
    starts, present = groups
    out = np.zeros(len(present))
    if len(values):
        out[present] = np.maximum.reduceat(values, starts)[present]
    return out


def _run_s(req: Request, snap: Snapshot, *, free_only: bool = True) -> tuple[F64, F64, F64]:
    """Run time at each site on its fastest usable devices, their speed (0: none) and their
    power per device; ``free_only`` False: on its fastest matching devices, free or not."""
    if not req.wants_accelerator or not len(snap.classes):
        zeros = np.zeros(snap.n_sites)
        return np.full(snap.n_sites, req.duration_s), zeros, zeros
    speed = class_speed(req, snap)
    power = np.array([float(c.attributes.get("power_tdp_watts", 0.0)) for c in snap.classes])
    if req.accelerator_count:
        # Per (node, class) pair: classes that match and have free devices there.
        usable = matching_classes(req, snap)[snap.pair_class]
        if free_only:
            usable = usable & (snap.pair_free > 0)
        groups = _groups(snap, snap.pair_site, "pairs")
        classes = snap.pair_class
    else:
        usable = matching_devices(req, snap)
        if free_only:
            usable = usable & (replicas_per_device(req, snap) > 0)
        groups = _groups(snap, snap.device_site, "devices")
        classes = snap.device_class
    best = _site_max(speed[classes] * usable, groups)
    watts = _site_max(power[classes] * usable, groups)
    run = np.where(best > 0, req.duration_s / np.where(best > 0, best, 1.0), req.duration_s)
    return run, best, watts


def _transfer(req: Request, snap: Snapshot) -> tuple[F64, F64, npt.NDArray[np.bool_]]:
    seconds = np.zeros(snap.n_sites)
    moved = np.zeros(snap.n_sites)
    unknown = np.zeros(snap.n_sites, dtype=bool)
    for item in req.inputs:
        if item.site:
            found = (snap.site_index(site) for site in (item.site, *item.also))
            holders = [i for i in found if i is not None]
            sizes = [float(item.bytes)] * len(holders)
        else:
            holders = snap.holders(item.dataset)
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


def _provisioning(req: Request, snap: Snapshot, run_s: F64) -> tuple[F64, F64]:
    """Per site: the delay before the task could start on nodes still to launch (the longest
    p50 delay among the launchable nodes with room; 0 where running nodes have room for every
    replica), and what those nodes cost, price per node-hour from launch to the run's end.
    How many nodes: the replicas running nodes cannot hold, over the most one such node
    holds."""
    zeros = np.zeros(snap.n_sites)
    if len(snap.node_provision_s) != snap.n_nodes or not snap.node_provision_s.any():
        return zeros, zeros.copy()
    room = replicas_per_node(req, snap)
    later = snap.node_provision_s > 0
    ready = np.bincount(snap.node_site, weights=np.where(later, 0.0, room), minlength=snap.n_sites)
    with_room = later & (room > 0)
    delay, per_node, price = zeros.copy(), zeros.copy(), zeros.copy()
    np.maximum.at(delay, snap.node_site[with_room], snap.node_provision_s[with_room])
    np.maximum.at(per_node, snap.node_site[with_room], room[with_room])
    np.maximum.at(price, snap.node_site[with_room], snap.node_price_per_hour[with_room])
    short = np.maximum(req.replicas - ready, 0.0)
    launched = np.ceil(short / np.where(per_node > 0, per_node, 1.0))
    delay = np.where(short > 0, delay, 0.0)
    return delay, launched * price * (delay + run_s) / 3600.0


def pull_seconds(pull_bytes: float, mbps: F64, rtt_ms: F64) -> F64:
    """Seconds to pull ``pull_bytes`` over links of ``mbps`` and ``rtt_ms``: what ``estimate``
    charges a site without the image (``bench/containers.py`` checks it against real pulls)."""
    return np.asarray(pull_bytes * 8.0 / (mbps * 1e6) + rtt_ms / 1000.0, dtype=np.float64)


def _pull(req: Request, snap: Snapshot) -> tuple[F64, F64, npt.NDArray[np.bool_]]:
    """Seconds and bytes to pull the task's image to each site, and where it is held."""
    held = np.zeros(snap.n_sites, dtype=bool)
    seconds, moved = np.zeros(snap.n_sites), np.zeros(snap.n_sites)
    if not req.image or not snap.images:
        return seconds, moved, held
    holders = snap.image_holders(req.image)
    held[holders] = True
    size = float(max((snap.images[i][req.image] for i in holders), default=0))
    if size > 0:
        away = ~held
        moved[away] = size
        seconds[away] = pull_seconds(size, snap.uplink_mbps[away], snap.uplink_rtt_ms[away])
    return seconds, moved, held


def once_free(req: Request, snap: Snapshot) -> tuple[F64, F64]:
    """Run time at each site on its fastest matching devices whether free or not, and their
    speed: the run a task would get at a busy site once room frees there (memoised)."""
    key = ("once_free", req)
    cached = snap.memo.get(key)
    if cached is None:
        run_s, speed, _ = _run_s(req, snap, free_only=False)
        cached = snap.memo[key] = (run_s, speed)
    return cached  # type: ignore[return-value]


def estimate(req: Request, snap: Snapshot) -> Estimates:
    """Estimates for every site (memoised on the snapshot)."""
    key = ("estimate", req)
    cached = snap.memo.get(key)
    if cached is None:
        run_s, speed, power = _run_s(req, snap)
        transfer_s, moved, unknown = _transfer(req, snap)
        pull_s, pull_bytes, held = _pull(req, snap)
        if req.image and len(snap.uplink_known):
            unknown |= (pull_s > 0) & ~snap.uplink_known
        devices = req.devices_per_replica * req.replicas
        provision_s, launch_cost = _provisioning(req, snap, run_s)
        cost = snap.price_per_device_hour * devices * run_s / 3600.0 + launch_cost
        energy = power * devices * run_s / 3.6e6
        cached = Estimates(
            queue_s=snap.queue_wait_s.copy(),
            transfer_s=transfer_s + pull_s,
            run_s=run_s,
            device_speed=speed,
            cost_usd=cost,
            energy_kwh=energy,
            transfer_bytes=moved,
            unknown_links=unknown,
            provision_s=provision_s,
            pull_s=pull_s,
            pull_bytes=pull_bytes,
            image_held=held,
        )
        snap.memo[key] = cached
    result: Estimates = cached  # type: ignore[assignment]
    return result
