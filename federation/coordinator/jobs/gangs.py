"""Gangs across sites: the parts of a task with ``spread.all_or_nothing`` start all together
or not at all, and stop and start again together.

Placing: the scheduler considers a gang's parts together, once every part is PENDING and
none is being negotiated; if one part has no site now, none is offered (``Scheduler``). Each
part that has a site holds a reservation there (the sites' offers and leases); only when
every part holds one are all committed at once; a part that no site took by the end of its
rounds lets every reservation of the gang go, and the gang waits. Two gangs that want the
same sites do not deadlock: the scheduling cycle walks the line in order and counts the
devices it has offered (``scheduling.admission.with_devices_left``), so the later gang finds
no room while the earlier one holds it, and whatever a gang holds is let go when its rounds
end.

Running: ``GangKeeper`` looks each second for a gang with a part back in PENDING (lost with
its site, preempted, its commit refused, or failed with a retry left) while others are still
at their sites, and stops those as preemption stops a task; their final reports put them back
to PENDING, and the gang is placed again as one, from each part's newest checkpoint.

Rendezvous: each part's commit carries every replica's ``host:port`` in rank order (parts by
number, then replicas) and its first rank; a replica gets ``FEDERATION_GANG_PEERS``,
``FEDERATION_GANG_RANK``, ``FEDERATION_GANG_SIZE`` and ``FEDERATION_GANG_PORT``. A site's host
is the address its agent's link probe was found on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence

import structlog

from federation.api.v1 import jobs_pb2
from federation.common import job_state
from federation.coordinator.jobs.repository import JobRepository
from federation.coordinator.jobs.spread import part_number, part_of
from federation.coordinator.policy.preemption import TaskAt

log = structlog.get_logger()

KEEP_EVERY_S = 1.0
DEFAULT_RENDEZVOUS_PORT = 29500

Stop = Callable[[Sequence[TaskAt], str], Awaitable[None]]
"""Stops tasks as preemption does, for the reason given (``Scheduler.stop``)."""


def gang_of(spec: jobs_pb2.TaskSpec, name: str) -> str:
    """The gang (the divided task's name) that task ``name`` is a part of; "" for none."""
    return part_of(name) if spec.spread.all_or_nothing else ""


def gangs(job: jobs_pb2.Job) -> dict[str, list[jobs_pb2.TaskStatus]]:
    """The job's gangs: each divided all-or-nothing task's parts, by part number. Read for
    every job the scheduling cycle walks: a job with no gang costs one field per task."""
    if not any(t.spread.all_or_nothing for t in job.spec.tasks):
        return {}
    specs = {t.name: t for t in job.spec.tasks}
    found: dict[str, list[jobs_pb2.TaskStatus]] = {}
    for task in job.tasks:
        spec = specs.get(task.name)
        if spec is not None and (gang := gang_of(spec, task.name)):
            found.setdefault(gang, []).append(task)
    for parts in found.values():
        parts.sort(key=lambda t: part_number(t.name))
    return found


def rendezvous(
    parts: Sequence[tuple[str, str, int]], hosts: Mapping[str, str], base_port: int
) -> tuple[list[str], dict[str, int]]:
    """Every replica's ``host:port`` in rank order and each part's first rank, for parts
    ``(name, site, replicas)`` (any order: ranked by part number)."""
    peers: list[str] = []
    first: dict[str, int] = {}
    port = base_port or DEFAULT_RENDEZVOUS_PORT
    for name, site, replicas in sorted(parts, key=lambda p: part_number(p[0])):
        first[name] = len(peers)
        host = hosts.get(site, "")
        shown = f"[{host}]" if ":" in host else host
        peers.extend(f"{shown}:{port + r}" for r in range(max(1, replicas)))
    return peers, first


def host_of(probe_endpoint: str, peer: str) -> str:
    """Where a site's agent is reached: its probe endpoint's host, else the address its
    stream came from (gRPC's ``ipv4:10.0.0.7:51234``)."""
    if probe_endpoint:
        return probe_endpoint.rpartition(":")[0].strip("[]")
    address = peer.partition(":")[2]
    return address.rpartition(":")[0].strip("[]")


def broken(parts: Sequence[jobs_pb2.TaskStatus]) -> tuple[jobs_pb2.TaskStatus, list[TaskAt]]:
    """A part back in PENDING and the gang's parts still at their sites (not being stopped
    already) to stop for it; (the part, []) when there is nothing to stop."""
    back = next((t for t in parts if t.state == job_state.PENDING), None)
    if back is None:
        return jobs_pb2.TaskStatus(), []
    running = [
        TaskAt("", t.name, t.site, t.epoch)
        for t in parts
        if t.state in job_state.AT_SITE and not t.preempted_by
    ]
    return back, running


class GangKeeper:
    """Stops the rest of a gang once one of its parts is back in PENDING."""

    def __init__(self, jobs: JobRepository, stop: Stop) -> None:
        self._jobs = jobs
        self._stop = stop

    async def run(self) -> None:
        while True:
            await self.step()
            await asyncio.sleep(KEEP_EVERY_S)

    async def step(self) -> None:
        for job, gang, back, running in list(self._to_stop()):
            why = (
                f"gang {gang}: part {back.name} is waiting to be placed again "
                f"({back.reason or 'lost'}); its parts stop and start again together"
            )
            log.info("gang_restarting", job=job, gang=gang, part=back.name)
            try:
                await self._stop([TaskAt(job, t.task, t.site, t.epoch) for t in running], why)
            except Exception:
                log.exception("gang_stop_failed", job=job, gang=gang)

    def _to_stop(self) -> Iterator[tuple[str, str, jobs_pb2.TaskStatus, list[TaskAt]]]:
        for job in self._jobs.at_site():
            if job.cancel_requested:
                continue
            for gang, parts in gangs(job).items():
                back, running = broken(parts)
                if running:
                    yield job.id, gang, back, running
