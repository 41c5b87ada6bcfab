"""The simulated sites' capacity, kept in placement's own Snapshot arrays and changed in place.

The snapshot is built once from the topology by the coordinator's ``build_snapshot`` (the
views the sites would publish), then every grant and release edits its free CPU, memory,
devices and (node, class) free counts directly and clears ``snap.memo``, so the next decision
sees the change without rebuilding anything.

A site takes an offer by the embedded core's rule (``federation.agent.packing.place``): every
replica must fit on one node. The room is counted per node as ``CapacityFit`` counts it, over
the site's slice of the arrays only; nodes and devices are chosen by the packer's rank (tightest
share, least fragmentation added, most plentiful model, best fit), over arrays.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from federation.agent.packing import GANG_MIX
from federation.api.v1 import resources_pb2
from federation.placement.estimates import class_speed
from federation.placement.plugins.capacity_fit import EPSILON, matching_classes, node_label_mask
from federation.placement.request import Request
from federation.placement.snapshot import Memo, SiteInput, Snapshot, build_snapshot
from federation.sim.topology import Topology, launchable_nodes

F64 = npt.NDArray[np.float64]
I64 = npt.NDArray[np.int64]


class UnsupportedRequestError(ValueError):
    """A request the simulated sites do not model (MIG partitions, interconnect groups)."""


@dataclass(frozen=True, slots=True)
class Grant:
    """Capacity held for one task at one site: a node per replica and its devices."""

    site: int
    nodes: tuple[int, ...]
    devices: tuple[int, ...]
    """Whole devices (all replicas), or one shared device per replica when ``fraction``."""
    cpu: float
    memory_mib: float
    fraction: float = 0.0

    @property
    def device_share(self) -> float:
        """How much of one device each of ``devices`` is held."""
        return self.fraction or 1.0


def site_views(topology: Topology) -> list[SiteInput]:
    """The views the topology's sites would publish, idle (nodes named ``site/00000``...,
    then the nodes of their node types, launchable: ``site/a100x2-0``...)."""
    sites = []
    for spec in topology.sites:
        view = resources_pb2.SiteView(
            site=spec.name,
            domain=spec.domain,
            region=spec.region,
            price_per_device_hour=spec.price_per_device_hour,
            datasets=dict(spec.datasets or {}),
        )
        number = 0
        for node_spec in spec.nodes:
            for _ in range(node_spec.count):
                view.nodes.append(node_spec.node(f"{spec.name}/{number:05d}"))
                number += 1
        view.nodes.extend(launchable_nodes(spec))
        sites.append(SiteInput(view=view, is_connected=True, is_cordoned=False))
    return sites


def fragmentation(free: I64) -> I64:
    """``federation.agent.packing.fragmentation`` per node: the free devices that no gang of
    each ``GANG_MIX`` size can use, weighted by how often such gangs come."""
    out = np.zeros(len(free), dtype=np.int64)
    for size, weight in GANG_MIX:
        out += weight * (free % size)
    return out


def _ranges(owner: I64, n: int) -> tuple[I64, I64]:
    """Start and stop of each owner's run in ``owner`` (sorted)."""
    starts = np.searchsorted(owner, np.arange(n), side="left").astype(np.int64)
    stops = np.searchsorted(owner, np.arange(n), side="right").astype(np.int64)
    return starts, stops


class SiteState:
    """Every simulated site's capacity, as the placement snapshot that the policies read."""

    def __init__(
        self, topology: Topology, snap: Snapshot | None = None, pristine: Snapshot | None = None
    ) -> None:
        if snap is None:
            snap = build_snapshot(site_views(topology))
            # The topology's link matrix (measured, declared or assumed) replaces the views'
            # (which carry none).
            snap.bandwidth_mbps[...] = topology.bandwidth_mbps
            snap.rtt_ms[...] = topology.rtt_ms
            snap.link_known[...] = topology.link_known
        self.topology = topology
        self.snap = snap
        self._pristine = pristine if pristine is not None else _copy_capacity(snap)
        self.node_lo, self.node_hi = _ranges(snap.node_site, snap.n_sites)
        self.device_lo, self.device_hi = _ranges(snap.device_node, snap.n_nodes)
        self.pair_lo, self.pair_hi = _ranges(snap.pair_node, snap.n_nodes)
        pair_of = {
            (int(n), int(c)): i
            for i, (n, c) in enumerate(zip(snap.pair_node, snap.pair_class, strict=True))
        }
        self.device_pair = np.array(
            [
                pair_of[int(n), int(c)]
                for n, c in zip(snap.device_node, snap.device_class, strict=True)
            ],
            dtype=np.int64,
        )
        self.shareable = self._pristine.device_shareable
        _, model = np.unique([c.model for c in snap.classes], return_inverse=True)
        self.class_model: I64 = np.asarray(model, dtype=np.int64).reshape(-1)
        """Per device class: its model's number (classes of one model count together)."""
        self.n_devices = len(snap.device_node)
        self.free_devices = int(snap.device_available.sum())
        """Whole devices free now (a device with a share handed out is not free)."""
        by_name = {s.name: s.speed_factor for s in topology.sites}
        site_factor = np.array([by_name.get(name, 1.0) for name in snap.site_ids])
        class_factor = np.array([topology.speed_factors.get(c.model, 1.0) for c in snap.classes])
        self.speed_factor: F64 = (
            site_factor[snap.node_site[snap.device_node]] * class_factor[snap.device_class]
            if self.n_devices
            else np.zeros(0)
        )
        """Per device: how fast it really runs against the speed table (the topology's
        ``speed_factor`` of its site times ``speed_factors`` of its model)."""

    def fresh(self) -> SiteState:
        """An independent copy with every device free, for another replay."""
        return SiteState(self.topology, _copy_capacity(self._pristine), self._pristine)

    def classes(self, req: Request, min_speed: float = 0.0) -> npt.NDArray[np.bool_]:
        """Device classes ``req`` matches, only those at least ``min_speed`` fast when given
        (the packer's ``min_speed``)."""
        classes = matching_classes(req, self.snap)
        if min_speed > 0 and len(classes):
            classes = classes & (class_speed(req, self.snap) >= min_speed * (1 - EPSILON))
        return classes

    def node_room(self, req: Request, site: int, min_speed: float = 0.0) -> F64:
        """Replicas of ``req`` each node of ``site`` can hold now (CapacityFit's count), on
        devices at least ``min_speed`` fast."""
        if req.partition or req.same_interconnect or req.share_memory_mib:
            raise UnsupportedRequestError(
                "the simulator models whole devices and fractions (without memory) only"
            )
        snap = self.snap
        a, b = int(self.node_lo[site]), int(self.node_hi[site])
        fit = np.full(b - a, np.inf)
        if req.cpu > 0:
            fit = np.minimum(fit, np.floor(snap.node_cpu_free[a:b] / req.cpu + EPSILON))
        if req.memory_mib > 0:
            fit = np.minimum(
                fit, np.floor(snap.node_memory_free_mib[a:b] / req.memory_mib + EPSILON)
            )
        if req.wants_accelerator:
            classes = self.classes(req, min_speed)
            if req.accelerator_count:
                pa, pb = self._span(self.pair_lo, self.pair_hi, a, b)
                weights = snap.pair_free[pa:pb] * classes[snap.pair_class[pa:pb]]
                per_node = np.bincount(snap.pair_node[pa:pb] - a, weights=weights, minlength=b - a)
                fit = np.minimum(fit, np.floor(per_node / req.accelerator_count))
            else:
                da, db = self._span(self.device_lo, self.device_hi, a, b)
                usable = classes[snap.device_class[da:db]] & snap.device_shareable[da:db]
                shares = np.floor(snap.device_free_fraction[da:db] / req.fraction + EPSILON)
                per_node = np.bincount(
                    snap.device_node[da:db] - a,
                    weights=np.where(usable, shares, 0.0),
                    minlength=b - a,
                )
                fit = np.minimum(fit, per_node)
        fit[~snap.node_schedulable[a:b]] = 0
        if req.node_labels:
            fit[~node_label_mask(req, snap)[a:b]] = 0
        return fit

    @staticmethod
    def _span(lo: I64, hi: I64, a: int, b: int) -> tuple[int, int]:
        """Rows of nodes ``a`` to ``b`` (exclusive) in an array grouped by node."""
        return (int(lo[a]), int(hi[b - 1])) if b > a else (0, 0)

    def room(self, req: Request, site: int, min_speed: float = 0.0) -> float:
        """Replicas of ``req`` the site can hold now, each on one node."""
        return float(self.node_room(req, site, min_speed).sum())

    def allocate(self, req: Request, site: int, min_speed: float = 0.0) -> Grant:
        """Hold room for every replica; the caller has checked that it fits. As the packer's
        ``place_as_estimated``: on devices at least ``min_speed`` fast where they hold every
        replica, else on any."""
        if min_speed > 0 and self.room(req, site, min_speed) < req.replicas:
            min_speed = 0.0
        snap = self.snap
        a = int(self.node_lo[site])
        nodes: list[int] = []
        devices: list[int] = []
        for _ in range(req.replicas):
            room = self.node_room(req, site, min_speed)
            candidates = np.flatnonzero(room >= 1)
            if not len(candidates):
                raise RuntimeError(f"site {snap.site_ids[site]} has no room for {req}")
            plenty = self._plenty(site)
            node = int(self._best_fit(req, a + candidates, min_speed, plenty))
            nodes.append(node)
            devices.extend(self._take_devices(req, node, min_speed, plenty))
            snap.node_cpu_free[node] -= req.cpu
            snap.node_memory_free_mib[node] -= req.memory_mib
        snap.memo.clear()
        return Grant(site, tuple(nodes), tuple(devices), req.cpu, req.memory_mib, req.fraction)

    def _plenty(self, site: int) -> I64:
        """Per device class: whole devices of its model free on the site's schedulable nodes
        (the packer's ``_plenty``)."""
        snap = self.snap
        pa, pb = self._span(
            self.pair_lo, self.pair_hi, int(self.node_lo[site]), int(self.node_hi[site])
        )
        free = snap.pair_free[pa:pb] * snap.node_schedulable[snap.pair_node[pa:pb]]
        model = self.class_model[snap.pair_class[pa:pb]]
        per_model = np.bincount(model, weights=free, minlength=len(self.class_model))
        return np.rint(per_model).astype(np.int64)[self.class_model]

    def _best_fit(self, req: Request, nodes: I64, min_speed: float, plenty: I64) -> int:
        """The best of ``nodes`` by the embedded core's packer's rank (``_fit`` there): for a
        share, the share its device keeps; then the fragmentation the replica adds, the
        scarcity of the scarcest model it may take, free whole devices left, CPU, memory and
        name."""
        snap = self.snap
        running = np.concatenate(([0.0], np.cumsum(snap.pair_free)))
        free_devices = np.rint(running[self.pair_hi[nodes]] - running[self.pair_lo[nodes]])
        free = free_devices.astype(np.int64)
        if req.fraction:
            shares = [self._tightest_share(req, int(n), min_speed, plenty) for n in nodes]
            devices = np.array([d for d, _ in shares], dtype=np.int64)
            taken = snap.device_available[devices].astype(np.int64)
            scarcest = plenty[snap.device_class[devices]]
        elif req.accelerator_count:
            taken = np.full(len(nodes), req.accelerator_count, dtype=np.int64)
            scarcest = self._scarcest(req, nodes, min_speed, plenty)
        else:
            taken = scarcest = np.zeros(len(nodes), dtype=np.int64)
        keys = [
            nodes,
            snap.node_memory_free_mib[nodes] - req.memory_mib,
            snap.node_cpu_free[nodes] - req.cpu,
            free_devices - req.accelerator_count,
            -scarcest,
            fragmentation(free - taken) - fragmentation(free),
        ]
        if req.fraction:
            keys.append(np.array([left for _, left in shares]))
        return int(nodes[np.lexsort(keys)[0]])

    def _scarcest(self, req: Request, nodes: I64, min_speed: float, plenty: I64) -> I64:
        """Per node of ``nodes``: ``plenty`` of the scarcest matching class with free devices
        there."""
        snap = self.snap
        pa, pb = self._span(self.pair_lo, self.pair_hi, int(nodes.min()), int(nodes.max()) + 1)
        pair_class = snap.pair_class[pa:pb]
        usable = self.classes(req, min_speed)[pair_class] & (snap.pair_free[pa:pb] > 0)
        lowest = np.full(int(nodes.max()) + 1 - int(nodes.min()), np.iinfo(np.int64).max)
        where = snap.pair_node[pa:pb][usable] - int(nodes.min())
        np.minimum.at(lowest, where, plenty[pair_class[usable]])
        return lowest[nodes - int(nodes.min())]

    def _tightest_share(
        self, req: Request, node: int, min_speed: float, plenty: I64
    ) -> tuple[int, float]:
        """The shareable matching device of ``node`` with the least free share that still
        holds the request (then of the most plentiful model, then the lowest index), and the
        share it would keep."""
        snap = self.snap
        lo, hi = int(self.device_lo[node]), int(self.device_hi[node])
        left = snap.device_free_fraction[lo:hi]
        matching = self.classes(req, min_speed)[snap.device_class[lo:hi]]
        shares = np.floor(left / req.fraction + EPSILON)  # the packer's shares_fit
        candidates = np.flatnonzero(matching & snap.device_shareable[lo:hi] & (shares >= 1))
        scarcity = -plenty[snap.device_class[lo:hi]][candidates]
        best = int(candidates[np.lexsort((candidates, scarcity, left[candidates]))[0]])
        return lo + best, float(left[best] - req.fraction)

    def _take_devices(self, req: Request, node: int, min_speed: float, plenty: I64) -> list[int]:
        if not req.wants_accelerator:
            return []
        snap = self.snap
        lo, hi = int(self.device_lo[node]), int(self.device_hi[node])
        matching = self.classes(req, min_speed)[snap.device_class[lo:hi]]
        if req.accelerator_count:
            free = np.flatnonzero(matching & snap.device_available[lo:hi])
            # The most plentiful model first, then the lowest index (the packer's order).
            scarcity = -plenty[snap.device_class[lo:hi]][free]
            free = free[np.lexsort((free, scarcity))][: req.accelerator_count]
            taken = sorted(lo + int(d) for d in free)
            for d in taken:
                snap.device_available[d] = False
                snap.device_shareable[d] = False
                snap.device_free_fraction[d] = 0.0
                snap.pair_free[self.device_pair[d]] -= 1
            self.free_devices -= len(taken)
            return taken
        d, _ = self._tightest_share(req, node, min_speed, plenty)
        if snap.device_available[d]:
            snap.device_available[d] = False
            snap.pair_free[self.device_pair[d]] -= 1
            self.free_devices -= 1
        snap.device_free_fraction[d] = max(0.0, snap.device_free_fraction[d] - req.fraction)
        return [d]

    @contextmanager
    def trial(self, site: int) -> Iterator[None]:
        """Everything changed at ``site`` inside the block (releases to see what would fit
        then) is put back as it was when it ends."""
        snap = self.snap
        a, b = int(self.node_lo[site]), int(self.node_hi[site])
        da, db = self._span(self.device_lo, self.device_hi, a, b)
        pa, pb = self._span(self.pair_lo, self.pair_hi, a, b)
        saved = [
            (array, lo, array[lo:hi].copy())
            for array, lo, hi in (
                (snap.node_cpu_free, a, b),
                (snap.node_memory_free_mib, a, b),
                (snap.device_free_fraction, da, db),
                (snap.device_shareable, da, db),
                (snap.device_available, da, db),
                (snap.pair_free, pa, pb),
            )
        ]
        free_devices = self.free_devices
        try:
            yield
        finally:
            for array, lo, values in saved:
                array[lo : lo + len(values)] = values
            self.free_devices = free_devices
            snap.memo.clear()

    def release(self, grant: Grant) -> None:
        """Give back everything ``grant`` held."""
        snap = self.snap
        for node in grant.nodes:
            snap.node_cpu_free[node] += grant.cpu
            snap.node_memory_free_mib[node] += grant.memory_mib
        for d in grant.devices:
            if grant.fraction:
                left = snap.device_free_fraction[d] + grant.fraction
                snap.device_free_fraction[d] = min(1.0, left)
                if left < 1.0 - EPSILON:
                    continue
                snap.device_free_fraction[d] = 1.0
            else:
                snap.device_free_fraction[d] = 1.0
                snap.device_shareable[d] = self.shareable[d]
            snap.device_available[d] = True
            snap.pair_free[self.device_pair[d]] += 1
            self.free_devices += 1
        snap.memo.clear()


def _copy_capacity(snap: Snapshot) -> Snapshot:
    """``snap`` with its own copies of everything the simulation changes."""
    return dataclasses.replace(
        snap,
        node_cpu_free=snap.node_cpu_free.copy(),
        node_memory_free_mib=snap.node_memory_free_mib.copy(),
        node_schedulable=snap.node_schedulable.copy(),
        node_provision_s=snap.node_provision_s.copy(),
        device_available=snap.device_available.copy(),
        device_shareable=snap.device_shareable.copy(),
        device_free_fraction=snap.device_free_fraction.copy(),
        pair_free=snap.pair_free.copy(),
        memo=Memo(),
    )
