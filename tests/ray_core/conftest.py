"""One real Ray head for the Ray core's tests (they run in one xdist worker).

A head costs about 0.7 GiB and 10-16 s to start, so the tests share it; each uses its own
site name, so groups and jobs of one test are not another's.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from federation.testing.ray_head import LocalRayHead, ray_binary


@pytest.fixture(scope="session")
def ray_head() -> Iterator[LocalRayHead]:
    if ray_binary() is None:
        pytest.skip("Ray is not installed: pip install -e '.[ray]'")
    head = LocalRayHead(cpus=4, a100s=2)
    head.start()
    try:
        yield head
    finally:
        head.stop()
