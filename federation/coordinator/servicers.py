"""gRPC servicers: convert, call one service method, convert back. Nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc

from federation.api.v1 import (
    admin_service_pb2 as admin_pb,
)
from federation.api.v1 import (
    admin_service_pb2_grpc as admin_grpc,
)
from federation.api.v1 import (
    job_service_pb2 as job_pb,
)
from federation.api.v1 import (
    job_service_pb2_grpc as job_grpc,
)
from federation.api.v1 import (
    site_link_service_pb2 as link_pb,
)
from federation.api.v1 import (
    site_link_service_pb2_grpc as link_grpc,
)
from federation.coordinator.admin import Admin
from federation.coordinator.enrollment import Enrollment
from federation.coordinator.job_manager import JobManager
from federation.coordinator.scheduler import Scheduler
from federation.coordinator.site_link import SiteLink
from federation.security.identity import Role
from federation.security.interceptors import current_caller
from federation.security.pki import fingerprint
from federation.security.tls import peer_certificate

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"

_JOBS = "/federation.api.v1.JobService/"
_ADMIN = "/federation.api.v1.AdminService/"
_LINK = "/federation.api.v1.SiteLinkService/"
CLIENTS = frozenset({Role.OPERATOR, Role.TENANT})
OPERATORS = frozenset({Role.OPERATOR})
SITES = frozenset({Role.SITE})

METHOD_ROLES: dict[str, frozenset[Role]] = {
    **{
        _JOBS + m: CLIENTS
        for m in (
            "SubmitJob",
            "SubmitJobs",
            "GetJob",
            "ListJobs",
            "CancelJob",
            "WatchJobs",
            "ExplainJob",
        )
    },
    **{
        _ADMIN + m: OPERATORS
        for m in (
            "GetFederationStatus",
            "ListSites",
            "CordonSite",
            "UncordonSite",
            "CreateJoinToken",
        )
    },
    _LINK + "Connect": SITES,
}
JOIN_METHOD = _LINK + "Join"
OPEN_METHODS = frozenset(
    {
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    }
)


class JobServicer(job_grpc.JobServiceServicer):
    def __init__(self, jobs: JobManager, scheduler: Scheduler) -> None:
        self._jobs = jobs
        self._scheduler = scheduler

    async def ExplainJob(
        self, request: job_pb.ExplainJobRequest, context: Context
    ) -> job_pb.ExplainJobResponse:
        job = await self._jobs.get(current_caller(), request.job_id)
        return job_pb.ExplainJobResponse(job_id=job.id, tasks=self._scheduler.explain(job))

    async def SubmitJob(
        self, request: job_pb.SubmitJobRequest, context: Context
    ) -> job_pb.SubmitJobResponse:
        (job,) = await self._jobs.submit(current_caller(), [request.spec], batch=False)
        return job_pb.SubmitJobResponse(job=job)

    async def SubmitJobs(
        self, request: job_pb.SubmitJobsRequest, context: Context
    ) -> job_pb.SubmitJobsResponse:
        jobs = await self._jobs.submit(current_caller(), request.specs, batch=True)
        return job_pb.SubmitJobsResponse(jobs=jobs)

    async def GetJob(
        self, request: job_pb.GetJobRequest, context: Context
    ) -> job_pb.GetJobResponse:
        job = await self._jobs.get(current_caller(), request.job_id)
        events = await self._jobs.events(job.id) if request.include_events else []
        return job_pb.GetJobResponse(job=job, events=events)

    async def ListJobs(
        self, request: job_pb.ListJobsRequest, context: Context
    ) -> job_pb.ListJobsResponse:
        return await self._jobs.list_jobs(current_caller(), request)

    async def CancelJob(
        self, request: job_pb.CancelJobRequest, context: Context
    ) -> job_pb.CancelJobResponse:
        job = await self._jobs.cancel(current_caller(), request.job_id, request.reason)
        return job_pb.CancelJobResponse(job=job)

    async def WatchJobs(
        self, request: job_pb.WatchJobsRequest, context: Context
    ) -> AsyncIterator[job_pb.WatchJobsResponse]:
        async for event in self._jobs.watch(current_caller(), request):
            yield job_pb.WatchJobsResponse(event=event)


class AdminServicer(admin_grpc.AdminServiceServicer):
    def __init__(self, admin: Admin, enrollment: Enrollment) -> None:
        self._admin = admin
        self._enrollment = enrollment

    async def GetFederationStatus(
        self, request: admin_pb.GetFederationStatusRequest, context: Context
    ) -> admin_pb.GetFederationStatusResponse:
        return await self._admin.status()

    async def ListSites(
        self, request: admin_pb.ListSitesRequest, context: Context
    ) -> admin_pb.ListSitesResponse:
        return admin_pb.ListSitesResponse(sites=self._admin.sites())

    async def CordonSite(
        self, request: admin_pb.CordonSiteRequest, context: Context
    ) -> admin_pb.CordonSiteResponse:
        return admin_pb.CordonSiteResponse(site=await self._admin.cordon(request.site, True))

    async def UncordonSite(
        self, request: admin_pb.UncordonSiteRequest, context: Context
    ) -> admin_pb.UncordonSiteResponse:
        return admin_pb.UncordonSiteResponse(site=await self._admin.cordon(request.site, False))

    async def CreateJoinToken(
        self, request: admin_pb.CreateJoinTokenRequest, context: Context
    ) -> admin_pb.CreateJoinTokenResponse:
        return await self._enrollment.create_token(
            request.site, request.domain, request.ttl_s, str(current_caller())
        )


class SiteLinkServicer(link_grpc.SiteLinkServiceServicer):
    def __init__(self, enrollment: Enrollment, link: SiteLink | None) -> None:
        self._enrollment = enrollment
        self._link = link

    async def Join(self, request: link_pb.JoinRequest, context: Context) -> link_pb.JoinResponse:
        return await self._enrollment.join(request)

    async def Connect(
        self, request_iterator: AsyncIterator[link_pb.ConnectRequest], context: Context
    ) -> AsyncIterator[link_pb.ConnectResponse]:
        assert self._link is not None, "Connect is served only on the mTLS port"
        certificate = peer_certificate(context) or b""
        async for response in self._link.connect(
            current_caller(), fingerprint(certificate), request_iterator
        ):
            yield response
