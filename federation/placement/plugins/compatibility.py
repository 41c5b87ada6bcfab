"""The task's software requirements against each node's drivers, runtimes and frameworks.

Evaluated once per distinct label set (nodes of one build look alike), not once per node.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from federation.placement.compat import CompatTable, load_table_files, unmet
from federation.placement.framework import Code, Verdict
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot


def node_compat(req: Request, snap: Snapshot, table: CompatTable) -> tuple[np.ndarray, list[str]]:
    """Per node: whether it meets the requirements, and why not (empty when it does)."""
    key = ("compat", req.requires)
    cached = snap.memo.get(key)
    if cached is None:
        by_labels: dict[tuple[tuple[str, str], ...], str | None] = {}
        reasons = []
        for labels in snap.node_labels:
            label_key = tuple(sorted(labels.items()))
            if label_key not in by_labels:
                by_labels[label_key] = unmet(req.requires, labels, table)
            reasons.append(by_labels[label_key] or "")
        cached = (np.array([not r for r in reasons], dtype=bool), reasons)
        snap.memo[key] = cached
    return cached  # type: ignore[return-value]


class Compatibility:
    name: ClassVar[str] = "Compatibility"

    def __init__(self, table: CompatTable | None = None) -> None:
        self.table = table or load_table_files()

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        if not req.requires:
            return Verdict(mask=np.ones(snap.n_sites, dtype=bool))
        ok, reasons = node_compat(req, snap, self.table)
        mask = np.bincount(snap.node_site[ok], minlength=snap.n_sites) > 0
        why: dict[int, str] = {}
        codes: dict[int, str] = {}
        for node, site in enumerate(snap.node_site):
            if not mask[site] and int(site) not in why:
                why[int(site)] = reasons[node]
                codes[int(site)] = Code.REQUIREMENTS_UNMET
        return Verdict(
            mask=mask,
            reasons=why,
            default_reason="site has no nodes",
            codes=codes,
            default_code=Code.NO_NODES,
        )
