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
    reclaims: int = 0
    """Times it was stopped because its spot node was taken back."""
    reclaim_lost_device_s: float = 0.0
    """Device-seconds of run lost to those reclaims, as ``lost_device_s`` counts them."""

    @property
    def nodes(self) -> tuple[int, ...]:
        """The nodes it holds (none before it is placed)."""
        return self.grant.nodes if self.grant is not None else ()

    def since_checkpoint(self, now: float) -> float:
        """Seconds it has run by ``now`` since its last checkpoint (every
        ``checkpoint_interval_s`` of run since it started; none: since it started); 0 unless
        it runs."""
        if self.state != job_state.RUNNING:
            return 0.0
        ran_s = now - self.started_s
        every = self.trace.checkpoint_interval_s
        return ran_s - math.floor(ran_s / every) * every if every > 0 else ran_s

    def stop(self, now: float, *, reclaimed: bool) -> float:
        """It is stopped at ``now``, preempted or, with ``reclaimed``, on a spot node taken
        back: the run since its last checkpoint is lost (counted per cause), what it
        checkpointed is done. The seconds it ran."""
        running = self.state == job_state.RUNNING
        ran_s = now - self.started_s if running else 0.0
        lost_s = self.since_checkpoint(now)
        assert self.grant is not None
        lost_device_s = lost_s * len(self.grant.devices) * self.grant.device_share
        if reclaimed:
            self.reclaims += 1
            self.reclaim_lost_device_s += lost_device_s
        else:
            self.preemptions += 1
            self.lost_device_s += lost_device_s
        if running:  # what it checkpointed is done
            self.remaining_s = (self.run_s - ran_s + lost_s) * (self.speed or 1.0)
        return ran_s
