"""Whether a site has room for every replica: CPU, memory and matching free accelerators.

Each replica must fit on one node (and, when asked, in one interconnect group), so the plugin
counts how many replicas each node can hold and sums per site, as array operations over every
node and device of the federation. Accelerators are asked for as whole devices, as a fraction
of a shareable device, or as a hardware partition profile (MIG).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from federation.jobspec import kind_name
from federation.placement.compat import CompatTable, load_table_files
from federation.placement.framework import CAPACITY_FILTER, Code, LazyReasons, Verdict
from federation.placement.plugins.compatibility import node_compat
from federation.placement.request import Request
from federation.placement.selectors import selector_class_mask
from federation.placement.snapshot import Snapshot

EPSILON = 1e-9
F64 = npt.NDArray[np.float64]
Bool = npt.NDArray[np.bool_]


def matching_classes(req: Request, snap: Snapshot) -> npt.NDArray[np.bool_]:
    """Device classes of the kind, vendor, model, memory and selector asked for."""
    key = (
        "classes",
        req.accelerator_kind,
        req.accelerator_vendor,
        req.accelerator_models,
        req.accelerator_min_memory_mib,
        req.selector,
    )
    cached = snap.memo.get(key)
    if cached is None:
        vendor = req.accelerator_vendor.lower()
        cached = np.array(
            [
                c.kind == req.accelerator_kind
                and c.memory_mib >= req.accelerator_min_memory_mib
                and (not vendor or c.vendor == vendor)
                and (not req.accelerator_models or c.model in req.accelerator_models)
                for c in snap.classes
            ],
            dtype=bool,
        )
        if req.selector and len(cached):
            cached &= selector_class_mask(req.selector, snap)
        snap.memo[key] = cached
    mask: npt.NDArray[np.bool_] = cached  # type: ignore[assignment]
    return mask


def matching_devices(req: Request, snap: Snapshot) -> npt.NDArray[np.bool_]:
    """Devices of the kind, vendor, model, memory and selector asked for (free or not)."""
    classes = matching_classes(req, snap)
    if not len(classes):
        return np.zeros(len(snap.device_node), dtype=bool)
    return classes[snap.device_class]


def replicas_per_device(req: Request, snap: Snapshot) -> F64:
    """For fractions and partitions: how many replicas each device can take."""
    matching = matching_devices(req, snap)
    if req.fraction:
        shares = np.floor(snap.device_free_fraction / req.fraction + EPSILON)
        if req.share_memory_mib:
            by_memory = np.floor(snap.device_memory_free_mib / req.share_memory_mib + EPSILON)
            shares = np.minimum(shares, by_memory)
        return np.asarray(np.where(matching & snap.device_shareable, shares, 0.0), np.float64)
    free = np.zeros(len(snap.device_node))
    rows = snap.partition_profile == req.partition
    np.add.at(free, snap.partition_device[rows], snap.partition_free[rows])
    return np.asarray(np.where(matching, free, 0.0), dtype=np.float64)


def accelerator_room(req: Request, snap: Snapshot) -> F64:
    """Per node: replicas its free matching accelerators can hold (inf when none are asked)."""
    if not req.wants_accelerator:
        return np.full(snap.n_nodes, np.inf)
    if not req.accelerator_count:
        per_device = replicas_per_device(req, snap)
        return np.bincount(snap.device_node, weights=per_device, minlength=snap.n_nodes).astype(
            np.float64
        )
    if not req.same_interconnect:
        # The hot path: free whole devices per (node, class), not per device.
        classes = matching_classes(req, snap)
        pair_free = snap.pair_free * classes[snap.pair_class] if len(classes) else snap.pair_free
        per_node = np.bincount(snap.pair_node, weights=pair_free, minlength=snap.n_nodes)
        return np.floor(per_node / req.accelerator_count)
    free = matching_devices(req, snap) & snap.device_available
    if req.same_interconnect:
        # Replicas per group, then per node: a replica's devices never span two groups.
        per_group = np.bincount(snap.device_group[free], minlength=len(snap.device_group) + 1)
        group_room = np.floor(per_group / req.accelerator_count)
        group_node = np.zeros(len(per_group), dtype=np.int64)
        group_node[snap.device_group] = snap.device_node
        return np.bincount(group_node, weights=group_room, minlength=snap.n_nodes).astype(
            np.float64
        )
    per_node = np.bincount(snap.device_node[free], minlength=snap.n_nodes).astype(np.float64)
    return np.floor(per_node / req.accelerator_count)


def node_label_mask(req: Request, snap: Snapshot) -> npt.NDArray[np.bool_]:
    if not req.node_labels:
        return np.ones(snap.n_nodes, dtype=np.bool_)
    return np.array(
        [all(labels.get(k) == v for k, v in req.node_labels) for labels in snap.node_labels],
        dtype=bool,
    )


def replicas_per_node(
    req: Request, snap: Snapshot, *, cap: float | None = None, table: CompatTable | None = None
) -> F64:
    """How many replicas of ``req`` each node can hold now, at most ``cap`` (default: all);
    with ``table``, only on nodes that meet the software requirements read through it (the
    site puts every replica on such a node)."""
    key = ("node_room", req)
    room = snap.memo.get(key)
    if not isinstance(room, np.ndarray):
        room = snap.memo[key] = _node_room(req, snap)
    limit = req.replicas if cap is None else cap
    fit = np.minimum(room, limit)
    if table is not None and req.requires:
        fit = np.where(node_compat(req, snap, table)[0], fit, 0.0)
    return np.asarray(fit, dtype=np.float64)


def _node_room(req: Request, snap: Snapshot) -> F64:
    """Replicas each node can hold, with no upper bound."""
    return fit_replicas(
        req,
        snap.node_cpu_free,
        snap.node_memory_free_mib,
        accelerator_room(req, snap),
        snap.node_schedulable & node_label_mask(req, snap),
    )


def fit_replicas(
    req: Request, cpu_free: F64, memory_free_mib: F64, accelerator_room: F64, usable: Bool
) -> F64:
    """Per node, replicas of ``req`` its free CPU, memory and accelerators (as replicas)
    hold; 0 on nodes not ``usable``. Predicted waits count room on trial with it too."""
    fit = np.minimum(np.full(len(cpu_free), np.inf), accelerator_room)
    # The tolerance keeps 0.3 / 0.1 (2.9999999999999996) at 3, as the agent's packer counts.
    if req.cpu > 0:
        fit = np.minimum(fit, np.floor(cpu_free / req.cpu + EPSILON))
    if req.memory_mib > 0:
        fit = np.minimum(fit, np.floor(memory_free_mib / req.memory_mib + EPSILON))
    fit[~usable] = 0
    return np.asarray(fit, dtype=np.float64)


def describe_demand(req: Request) -> str:
    parts = [f"{req.cpu:g} CPU", f"{req.memory_mib:g} MiB"]
    if req.wants_accelerator:
        kind = kind_name(req.accelerator_kind)
        if req.accelerator_count:
            acc = f"{req.accelerator_count}x{kind}"
        elif req.fraction:
            acc = f"{req.fraction:g} of a shareable {kind}"
            if req.share_memory_mib:
                acc += f" and {req.share_memory_mib:g} MiB of its memory"
        else:
            acc = f"a {kind} partition {req.partition}"
        if req.accelerator_vendor:
            acc += f" from {req.accelerator_vendor}"
        if req.accelerator_models:
            acc += f" ({'|'.join(sorted(req.accelerator_models))})"
        if req.accelerator_min_memory_mib:
            acc += f" with >= {req.accelerator_min_memory_mib:g} MiB"
        if req.selector:
            acc += f" matching {req.selector!r}"
        if req.same_interconnect:
            acc += " in one interconnect group"
        parts.append(acc)
    return f"{req.replicas} replica(s) of {', '.join(parts)}"


class CapacityFit:
    name: ClassVar[str] = CAPACITY_FILTER

    def __init__(self, table: CompatTable | None = None) -> None:
        self.table = table or load_table_files()

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        room = replicas_per_node(req, snap, table=self.table)
        per_site = np.bincount(snap.node_site, weights=room, minlength=snap.n_sites).astype(
            np.float64
        )
        if req.topology_required:
            per_site = best_group_room(req.topology_required, room, snap)
        mask = per_site >= req.replicas
        devices: list[F64] = []

        def explain(site: int) -> str:
            room = f"room for {int(per_site[site])}"
            if req.topology_required:
                room += f" in its roomiest {req.topology_required}"
            if req.wants_accelerator:
                if not devices:  # counted once, for the first reason anyone reads
                    free = matching_devices(req, snap) & snap.device_available
                    if not req.accelerator_count:
                        free = replicas_per_device(req, snap) > 0
                    site_of = snap.node_site[snap.device_node[free]]
                    devices.append(np.bincount(site_of, minlength=snap.n_sites).astype(float))
                room += f"; {int(devices[0][site])} matching free device(s)"
            return f"needs {describe_demand(req)}; site has {room}"

        failing = np.flatnonzero(~mask)
        return Verdict(
            mask=mask,
            reasons=LazyReasons(failing, explain),
            codes=LazyReasons(failing, shortfall_code(req, snap, self.table)),
        )


def best_group_room(level: str, room: F64, snap: Snapshot) -> F64:
    """Per site: the replicas the roomiest value of node label ``level`` holds (one rack's
    nodes, say); 0 where no node has the label."""
    key = ("topology_groups", level)
    cached = snap.memo.get(key)
    if cached is None:
        ids: dict[tuple[int, str], int] = {}
        group = np.full(snap.n_nodes, -1, dtype=np.int64)
        for node, labels in enumerate(snap.node_labels):
            if value := labels.get(level):
                group[node] = ids.setdefault((int(snap.node_site[node]), value), len(ids))
        site_of = np.array([site for site, _ in ids], dtype=np.int64)
        cached = snap.memo[key] = (group, site_of)
    group, site_of = cached  # type: ignore[misc]
    labelled = group >= 0
    per_group = np.bincount(group[labelled], weights=room[labelled], minlength=len(site_of))
    best = np.zeros(snap.n_sites, dtype=np.float64)
    np.maximum.at(best, site_of, per_group)
    return best


def site_counts(snap: Snapshot) -> tuple[F64, F64]:
    """Per site: its nodes, and its devices of each class (sites x classes), all states;
    counted once per snapshot, for reason codes only."""
    cached = snap.memo.get("site_counts")
    if cached is None:
        nodes = np.bincount(snap.node_site, minlength=snap.n_sites).astype(np.float64)
        n_classes = len(snap.classes)
        by_class = np.zeros((snap.n_sites, n_classes))
        if n_classes:
            flat = snap.device_site * n_classes + snap.device_class
            counted = np.bincount(flat, minlength=snap.n_sites * n_classes)
            by_class = counted.astype(np.float64).reshape(snap.n_sites, n_classes)
        cached = snap.memo["site_counts"] = (nodes, by_class)
    return cached  # type: ignore[return-value]


def shortfall_code(req: Request, snap: Snapshot, table: CompatTable) -> Callable[[int], str]:
    """The code for why a site lacks room, from the most basic lack to the most passing:
    no nodes, no device of the model, none with the memory, none the selector takes, no node
    with the labels, room only on nodes that miss the software requirements, and else too
    little free now. Counted for every site at once, when the first code is read."""
    counts: list[dict[str, F64]] = []

    def per_site(values: F64) -> F64:
        return np.bincount(snap.node_site, weights=values, minlength=snap.n_sites).astype(
            np.float64
        )

    def count() -> dict[str, F64]:
        nodes, by_class = site_counts(snap)
        out = {"nodes": nodes}
        if req.wants_accelerator:
            vendor = req.accelerator_vendor.lower()
            models = req.accelerator_models
            model = np.array(
                [
                    c.kind == req.accelerator_kind
                    and (not vendor or c.vendor == vendor)
                    and (not models or c.model in models)
                    for c in snap.classes
                ],
                dtype=bool,
            )
            memory = np.array(
                [c.memory_mib >= req.accelerator_min_memory_mib for c in snap.classes], dtype=bool
            )
            full = matching_classes(req, snap)
            out["model"] = by_class @ model
            out["memory"] = by_class @ (model & memory)
            out["selector"] = by_class @ full
        if req.node_labels:
            out["labelled"] = per_site(node_label_mask(req, snap).astype(np.float64))
        if req.requires or req.topology_required:
            out["room"] = per_site(replicas_per_node(req, snap, table=table))
        if req.requires:
            out["room"] = per_site(replicas_per_node(req, snap))
            out["compatible_room"] = per_site(replicas_per_node(req, snap, table=table))
        return out

    def code(site: int) -> str:
        if not counts:
            counts.append(count())
        c = counts[0]
        if not c["nodes"][site]:
            return Code.NO_NODES
        if req.wants_accelerator:
            if not c["model"][site]:
                return Code.NO_DEVICE_OF_MODEL
            if not c["memory"][site]:
                return Code.INSUFFICIENT_DEVICE_MEMORY
            if not c["selector"][site]:
                return Code.DEVICE_SELECTOR_UNMATCHED
        if req.node_labels and not c["labelled"][site]:
            return Code.NODE_LABELS_UNMATCHED
        if req.requires and c["room"][site] >= req.replicas > c["compatible_room"][site]:
            return Code.REQUIREMENTS_UNMET
        if req.topology_required and c["room"][site] >= req.replicas:
            return Code.TOPOLOGY_UNMET
        return Code.INSUFFICIENT_FREE_CAPACITY

    return code
