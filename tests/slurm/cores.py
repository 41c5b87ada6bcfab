"""A Slurm core under test and what it reported, shared by the tests of the Slurm core."""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from datacenter_agent.slurm.cli import parse_records
from datacenter_agent.slurm.core import SlurmCore
from federation.api.v1 import jobs_pb2, site_link_service_pb2
from federation.testing.slurm_cluster import LocalSlurmCluster

from .tasks import eventually

RUNNING = jobs_pb2.JOB_STATE_RUNNING
FINAL = (jobs_pb2.JOB_STATE_SUCCEEDED, jobs_pb2.JOB_STATE_FAILED, jobs_pb2.JOB_STATE_CANCELLED)
sites = itertools.count(1)


@dataclass
class Harness:
    """A core under test and every report it made."""

    core: SlurmCore
    site: str
    reports: list[site_link_service_pb2.TaskReport] = field(default_factory=list)
    is_closed: bool = False

    async def shutdown(self) -> None:
        """Lets go of the core as an exiting agent does; its Slurm jobs keep running."""
        if not self.is_closed:
            self.is_closed = True
            await self.core.shutdown(1.0)

    def last(self, job_id: str) -> site_link_service_pb2.TaskReport | None:
        return next((r for r in reversed(self.reports) if r.job_id == job_id), None)

    def of(self, job_id: str) -> list[site_link_service_pb2.TaskReport]:
        return [r for r in self.reports if r.job_id == job_id]

    async def until_final(self, job_id: str) -> site_link_service_pb2.TaskReport:
        def ended() -> bool:
            report = self.last(job_id)
            return report is not None and report.state in FINAL

        await eventually(ended, f"{job_id} ended")
        report = self.last(job_id)
        assert report is not None
        return report

    async def offer(
        self,
        job_id: str,
        spec: jobs_pb2.TaskSpec,
        lease_s: float = 30,
        *,
        epoch: int = 1,
        restore: jobs_pb2.CheckpointRecord | None = None,
        stop_after_s: float = 0,
        tenant: str = "",
    ) -> site_link_service_pb2.OfferAnswer:
        offer = site_link_service_pb2.Offer(
            tenant=tenant,
            job_id=job_id,
            task="main",
            epoch=epoch,
            spec=spec,
            lease_s=lease_s,
            stop_after_disconnect_s=stop_after_s,
        )
        if restore is not None:
            offer.restore.CopyFrom(restore)
        return await self.core.offer(offer)

    async def run(
        self,
        job_id: str,
        spec: jobs_pb2.TaskSpec,
        *,
        epoch: int = 1,
        restore: jobs_pb2.CheckpointRecord | None = None,
        stop_after_s: float = 0,
        tenant: str = "",
    ) -> str:
        """Offers and commits; returns the Slurm job id."""
        answer = await self.offer(
            job_id, spec, epoch=epoch, restore=restore, stop_after_s=stop_after_s, tenant=tenant
        )
        assert answer.accepted, answer.reason
        commit = site_link_service_pb2.Commit(
            reservation_id=answer.reservation_id, job_id=job_id, task="main", epoch=epoch
        )
        assert (await self.core.commit(commit)).started
        return answer.reservation_id.removeprefix("slurm-")


MakeCore = Callable[..., Awaitable[Harness]]


def slurm_job(cluster: LocalSlurmCluster, slurm_id: str) -> dict[str, str]:
    """What ``scontrol show job`` says of one job now."""
    records = parse_records(cluster.run("scontrol", "show", "job", "-o", slurm_id))
    return dict(records[0].pairs)
