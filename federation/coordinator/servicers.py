"""gRPC servicers: convert, call one service method, convert back. Nothing else."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, TypeAlias

import grpc

from federation.api.v1 import (
    admin_service_pb2 as admin_pb,
)
from federation.api.v1 import (
    admin_service_pb2_grpc as admin_grpc,
)
from federation.api.v1 import (
    audit_service_pb2 as audit_pb,
)
from federation.api.v1 import (
    audit_service_pb2_grpc as audit_grpc,
)
from federation.api.v1 import (
    certificate_service_pb2 as certificate_pb,
)
from federation.api.v1 import (
    certificate_service_pb2_grpc as certificate_grpc,
)
from federation.api.v1 import (
    data_service_pb2 as data_pb,
)
from federation.api.v1 import (
    data_service_pb2_grpc as data_grpc,
)
from federation.api.v1 import (
    job_service_pb2 as job_pb,
)
from federation.api.v1 import (
    job_service_pb2_grpc as job_grpc,
)
from federation.api.v1 import (
    serving_service_pb2 as serving_pb,
)
from federation.api.v1 import (
    serving_service_pb2_grpc as serving_grpc,
)
from federation.api.v1 import (
    site_link_service_pb2 as link_pb,
)
from federation.api.v1 import (
    site_link_service_pb2_grpc as link_grpc,
)
from federation.api.v1 import (
    store_service_pb2 as store_pb,
)
from federation.api.v1 import (
    store_service_pb2_grpc as store_grpc,
)
from federation.coordinator import audit
from federation.coordinator.ha.backup import backup_chunks
from federation.coordinator.jobs.redaction import for_reader, redact_for_reader
from federation.coordinator.jobs.serving import Serving
from federation.coordinator.security.authorities import Authorities
from federation.coordinator.services import Services
from federation.coordinator.sites.capacity import capacity_rows
from federation.security.identity import Role
from federation.security.interceptors import current_caller
from federation.security.pki import fingerprint
from federation.security.revocation import peer_certificate_of
from federation.security.tls import peer_certificate
from federation.store import Store

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"
Current: TypeAlias = Callable[[], Services]
"""The services of the current term; raises ``NotLeaderError`` on a follower."""

_JOBS = "/federation.api.v1.JobService/"
_SERVING = "/federation.api.v1.ServingService/"
_ADMIN = "/federation.api.v1.AdminService/"
_LINK = "/federation.api.v1.SiteLinkService/"
_AUDIT = "/federation.api.v1.AuditService/"
_CERTIFICATES = "/federation.api.v1.CertificateService/"
_STORE = "/federation.api.v1.StoreService/"
_DATA = "/federation.api.v1.DataService/"
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
            "StreamLogs",
            "GetCapacity",
        )
    },
    **{
        _ADMIN + m: OPERATORS
        for m in (
            "GetFederationStatus",
            "ListSites",
            "CordonSite",
            "UncordonSite",
            "DrainSite",
            "CreateJoinToken",
            "CreateQueue",
            "UpdateQueue",
            "DeleteQueue",
        )
    },
    # A tenant sees its own queues, with their usage and quotas; operators see all.
    _ADMIN + "ListQueues": CLIENTS,
    # Tenants for their own jobs (the job manager's visibility), operators for any.
    **{
        _SERVING + m: CLIENTS
        for m in ("ListEndpoints", "WatchEndpoints", "ScaleService", "UpdateService")
    },
    # A tenant registers, reads and removes its own datasets; operators any tenant's.
    **{
        _DATA + m: CLIENTS
        for m in ("RegisterDataset", "GetDataset", "ListDatasets", "RemoveDataset")
    },
    _AUDIT + "ListAuditEvents": OPERATORS,
    _CERTIFICATES + "RenewCertificate": frozenset(Role),
    _STORE + "BackupStore": OPERATORS,
    _CERTIFICATES + "GetTrustBundle": frozenset(Role),
    **{
        _CERTIFICATES + m: OPERATORS
        for m in (
            "ListCertificates",
            "RevokeCertificates",
            "GetRevocationList",
            "RotateCertificateAuthority",
            "RetireCertificateAuthorities",
        )
    },
    _LINK + "Connect": SITES,
}
JOB_COUNTS: dict[str, Callable[[Any], int]] = {
    _JOBS + "SubmitJob": lambda request: 1,
    _JOBS + "SubmitJobs": lambda request: len(request.specs),
}
"""How many jobs a request submits, for each identity's job rate limit."""
JOIN_METHOD = _LINK + "Join"
CONNECT_METHOD = _LINK + "Connect"
RENEW_METHOD = _CERTIFICATES + "RenewCertificate"
"""Sites' stream, whose envelopes of views may be far larger than any client request."""
OPEN_METHODS = frozenset(
    {
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    }
)


class JobServicer(job_grpc.JobServiceServicer):
    def __init__(self, current: Current) -> None:
        self._current = current

    async def ExplainJob(
        self, request: job_pb.ExplainJobRequest, context: Context
    ) -> job_pb.ExplainJobResponse:
        services = self._current()
        job = await services.manager.get(current_caller(), request.job_id)
        await services.scheduler.evaluate_selectors(job)
        return job_pb.ExplainJobResponse(job_id=job.id, tasks=services.scheduler.explain(job))

    async def SubmitJob(
        self, request: job_pb.SubmitJobRequest, context: Context
    ) -> job_pb.SubmitJobResponse:
        services = self._current()
        (job,) = await services.manager.submit(
            current_caller(), [request.spec], batch=False, validate_only=request.validate_only
        )
        shown = for_reader(current_caller(), job)  # registry passwords: never in a reply
        if not request.validate_only:
            return job_pb.SubmitJobResponse(job=shown)
        await services.scheduler.evaluate_selectors(job)
        return job_pb.SubmitJobResponse(job=shown, placement=services.scheduler.explain(job))

    async def SubmitJobs(
        self, request: job_pb.SubmitJobsRequest, context: Context
    ) -> job_pb.SubmitJobsResponse:
        caller = current_caller()
        jobs = await self._current().manager.submit(caller, request.specs, batch=True)
        return job_pb.SubmitJobsResponse(jobs=[for_reader(caller, job) for job in jobs])

    async def GetJob(
        self, request: job_pb.GetJobRequest, context: Context
    ) -> job_pb.GetJobResponse:
        manager = self._current().manager
        caller = current_caller()
        job = await manager.get(caller, request.job_id)
        events = await manager.events(job.id) if request.include_events else []
        return job_pb.GetJobResponse(job=for_reader(caller, job), events=events)

    async def ListJobs(
        self, request: job_pb.ListJobsRequest, context: Context
    ) -> job_pb.ListJobsResponse:
        caller = current_caller()
        reply = await self._current().manager.list_jobs(caller, request)
        redact_for_reader(caller, reply.jobs)
        return reply

    async def CancelJob(
        self, request: job_pb.CancelJobRequest, context: Context
    ) -> job_pb.CancelJobResponse:
        manager = self._current().manager
        caller = current_caller()
        job = await manager.cancel(caller, request.job_id, request.reason)
        return job_pb.CancelJobResponse(job=for_reader(caller, job))

    async def WatchJobs(
        self, request: job_pb.WatchJobsRequest, context: Context
    ) -> AsyncIterator[job_pb.WatchJobsResponse]:
        async for events in self._current().manager.watch(current_caller(), request):
            yield job_pb.WatchJobsResponse(events=events)

    async def GetCapacity(
        self, request: job_pb.GetCapacityRequest, context: Context
    ) -> job_pb.GetCapacityResponse:
        services = self._current()
        rows = capacity_rows(services.sites, services.jobs, current_caller())
        return job_pb.GetCapacityResponse(rows=rows)

    async def StreamLogs(
        self, request: job_pb.StreamLogsRequest, context: Context
    ) -> AsyncIterator[job_pb.StreamLogsResponse]:
        async for response in self._current().logs.stream(current_caller(), request):
            yield response


class ServingServicer(serving_grpc.ServingServiceServicer):
    def __init__(self, current: Current) -> None:
        self._current = current

    def _serving(self) -> Serving:
        return self._current().serving

    async def ListEndpoints(
        self, request: serving_pb.ListEndpointsRequest, context: Context
    ) -> serving_pb.ListEndpointsResponse:
        job_id, endpoints = await self._serving().endpoints(current_caller(), request.job_id)
        return serving_pb.ListEndpointsResponse(job_id=job_id, endpoints=endpoints)

    async def WatchEndpoints(
        self, request: serving_pb.WatchEndpointsRequest, context: Context
    ) -> AsyncIterator[serving_pb.WatchEndpointsResponse]:
        watch = self._serving().watch(current_caller(), request.job_id, request.ready_only)
        async for endpoints in watch:
            yield serving_pb.WatchEndpointsResponse(endpoints=endpoints)

    async def ScaleService(
        self, request: serving_pb.ScaleServiceRequest, context: Context
    ) -> serving_pb.ScaleServiceResponse:
        serving = self._serving()
        caller = current_caller()
        job = await serving.scale(caller, request.job_id, request.task, request.replicas)
        return serving_pb.ScaleServiceResponse(job=for_reader(caller, job))

    async def UpdateService(
        self, request: serving_pb.UpdateServiceRequest, context: Context
    ) -> serving_pb.UpdateServiceResponse:
        caller = current_caller()
        job = await self._serving().update(caller, request.job_id, request.spec)
        return serving_pb.UpdateServiceResponse(job=for_reader(caller, job))


class AdminServicer(admin_grpc.AdminServiceServicer):
    def __init__(self, current: Current) -> None:
        self._current = current

    async def GetFederationStatus(
        self, request: admin_pb.GetFederationStatusRequest, context: Context
    ) -> admin_pb.GetFederationStatusResponse:
        return await self._current().admin.status()

    async def ListSites(
        self, request: admin_pb.ListSitesRequest, context: Context
    ) -> admin_pb.ListSitesResponse:
        return self._current().admin.list_sites(request.page_size, request.page_token)

    async def CordonSite(
        self, request: admin_pb.CordonSiteRequest, context: Context
    ) -> admin_pb.CordonSiteResponse:
        admin = self._current().admin
        site = await admin.cordon(str(current_caller()), request.site, True, request.node)
        return admin_pb.CordonSiteResponse(site=site)

    async def UncordonSite(
        self, request: admin_pb.UncordonSiteRequest, context: Context
    ) -> admin_pb.UncordonSiteResponse:
        admin = self._current().admin
        site = await admin.cordon(str(current_caller()), request.site, False, request.node)
        return admin_pb.UncordonSiteResponse(site=site)

    async def DrainSite(
        self, request: admin_pb.DrainSiteRequest, context: Context
    ) -> admin_pb.DrainSiteResponse:
        admin = self._current().admin
        site = await admin.drain(
            str(current_caller()), request.site, request.node, request.deadline_s
        )
        return admin_pb.DrainSiteResponse(site=site)

    async def CreateJoinToken(
        self, request: admin_pb.CreateJoinTokenRequest, context: Context
    ) -> admin_pb.CreateJoinTokenResponse:
        return await self._current().enrollment.create_token(
            request.site, request.domain, request.ttl_s, str(current_caller())
        )

    async def CreateQueue(
        self, request: admin_pb.CreateQueueRequest, context: Context
    ) -> admin_pb.CreateQueueResponse:
        queue = await self._current().admin.create_queue(str(current_caller()), request.queue)
        return admin_pb.CreateQueueResponse(queue=queue)

    async def UpdateQueue(
        self, request: admin_pb.UpdateQueueRequest, context: Context
    ) -> admin_pb.UpdateQueueResponse:
        queue = await self._current().admin.update_queue(str(current_caller()), request.queue)
        return admin_pb.UpdateQueueResponse(queue=queue)

    async def ListQueues(
        self, request: admin_pb.ListQueuesRequest, context: Context
    ) -> admin_pb.ListQueuesResponse:
        return admin_pb.ListQueuesResponse(queues=self._current().admin.queues(current_caller()))

    async def DeleteQueue(
        self, request: admin_pb.DeleteQueueRequest, context: Context
    ) -> admin_pb.DeleteQueueResponse:
        await self._current().admin.delete_queue(str(current_caller()), request.name)
        return admin_pb.DeleteQueueResponse()


class DataServicer(data_grpc.DataServiceServicer):
    def __init__(self, current: Current) -> None:
        self._current = current

    async def RegisterDataset(
        self, request: data_pb.RegisterDatasetRequest, context: Context
    ) -> data_pb.RegisterDatasetResponse:
        registry = self._current().datasets
        if request.copy:
            dataset = await registry.add_copy(current_caller(), request.dataset)
        else:
            dataset = await registry.register(current_caller(), request.dataset)
        return data_pb.RegisterDatasetResponse(dataset=dataset)

    async def GetDataset(
        self, request: data_pb.GetDatasetRequest, context: Context
    ) -> data_pb.GetDatasetResponse:
        dataset = self._current().datasets.get(current_caller(), request.name, request.tenant)
        return data_pb.GetDatasetResponse(dataset=dataset)

    async def ListDatasets(
        self, request: data_pb.ListDatasetsRequest, context: Context
    ) -> data_pb.ListDatasetsResponse:
        found = self._current().datasets.visible(current_caller(), request.tenant)
        return data_pb.ListDatasetsResponse(datasets=found)

    async def RemoveDataset(
        self, request: data_pb.RemoveDatasetRequest, context: Context
    ) -> data_pb.RemoveDatasetResponse:
        await self._current().datasets.remove(current_caller(), request.name, request.tenant)
        return data_pb.RemoveDatasetResponse()


class AuditServicer(audit_grpc.AuditServiceServicer):
    def __init__(self, current: Current) -> None:
        self._current = current

    async def ListAuditEvents(
        self, request: audit_pb.ListAuditEventsRequest, context: Context
    ) -> audit_pb.ListAuditEventsResponse:
        return await audit.list_events(self._current().jobs.store, request)


class CertificateServicer(certificate_grpc.CertificateServiceServicer):
    def __init__(self, current: Current) -> None:
        self._current = current

    async def RenewCertificate(
        self, request: certificate_pb.RenewCertificateRequest, context: Context
    ) -> certificate_pb.RenewCertificateResponse:
        certificate = peer_certificate(context) or b""  # the handshake required one
        return await self._current().renewal.renew(current_caller(), certificate, request.csr_pem)

    async def ListCertificates(
        self, request: certificate_pb.ListCertificatesRequest, context: Context
    ) -> certificate_pb.ListCertificatesResponse:
        return await self._current().certificates.list(request)

    async def RevokeCertificates(
        self, request: certificate_pb.RevokeCertificatesRequest, context: Context
    ) -> certificate_pb.RevokeCertificatesResponse:
        return await self._current().certificates.revoke(str(current_caller()), request)

    async def GetRevocationList(
        self, request: certificate_pb.GetRevocationListRequest, context: Context
    ) -> certificate_pb.GetRevocationListResponse:
        return await self._current().certificates.revocation_list()

    async def GetTrustBundle(
        self, request: certificate_pb.GetTrustBundleRequest, context: Context
    ) -> certificate_pb.GetTrustBundleResponse:
        return _authorities(self._current()).trust_bundle()

    async def RotateCertificateAuthority(
        self, request: certificate_pb.RotateCertificateAuthorityRequest, context: Context
    ) -> certificate_pb.RotateCertificateAuthorityResponse:
        services = self._current()
        return await _authorities(services).rotate(_store(services), str(current_caller()), request)

    async def RetireCertificateAuthorities(
        self, request: certificate_pb.RetireCertificateAuthoritiesRequest, context: Context
    ) -> certificate_pb.RetireCertificateAuthoritiesResponse:
        services = self._current()
        return await _authorities(services).retire(_store(services), str(current_caller()))


def _authorities(services: Services) -> Authorities:
    assert services.authorities is not None, "start_services sets it"
    return services.authorities


def _store(services: Services) -> Store:
    assert services.store is not None, "start_services sets it"
    return services.store


class StoreServicer(store_grpc.StoreServiceServicer):
    def __init__(self, current: Current) -> None:
        self._current = current

    async def BackupStore(
        self, request: store_pb.BackupStoreRequest, context: Context
    ) -> AsyncIterator[store_pb.BackupStoreResponse]:
        async for chunk in backup_chunks(self._current().jobs.store, str(current_caller())):
            yield chunk


class SiteLinkServicer(link_grpc.SiteLinkServiceServicer):
    def __init__(self, current: Current, *, serves_connect: bool) -> None:
        self._current = current
        self._serves_connect = serves_connect

    async def Join(self, request: link_pb.JoinRequest, context: Context) -> link_pb.JoinResponse:
        return await self._current().enrollment.join(request)

    async def Connect(
        self, request_iterator: AsyncIterator[link_pb.ConnectRequest], context: Context
    ) -> AsyncIterator[link_pb.ConnectResponse]:
        assert self._serves_connect, "Connect is served only on the mTLS port"
        services = self._current()
        certificate = peer_certificate(context) or b""
        serial = peer_certificate_of(certificate).serial_hex  # cached: parsed by the auth
        async for response in services.link.connect(
            current_caller(), fingerprint(certificate), context.peer(), request_iterator, serial
        ):
            yield response
        if services.ended is not None:
            raise services.ended  # stepped down: the agent moves to the new leader
