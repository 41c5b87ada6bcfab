"""Whether a site has room for every replica: CPU, memory and matching free devices.

Each replica must fit on one node, so the plugin counts how many replicas each node can hold
and sums per site, all as array operations over every node and device of the federation.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import numpy.typing as npt

from federation.jobspec import kind_name
from federation.placement.framework import Verdict
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot

EPSILON = 1e-9


def matching_devices(req: Request, snap: Snapshot) -> npt.NDArray[np.bool_]:
    """Mask over devices: free, healthy and of the kind, vendor, model and memory asked for."""
    mask: npt.NDArray[np.bool_] = snap.device_available & (snap.device_kind == req.accelerator_kind)
    mask &= snap.device_memory_mib >= req.accelerator_min_memory_mib
    if req.accelerator_vendor:
        mask &= snap.device_vendor == req.accelerator_vendor.lower()
    if req.accelerator_models:
        mask &= np.isin(snap.device_model, list(req.accelerator_models))
    return mask


def node_label_mask(req: Request, snap: Snapshot) -> npt.NDArray[np.bool_]:
    if not req.node_labels:
        return np.ones(snap.n_nodes, dtype=np.bool_)
    return np.array(
        [all(labels.get(k) == v for k, v in req.node_labels) for labels in snap.node_labels],
        dtype=bool,
    )


def replicas_per_node(
    req: Request, snap: Snapshot, *, cap: float | None = None
) -> npt.NDArray[np.float64]:
    """How many replicas of ``req`` each node can hold now, at most ``cap`` (default: all)."""
    fit = np.full(snap.n_nodes, np.inf)
    # The tolerance keeps 0.3 / 0.1 (2.9999999999999996) at 3, as the agent's packer counts.
    if req.cpu > 0:
        fit = np.minimum(fit, np.floor(snap.node_cpu_free / req.cpu + EPSILON))
    if req.memory_mib > 0:
        fit = np.minimum(fit, np.floor(snap.node_memory_free_mib / req.memory_mib + EPSILON))
    if req.accelerator_count > 0:
        per_node = np.bincount(
            snap.device_node[matching_devices(req, snap)], minlength=snap.n_nodes
        ).astype(np.float64)
        fit = np.minimum(fit, np.floor(per_node / req.accelerator_count))
    fit[~(snap.node_schedulable & node_label_mask(req, snap))] = 0
    return np.asarray(np.minimum(fit, req.replicas if cap is None else cap), dtype=np.float64)


def describe_demand(req: Request) -> str:
    parts = [f"{req.cpu:g} CPU", f"{req.memory_mib:g} MiB"]
    if req.accelerator_count:
        acc = f"{req.accelerator_count}x{kind_name(req.accelerator_kind)}"
        if req.accelerator_vendor:
            acc += f" from {req.accelerator_vendor}"
        if req.accelerator_models:
            acc += f" ({'|'.join(sorted(req.accelerator_models))})"
        if req.accelerator_min_memory_mib:
            acc += f" with >= {req.accelerator_min_memory_mib:g} MiB"
        parts.append(acc)
    return f"{req.replicas} replica(s) of {', '.join(parts)}"


class CapacityFit:
    name: ClassVar[str] = "CapacityFit"

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        per_site = np.bincount(
            snap.node_site, weights=replicas_per_node(req, snap), minlength=snap.n_sites
        )
        mask = per_site >= req.replicas
        reasons: dict[int, str] = {}
        failing = np.flatnonzero(~mask)
        if len(failing):
            devices = np.zeros(snap.n_sites, dtype=np.float64)
            if req.accelerator_count:
                free = np.bincount(
                    snap.device_node[matching_devices(req, snap)], minlength=snap.n_nodes
                )
                devices = np.bincount(snap.node_site, weights=free, minlength=snap.n_sites).astype(
                    np.float64
                )
            demand = describe_demand(req)
            for i in failing:
                room = f"room for {int(per_site[i])}"
                if req.accelerator_count:
                    room += f"; {int(devices[i])} matching free device(s)"
                reasons[int(i)] = f"needs {demand}; site has {room}"
        return Verdict(mask=mask, reasons=reasons)
