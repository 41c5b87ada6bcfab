"""A committed task of the embedded core: its replicas, its service state and, once it has
ended, its outcome; what every part of the core reads and moves."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from federation.agent.checkpoint_store import CheckpointUploads
from federation.agent.checkpoints import TaskCheckpoints
from federation.agent.core import task_report
from federation.agent.process import ReplicaProcess
from federation.agent.service import ReplicaService
from federation.agent.usage import Slot
from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.common.keys import RunKey
from federation.service_policy import RestartPolicy

State: TypeAlias = jobs_pb2.JobState.ValueType

FINAL = frozenset(
    {jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED}
)


@dataclass(slots=True, eq=False)
class Task:
    """A committed task: its replicas and, once it has ended, its outcome."""

    key: RunKey
    reservation_id: str
    spec: jobs_pb2.TaskSpec
    slots: tuple[Slot, ...]
    devices: list[str]
    grace_s: float
    state: State = jobs_pb2.JOB_STATE_DELEGATED  # until every replica has started
    exit_code: int = 0
    reason: str = ""
    output_tail: str = ""
    replicas: list[ReplicaProcess] = field(default_factory=list)
    cancel_reason: str | None = None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    drain_first: bool = False
    """Cancelled by the coordinator: an autoscaled service's replicas are drained before
    they stop (not so when the agent shuts down or is cut off)."""
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    supervisor: asyncio.Task[None] | None = None
    checkpoints: TaskCheckpoints | None = None
    """Its checkpoint folder and watcher, when the task declares a checkpoint policy."""
    tenant: str = ""
    stop_after_s: float = 0.0
    """Cut off from every coordinator this long, the site stops the task; 0: it does not."""
    interrupted: bool = False
    """Stopped because the site was cut off (``stop_cut_off``), not for the task's sake."""
    started_at: float = 0.0
    """Wall-clock time its replicas started."""
    restore: jobs_pb2.CheckpointRecord | None = None
    final: site_link_service_pb2.TaskReport | None = None
    """Its final report, once it has ended (the very one recorded and sent)."""
    service: list[ReplicaService] | None = None
    """Per replica, for a service task: its port, restarts and readiness; None for batch."""
    site: str = ""
    address: str = ""
    """Where clients reach its replicas (a service's endpoints)."""
    revision: int = 0
    """The revision of ``spec`` (a service changed in place has a newer one)."""
    keepers: list[asyncio.Task[None]] = field(default_factory=list)
    """A service's restarters, one per started replica, in replica order."""
    reshaped: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a service's spec changed in place: its replicas are brought to it."""
    moved: asyncio.Event = field(default_factory=asyncio.Event)
    """Set on each report of the task (a replica's readiness, say)."""
    inputs: list[site_link_service_pb2.StagedInput] = field(default_factory=list)
    """Other tasks' outputs to stage into its folders before it starts (from the commit)."""
    gang_peers: list[str] = field(default_factory=list)
    """Every replica's host:port of its all-or-nothing gang, in rank order; empty: none."""
    gang_rank: int = 0
    """The gang rank of its replica 0."""
    artifacts: list[jobs_pb2.Artifact] = field(default_factory=list)
    """Its outputs as stored, once it succeeded."""
    checkpoint: jobs_pb2.CheckpointRecord | None = None
    """The newest checkpoint reported: at a site with a store, the newest uploaded."""
    uploads: CheckpointUploads | None = None
    """Uploads its checkpoints, at a site with a store."""
    restore_input: site_link_service_pb2.StagedInput | None = None
    """The uploaded checkpoint to stage in before it starts (from the commit)..."""
    restore_of: jobs_pb2.CheckpointRecord | None = None
    """... and its record (from the offer)."""

    @property
    def active(self) -> bool:
        return self.state not in FINAL

    def report(self) -> site_link_service_pb2.TaskReport:
        if self.final is not None:
            return self.final
        return task_report(
            self.key,
            self.state,
            exit_code=self.exit_code,
            output_tail=self.output_tail,
            reason=self.reason,
            devices=self.devices,
            nodes=[slot.node for slot in self.slots],
            checkpoint=self.checkpoint,
            # Only once stopped: a task that ended by itself first did not lose its run.
            interrupted=self.interrupted and self.state == jobs_pb2.JOB_STATE_CANCELLED,
            endpoints=self.endpoints(),
            artifacts=self.artifacts,
        )

    def endpoints(self) -> list[jobs_pb2.Endpoint]:
        """A running service's replicas; none for batch work or once it has ended."""
        if self.service is None or not self.active:
            return []
        policy = RestartPolicy.of(self.spec.service)
        return [
            jobs_pb2.Endpoint(
                site=self.site,
                node=slot.node,
                address=self.address,
                port=replica.port,
                replica=i,
                ready=replica.ready,
                restarts=replica.restarts,
                crash_looping=policy.crash_looping(replica.short_runs),
                revision=replica.revision,
                load=replica.load,
                draining=replica.draining,
            )
            for i, (slot, replica) in enumerate(zip(self.slots, self.service, strict=True))
        ]


def ended_by_themselves(replicas: Sequence[ReplicaProcess]) -> bool:
    """Whether every replica has ended, none stopped nor killed for a reason of its
    supervisor's own (so its end is the task's own)."""
    return all(p.ended is not None and not p.ended.why and not p.ended.stopped for p in replicas)
