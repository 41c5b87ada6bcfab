"""Only connected, uncordoned sites take new work."""

from __future__ import annotations

from typing import ClassVar

from federation.placement.framework import Code, Verdict
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot


class SiteState:
    name: ClassVar[str] = "SiteState"

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        # Cordoned first: a cordoned site that is also disconnected is told so first.
        return Verdict.all_of(
            snap.n_sites,
            Verdict(
                mask=~snap.is_cordoned,
                default_reason="site is cordoned",
                default_code=Code.SITE_CORDONED,
            ),
            Verdict(
                mask=snap.is_connected,
                default_reason="site agent is not connected",
                default_code=Code.SITE_UNREACHABLE,
            ),
        )
