"""One task's life in the replay (``engine.Simulation``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from federation.common import job_state
from federation.placement.request import Request
from federation.sim.state import Grant
from federation.sim.trace import TraceTask

F64 = npt.NDArray[np.float64]


@dataclass(slots=True)
class TaskRun:
    """One task's life in the replay; times in simulated seconds."""

    trace: TraceTask
    request: Request
    """What the scheduler sees (its duration may be a noisy estimate)."""
    state: int = job_state.PENDING
    epoch: int = 0
    site: int = -1
    placed_s: float = math.nan
    started_s: float = math.nan
    finished_s: float = math.nan
    transfer_s: float = 0.0
    launch_s: float = 0.0
    """Seconds from its placement until the nodes it got run (launched for it, or already
    launching); 0 on running nodes."""
    run_s: float = 0.0
    wan_bytes: float = 0.0
    compute_usd: float = 0.0
    egress_usd: float = 0.0
    energy_kwh: float = 0.0
    offers: int = 0
    declines: int = 0
    backoff_s: float = 0.25
    never_fits: bool = False
    """No site could take it even with the whole federation idle (under this policy)."""
    grant: Grant | None = None
    held: F64 = field(default_factory=lambda: np.zeros(0))
    """Device-equivalents held per accelerator model."""
    assumed_speed: float = 0.0
    """The device speed placement's estimate assumed at its site (0: no devices asked)."""
    speed: float = 0.0
    """The speed of the slowest device it got there (0: none)."""
    estimated_run_s: float = 0.0
    """The run time the scheduler expected on the devices it got (its duration over the
    speed it believed of the slowest, learned speeds included)."""
    watts: float = 0.0
    """Power its devices draw while it runs (TDP times the share held)."""
    remaining_s: float = 0.0
    """Its run time left on a device of speed 1.0: its duration, less what it checkpointed
    before it was preempted."""
    event: int = 0
    """The sequence number of its next START or DONE (cancelled when it is preempted)."""
    preemptions: int = 0
    lost_device_s: float = 0.0
    """Device-seconds of run lost to preemption: run since the last checkpoint, times the
    devices held."""
