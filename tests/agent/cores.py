"""Builders and a recorder shared by the tests of the embedded core."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from federation.agent.embedded_core import EmbeddedCore
from federation.api.v1 import jobs_pb2, resources_pb2, site_link_service_pb2

GPU = resources_pb2.DEVICE_KIND_GPU
NPU = resources_pb2.DEVICE_KIND_NPU
RUNNING = jobs_pb2.JOB_STATE_RUNNING
SUCCEEDED = jobs_pb2.JOB_STATE_SUCCEEDED
FAILED = jobs_pb2.JOB_STATE_FAILED
CANCELLED = jobs_pb2.JOB_STATE_CANCELLED
FINAL = (SUCCEEDED, FAILED, CANCELLED)
# Writes the child's environment to env.json in its working directory.
DUMP_ENV = "import json, os; json.dump(dict(os.environ), open('env.json', 'w'))"


def node(
    name: str,
    *,
    devices: int = 0,
    kind: resources_pb2.DeviceKind.ValueType = GPU,
    vendor: str = "nvidia",
    model: str = "H100",
    group: str = "",
    cpu: float = 32,
    memory_mib: int = 65536,
    shareable: bool = False,
    partitions: Mapping[str, int] | None = None,
    attributes: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    arch: str = "",
) -> resources_pb2.Node:
    """A schedulable node of ``devices`` alike devices; ``partitions`` maps profile to count."""
    profiles = [
        resources_pb2.PartitionProfile(profile=profile, total=count, free=count)
        for profile, count in (partitions or {}).items()
    ]
    return resources_pb2.Node(
        name=name,
        cpu_cores=cpu,
        memory_mib=memory_mib,
        schedulable=True,
        labels=dict(labels or {}),
        arch=arch,
        devices=[
            resources_pb2.Device(
                id=f"{name}-{i}",
                index=i,
                kind=kind,
                vendor=vendor,
                model=model,
                memory_total_mib=81920,
                interconnect_group=group,
                health=resources_pb2.DEVICE_HEALTH_HEALTHY,
                shareable=shareable,
                partitions=profiles,
                attributes=dict(attributes or {}),
            )
            for i in range(devices)
        ],
    )


def offer(
    job_id: str = "job-1",
    *,
    task: str = "train",
    epoch: int = 1,
    code: str = "pass",
    command: Sequence[str] | None = None,
    replicas: int = 0,
    devices: int = 0,
    kind: resources_pb2.DeviceKind.ValueType = GPU,
    vendor: str = "",
    models: Sequence[str] = (),
    fraction: float = 0.0,
    share_memory_mib: int = 0,
    partition: str = "",
    selector: str = "",
    same_interconnect: bool = False,
    cpu: float = 1,
    memory_mib: int = 256,
    lease_s: float = 30,
    timeout_s: float = 0,
    env: dict[str, str] | None = None,
    requires: Mapping[str, str] | None = None,
    node_labels: Mapping[str, str] | None = None,
    stop_after_s: float = 0,
) -> site_link_service_pb2.Offer:
    """An offer of one task that runs ``code`` (or ``command``) per replica."""
    accelerator = jobs_pb2.AcceleratorRequest(
        kind=kind,
        count=devices,
        vendor=vendor,
        models=models,
        fraction=fraction,
        memory_mib=share_memory_mib,
        partition=partition,
        selector=selector,
        same_interconnect=same_interconnect,
    )
    spec = jobs_pb2.TaskSpec(
        name=task,
        command=command if command is not None else [sys.executable, "-c", code],
        env=env or {},
        replicas=replicas,
        resources=jobs_pb2.ResourceRequest(cpu=cpu, memory_mib=memory_mib, accelerator=accelerator),
        timeout_s=timeout_s,
        requires=requires or {},
    )
    return site_link_service_pb2.Offer(
        job_id=job_id,
        task=task,
        epoch=epoch,
        spec=spec,
        lease_s=lease_s,
        node_labels=node_labels or {},
        stop_after_disconnect_s=stop_after_s,
    )


def commit_for(
    o: site_link_service_pb2.Offer, answer: site_link_service_pb2.OfferAnswer
) -> site_link_service_pb2.Commit:
    return site_link_service_pb2.Commit(
        reservation_id=answer.reservation_id, job_id=o.job_id, task=o.task, epoch=o.epoch
    )


def allocated(core: EmbeddedCore) -> dict[str, list[int]]:
    """Allocated device indices per node."""
    return {n.name: [d.index for d in n.devices if d.allocated] for n in core.nodes()}


class Recorder:
    """Collects what the core reports, and lets tests wait for it."""

    def __init__(self) -> None:
        self.reports: list[site_link_service_pb2.TaskReport] = []
        self.changes = 0
        self.changed = asyncio.Event()
        self._reported = asyncio.Event()

    def on_status(self, report: site_link_service_pb2.TaskReport) -> None:
        self.reports.append(report)
        self._reported.set()

    def on_change(self) -> None:
        self.changes += 1
        self.changed.set()

    async def final(self, job_id: str = "job-1", timeout_s: float = 15.0) -> Any:
        """Waits for the job's final report."""
        async with asyncio.timeout(timeout_s):
            while True:
                for report in self.reports:
                    if report.job_id == job_id and report.state in FINAL:
                        return report
                self._reported.clear()
                await self._reported.wait()

    async def reached(self, job_id: str, state: int, timeout_s: float = 15.0) -> None:
        """Waits for a report of the job in ``state``."""
        async with asyncio.timeout(timeout_s):
            while state not in self.states(job_id):
                self._reported.clear()
                await self._reported.wait()

    def states(self, job_id: str = "job-1") -> list[int]:
        return [r.state for r in self.reports if r.job_id == job_id]


async def run(core: EmbeddedCore, o: site_link_service_pb2.Offer) -> None:
    """Offers and commits ``o``, asserting both succeed."""
    answer = await core.offer(o)
    assert answer.accepted, answer.reason
    started = await core.commit(commit_for(o, answer))
    assert started.started, started.reason
