"""What the Ray core keeps of each task: its reservation until committed, then its run."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from datacenter_agent.ray_cluster.task_data import RayTaskData
from federation.agent.core import task_report
from federation.agent.usage import Slot
from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.common.keys import RunKey


@dataclass(slots=True)
class Held:
    """An uncommitted reservation: a placement group Ray has placed."""

    key: RunKey
    name: str
    group: Any
    slots: tuple[Slot, ...]
    replica_devices: list[list[str]]
    bundles: list[dict[str, float]]
    deadline: float
    stop_after_s: float
    spec: jobs_pb2.TaskSpec
    expected_start_s: float = 0.0
    """Until the nodes to launch run (a reservation with no group yet)."""
    tenant: str = ""
    restore: jobs_pb2.CheckpointRecord | None = None
    """The checkpoint the task restarts from, if the offer named one."""


@dataclass(slots=True)
class RayTask:
    """A committed task and what Ray last said of its job."""

    key: RunKey
    submission_id: str
    reservation_id: str
    slots: tuple[Slot, ...]
    devices: list[str]
    state: int = jobs_pb2.JOB_STATE_DELEGATED
    exit_code: int = 0
    output_tail: str = ""
    reason: str = ""
    cancel_reason: str | None = None
    interrupted: bool = False
    stop_after_s: float = 0.0
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    taken_back: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once a node it runs on is lost (the task is then interrupted)."""
    starting: asyncio.Task[None] | None = None
    """Staging its inputs, launching its nodes, then placing its group and submitting its
    job."""
    submitted: bool = True
    data: RayTaskData | None = None
    """Its inputs, checkpoints and outputs, when it has any."""
    settling: asyncio.Task[None] | None = None
    """Storing its outputs and last checkpoint once its job has ended."""

    @property
    def is_active(self) -> bool:
        return self.state in (jobs_pb2.JOB_STATE_DELEGATED, jobs_pb2.JOB_STATE_RUNNING)

    def report(self) -> site_link_service_pb2.TaskReport:
        return task_report(
            self.key,
            self.state,
            exit_code=self.exit_code,
            output_tail=self.output_tail,
            reason=self.reason,
            devices=self.devices,
            nodes=sorted({slot.node for slot in self.slots}),
            checkpoint=self.data.checkpoint if self.data is not None else None,
            interrupted=self.interrupted and self.state == jobs_pb2.JOB_STATE_CANCELLED,
            artifacts=self.data.artifacts if self.data is not None else None,
        )


def on_node(slots: tuple[Slot, ...], node: str) -> bool:
    """Whether any of ``slots`` is on ``node``."""
    return any(slot.node == node for slot in slots)


def accepted(
    name: str, lease_s: float, expected_start_s: float = 0.0
) -> site_link_service_pb2.OfferAnswer:
    """The answer that takes an offer with the group (or the launch) ``name``."""
    return site_link_service_pb2.OfferAnswer(
        accepted=True, reservation_id=name, lease_s=lease_s, expected_start_s=expected_start_s
    )
