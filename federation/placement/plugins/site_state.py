"""Only connected, uncordoned sites take new work."""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from federation.placement.framework import Verdict
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot


class SiteState:
    name: ClassVar[str] = "SiteState"

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        mask = snap.is_connected & ~snap.is_cordoned
        reasons = {
            int(i): "site is cordoned" if snap.is_cordoned[i] else "site agent is not connected"
            for i in np.flatnonzero(~mask)
        }
        return Verdict(mask=mask, reasons=reasons)
