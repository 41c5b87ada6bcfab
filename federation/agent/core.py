"""The contract between a site agent's session layer and its local scheduler core.

The session layer speaks to the coordinator; a core decides what fits on the site and runs it.
The embedded core runs tasks as processes on the agent's own machine; a Slurm core hands them to
Slurm. Both satisfy ``LocalCore``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from federation.api.v1 import jobs_pb2, resources_pb2, site_link_service_pb2

StatusCallback = Callable[[site_link_service_pb2.TaskReport], None]
"""Called with a task's report each time its state changes (RUNNING, then a final state)."""

ChangeCallback = Callable[[], None]
"""Called whenever allocations or the queue change, so the agent can publish a view delta."""


def gang_refusal(scheduler: str) -> str:
    """Why a core whose own scheduler picks the nodes declines a part of a gang across sites
    (``Spread.all_or_nothing``): the coordinator hands every part its peers' addresses in the
    commit, before the part starts, and such a site knows them only once it has started."""
    return (
        f"this {scheduler} site does not take parts of a gang across sites: their peers are "
        f"given each replica's address before it starts, and {scheduler} chooses the nodes "
        "only as the job starts"
    )


def task_report(
    key: tuple[str, str, int],
    state: int,
    *,
    exit_code: int,
    output_tail: str,
    reason: str,
    devices: list[str],
    nodes: list[str] | None = None,
    checkpoint: jobs_pb2.CheckpointRecord | None = None,
    interrupted: bool = False,
    endpoints: list[jobs_pb2.Endpoint] | None = None,
    artifacts: list[jobs_pb2.Artifact] | None = None,
) -> site_link_service_pb2.TaskReport:
    """A task's state as every core reports it to the coordinator; ``interrupted``: the site
    stopped it for a reason of its own (see ``LocalCore.stop_cut_off``); ``endpoints``: a
    service's replicas; ``artifacts``: the outputs stored, once it succeeded."""
    job_id, task, epoch = key
    return site_link_service_pb2.TaskReport(
        job_id=job_id,
        task=task,
        epoch=epoch,
        state=state,  # type: ignore[arg-type]
        exit_code=exit_code,
        output_tail=output_tail,
        reason=reason,
        devices=devices,
        nodes=nodes or [],
        checkpoint=checkpoint,
        interrupted=interrupted,
        endpoints=endpoints or [],
        artifacts=artifacts or [],
    )


class LocalCore(Protocol):
    """A site's local scheduler, as the session layer drives it."""

    name: str
    """Scheduler name published in the site view, e.g. ``"embedded"`` or ``"slurm"``."""

    def nodes(self) -> list[resources_pb2.Node]:
        """Nodes with free cpu/memory and devices reflecting all held capacity.

        ``Device.allocated`` marks devices held whole; ``free_fraction`` and each partition
        profile's ``free`` say what shares and slots are left (see ``federation.agent.usage``).
        """
        ...

    def queue(self) -> resources_pb2.QueueState:
        """Pending (reserved, uncommitted) and running work."""
        ...

    def image_policy(self) -> tuple[str, list[str]]:
        """Why the site runs no task that names an image ("": it runs them), and the
        registries it pulls from (empty: any); published in the view for placement."""
        ...

    async def offer(self, offer: site_link_service_pb2.Offer) -> site_link_service_pb2.OfferAnswer:
        """Reserves capacity for every replica of a task, or declines with a reason."""
        ...

    async def commit(
        self, commit: site_link_service_pb2.Commit
    ) -> site_link_service_pb2.CommitAnswer:
        """Starts a reserved task."""
        ...

    async def change(
        self, change: site_link_service_pb2.ChangeTask
    ) -> site_link_service_pb2.ChangeAnswer:
        """Takes a running service's new spec (``federation.service_policy``: its replica
        count, command, env and policy), or declines it with a reason."""
        ...

    async def release(self, reservation_id: str) -> None:
        """Frees an uncommitted reservation; a no-op for an unknown one."""
        ...

    async def cancel(self, job_id: str, task: str, epoch: int, reason: str) -> None:
        """Stops a task (epoch 0 means any epoch); a no-op for an unknown task."""
        ...

    async def stop_cut_off(self, cut_off_s: float) -> None:
        """Stops, and waits for, every task whose offer's ``stop_after_disconnect_s`` is
        positive and at most ``cut_off_s``, the seconds the agent has been cut off from every
        coordinator. Each ends CANCELLED and is reported ``interrupted``; SIGKILL follows
        SIGTERM after at most ``stop_after.STOP_GRACE_S``. Tasks already stopping are left alone.
        """
        ...

    def tasks(self) -> list[site_link_service_pb2.TaskReport]:
        """Every task not yet forgotten: running ones and finished ones."""
        ...

    def forget(self, job_id: str, task: str, epoch: int) -> None:
        """Drops a finished task once the coordinator has recorded its final status."""
        ...

    async def close(self) -> None:
        """Lets go of the core without stopping running tasks (the session may restart)."""
        ...

    async def shutdown(self, grace_s: float) -> None:
        """Stops every running task (SIGTERM, SIGKILL after ``grace_s``), for agent exit."""
        ...
