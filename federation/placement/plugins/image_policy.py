"""A task that names an image goes only to sites that run images, from its registry.

Each site says in its view why it runs none (``SiteView.image_refusal``: containers turned off
in its config, no Podman, a scheduler that runs none) and which registries it pulls from
(``image_registries``); the reason shown is the site's own.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from federation.images import ImageReferenceError, parse_image
from federation.placement.framework import Code, LazyReasons, Verdict
from federation.placement.request import Request
from federation.placement.snapshot import Snapshot


class ImagePolicy:
    name: ClassVar[str] = "ImagePolicy"

    def filter(self, req: Request, snap: Snapshot) -> Verdict:
        ok = np.ones(snap.n_sites, dtype=bool)
        if not req.image or not snap.image_refusal:
            return Verdict(mask=ok)
        try:
            registry = parse_image(req.image).registry
        except ImageReferenceError:
            registry = ""  # submit refuses such references; the sites' own checks stand
        for i, (refusal, allowed) in enumerate(
            zip(snap.image_refusal, snap.image_registries, strict=True)
        ):
            ok[i] = not refusal and (not allowed or registry in allowed)

        def reason(i: int) -> str:
            if refusal := snap.image_refusal[i]:
                return f"{refusal} (image {req.image})"
            allowed = ", ".join(snap.image_registries[i])
            return f"the site pulls images from {allowed} only, not from {registry}"

        return Verdict(
            mask=ok,
            reasons=LazyReasons(np.flatnonzero(~ok), reason),
            default_code=Code.IMAGE_REFUSED,
        )
