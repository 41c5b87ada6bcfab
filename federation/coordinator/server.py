"""Build and start a coordinator: store, services, the mTLS port and the join port."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from federation.api.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    job_service_pb2,
    job_service_pb2_grpc,
    site_link_service_pb2,
    site_link_service_pb2_grpc,
)
from federation.coordinator.admin import Admin
from federation.coordinator.config import CoordinatorConfig
from federation.coordinator.enrollment import Enrollment
from federation.coordinator.events import EventHub
from federation.coordinator.job_manager import JobManager
from federation.coordinator.jobs import JobRepository
from federation.coordinator.scheduler import Scheduler, SchedulerConfig
from federation.coordinator.servicers import (
    JOIN_METHOD,
    METHOD_ROLES,
    OPEN_METHODS,
    AdminServicer,
    JobServicer,
    SiteLinkServicer,
)
from federation.coordinator.site_link import SiteLink
from federation.coordinator.sites import SiteRegistry
from federation.placement.registry import build_framework
from federation.security.interceptors import AuthInterceptor
from federation.security.pki import CertificateAuthority
from federation.security.tls import TlsFiles, server_credentials
from federation.store import SqliteStore, Store

log = structlog.get_logger()

SERVICE_NAMES = (
    job_service_pb2.DESCRIPTOR.services_by_name["JobService"].full_name,
    admin_service_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
    site_link_service_pb2.DESCRIPTOR.services_by_name["SiteLinkService"].full_name,
)


@dataclass
class Coordinator:
    """A running coordinator; ``stop`` shuts everything it started."""

    server: grpc.aio.Server
    join_server: grpc.aio.Server
    port: int
    join_port: int
    store: Store
    scheduler: Scheduler
    scheduler_task: asyncio.Task[None]

    async def stop(self, grace_s: float | None = 1.0) -> None:
        self.scheduler_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.scheduler_task
        await self.scheduler.close()
        await asyncio.gather(self.server.stop(grace_s), self.join_server.stop(grace_s))
        await self.store.close()


def _health(server: grpc.aio.Server) -> health_aio.HealthServicer:
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    return health


async def start_coordinator(config: CoordinatorConfig) -> Coordinator:
    """Open the store, recover state, and serve on both ports (port 0 picks a free one)."""
    config.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    store = await SqliteStore.open(config.data_dir / "federation.db")
    ca = CertificateAuthority.load(config.ca_cert, config.ca_key)
    hub = EventHub()
    jobs = JobRepository(store, hub)
    scheduler_ref: list[Scheduler] = []

    def wake() -> None:
        if scheduler_ref:
            scheduler_ref[0].wake()

    sites = SiteRegistry(store, wake)
    await sites.load()
    recovered = await jobs.load()
    scheduler = Scheduler(
        jobs,
        sites,
        build_framework(config.placement_filters, config.placement_scores, config.compat_table),
        SchedulerConfig(
            offer_timeout_s=config.offer_timeout_s,
            reservation_lease_s=config.reservation_lease_s,
            retry_interval_s=config.retry_interval_s,
            max_offers_per_round=config.max_offers_per_round,
            offers_at_once=config.offers_at_once,
        ),
    )
    scheduler_ref.append(scheduler)
    manager = JobManager(jobs, sites, hub, wake)
    await manager.recover()
    enrollment = Enrollment(store, sites, ca)
    link = SiteLink(sites, manager, config.heartbeat_interval_s)

    tls = TlsFiles(ca=config.ca_cert, cert=config.cert, key=config.key)
    server = grpc.aio.server(
        interceptors=[AuthInterceptor(METHOD_ROLES, open_methods=OPEN_METHODS)],
        options=[
            # Ping idle peers so a connection that vanished without a FIN is noticed.
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ],
    )
    job_service_pb2_grpc.add_JobServiceServicer_to_server(JobServicer(manager, scheduler), server)
    admin_service_pb2_grpc.add_AdminServiceServicer_to_server(
        AdminServicer(Admin(sites, jobs), enrollment), server
    )
    site_link_service_pb2_grpc.add_SiteLinkServiceServicer_to_server(
        SiteLinkServicer(enrollment, link), server
    )
    health = _health(server)
    reflection.enable_server_reflection((*SERVICE_NAMES, reflection.SERVICE_NAME), server)
    port = server.add_secure_port(config.listen, server_credentials(tls))

    join_server = grpc.aio.server(
        interceptors=[AuthInterceptor(None, open_methods={JOIN_METHOD, *OPEN_METHODS})]
    )
    site_link_service_pb2_grpc.add_SiteLinkServiceServicer_to_server(
        SiteLinkServicer(enrollment, None), join_server
    )
    join_health = _health(join_server)
    join_port = join_server.add_secure_port(
        config.join_listen, server_credentials(tls, require_client_auth=False)
    )
    await server.start()
    await join_server.start()
    for h in (health, join_health):
        await h.set("", health_pb2.HealthCheckResponse.SERVING)
    scheduler_task = asyncio.create_task(scheduler.run())
    log.info(
        "coordinator_started",
        port=port,
        join_port=join_port,
        jobs_recovered=len(recovered),
        sites=len(sites.names()),
    )
    return Coordinator(server, join_server, port, join_port, store, scheduler, scheduler_task)
