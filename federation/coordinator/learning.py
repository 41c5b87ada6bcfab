"""Speeds learned from finished tasks: how fast each device model really runs each workload.

The speed table (``federation/placement/data/speed.yaml``) is where estimates start. Every task
that succeeds on devices says how fast its device model ran its workload class: its estimated
duration (seconds on the reference device) over the seconds it ran. An exponentially weighted
mean of the logarithm of that speed, per (workload class, model), replaces the table's entry
once a few tasks agree, and its spread is the expected error estimates carry. A task's own
``speed`` overrides still win. The model lives in the leader's memory: a new leader starts
again from the table.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from federation.metrics import RUN_TIME_RATIO

WEIGHT = 0.2
"""Weight of the newest task in the running mean: about the last ten tasks count."""
MIN_TASKS = 3
"""Tasks of a (workload class, model) before the learned speed replaces the table's."""


@dataclass(slots=True)
class _Speed:
    tasks: int
    mean: float
    """Of log(speed)."""
    variance: float


class SpeedLearner:
    """Learned speeds per (workload class, device model)."""

    def __init__(self) -> None:
        self._speeds: dict[tuple[str, str], _Speed] = {}

    def observe(
        self,
        workload_class: str,
        model: str,
        duration_s: float,
        estimated_run_s: float,
        ran_s: float,
    ) -> None:
        """One task that succeeded: ``duration_s`` of reference work ran ``ran_s`` seconds on
        ``model``, where the estimate said ``estimated_run_s``."""
        if not (model and duration_s > 0 and ran_s > 0 and math.isfinite(duration_s / ran_s)):
            return
        if estimated_run_s > 0:
            RUN_TIME_RATIO.labels(workload_class or "training").observe(ran_s / estimated_run_s)
        value = math.log(duration_s / ran_s)
        key = (workload_class or "training", model)
        known = self._speeds.get(key)
        if known is None:
            self._speeds[key] = _Speed(1, value, 0.0)
            return
        delta = value - known.mean
        known.tasks += 1
        known.mean += WEIGHT * delta
        known.variance = (1 - WEIGHT) * (known.variance + WEIGHT * delta * delta)

    def speed(self, workload_class: str, model: str) -> float | None:
        """The learned speed, or None while too few tasks finished."""
        known = self._speeds.get((workload_class or "training", model))
        if known is None or known.tasks < MIN_TASKS:
            return None
        return math.exp(known.mean)

    def error(self, workload_class: str, model: str) -> float:
        """Expected relative error of a run time on ``model`` (0 while too few tasks)."""
        known = self._speeds.get((workload_class or "training", model))
        if known is None or known.tasks < MIN_TASKS:
            return 0.0
        return math.expm1(math.sqrt(known.variance))

    def overrides(self, workload_class: str, own: Mapping[str, float]) -> dict[str, float]:
        """Speeds to estimate with: the learned ones, under the task's own overrides."""
        learned = {
            model: math.exp(s.mean)
            for (wc, model), s in self._speeds.items()
            if wc == (workload_class or "training") and s.tasks >= MIN_TASKS
        }
        return {**learned, **own}
