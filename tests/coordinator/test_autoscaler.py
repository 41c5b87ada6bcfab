"""How many replicas an autoscaled service's load asks for (Kubernetes' HPA rule: the summed
load over the target of one replica, within min and max, nothing changed within 10 % of the
target)."""

from __future__ import annotations

import pytest

from federation.api.v1 import jobs_pb2
from federation.coordinator.jobs.autoscaler import wanted_replicas

SCALE = jobs_pb2.Autoscale(min_replicas=1, max_replicas=5, target_load=2.0, load_path="/load")


@pytest.mark.parametrize(
    ("running", "loads", "expected"),
    [
        (1, [0.0], 1),  # never under min
        (1, [7.0], 4),  # ceil(7 / 2)
        (1, [30.0], 5),  # never over max
        (3, [1.0, 1.0, 1.0], 2),  # ceil(3 / 2): fewer
        (3, [2.1, 2.1, 2.0], 3),  # within 10 % of the target: unchanged, not 4
        (3, [2.5, 2.5, 2.5], 4),  # 25 % over: more
        (2, [0.0, 0.0], 1),
    ],
)
def test_the_replicas_a_load_asks_for(running: int, loads: list[float], expected: int) -> None:
    assert wanted_replicas(SCALE, running, loads) == expected
