"""Build and start a coordinator: store, services, the mTLS port and the join port.

With the embedded store the coordinator leads from the start. With etcd it serves as a
follower (health, and ``NOT_LEADER`` refusals that name the leader) until it wins the
election, then loads its state from etcd and leads until it loses the lease or stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from federation import __version__
from federation.api.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    audit_service_pb2,
    audit_service_pb2_grpc,
    certificate_service_pb2,
    certificate_service_pb2_grpc,
    data_service_pb2,
    data_service_pb2_grpc,
    job_service_pb2,
    job_service_pb2_grpc,
    serving_service_pb2,
    serving_service_pb2_grpc,
    site_link_service_pb2,
    site_link_service_pb2_grpc,
    store_service_pb2,
    store_service_pb2_grpc,
)
from federation.common.probe import ProbeServer
from federation.coordinator.config import STORE_FILE, CoordinatorConfig
from federation.coordinator.ha.fencing import FencedStore
from federation.coordinator.ha.leader import CoordinatorInfo, LeaderElection
from federation.coordinator.ha.leadership import Leadership
from federation.coordinator.layout import check_layout
from federation.coordinator.security.authorities import Authorities
from federation.coordinator.servicers import (
    CONNECT_METHOD,
    JOB_COUNTS,
    JOIN_METHOD,
    METHOD_ROLES,
    OPEN_METHODS,
    RENEW_METHOD,
    AdminServicer,
    AuditServicer,
    CertificateServicer,
    DataServicer,
    JobServicer,
    ServingServicer,
    SiteLinkServicer,
    StoreServicer,
)
from federation.coordinator.services import ListCoordinators, start_services
from federation.envelopes import MAX_STREAM_MESSAGE_BYTES
from federation.security.interceptors import AuthInterceptor
from federation.security.revocation import RevocationBook
from federation.security.throttle import Throttle, ThrottleLimits
from federation.security.tls import TlsFiles
from federation.store import SqliteStore, Store, StoreUnreachableError
from federation.store.etcd import EtcdStore
from federation.store.revocations import follow, load

log = structlog.get_logger()

SERVICE_NAMES = (
    job_service_pb2.DESCRIPTOR.services_by_name["JobService"].full_name,
    serving_service_pb2.DESCRIPTOR.services_by_name["ServingService"].full_name,
    admin_service_pb2.DESCRIPTOR.services_by_name["AdminService"].full_name,
    audit_service_pb2.DESCRIPTOR.services_by_name["AuditService"].full_name,
    certificate_service_pb2.DESCRIPTOR.services_by_name["CertificateService"].full_name,
    site_link_service_pb2.DESCRIPTOR.services_by_name["SiteLinkService"].full_name,
    store_service_pb2.DESCRIPTOR.services_by_name["StoreService"].full_name,
    data_service_pb2.DESCRIPTOR.services_by_name["DataService"].full_name,
)
_WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]"})
_NO_PORT_SHARING = ("grpc.so_reuseport", 0)
"""gRPC sets SO_REUSEPORT by default, so a second coordinator could bind a port in use and the
kernel would split connections between the two: a used port must fail to bind instead."""


class ListenError(OSError):
    """A port cannot be bound (in use, or an address this host does not have)."""


def _bind(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials) -> int:
    problem = ListenError(
        f"cannot listen on {address}: the port is in use or the address is not this "
        "host's. To fix: stop what holds it, or choose another address"
    )
    if not _can_bind(address):
        raise problem  # said before gRPC tries, which would also print a line of its own
    try:
        return server.add_secure_port(address, credentials)
    except RuntimeError:
        raise problem from None


def _can_bind(address: str) -> bool:
    """Whether ``host:port`` can be bound now (port 0 always can)."""
    host, _, port = address.rpartition(":")
    if not port.isdigit() or int(port) == 0:
        return True
    host = host.strip("[]") or "::"
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError:
        return True  # let gRPC say what it makes of the name
    for family, kind, proto, _, where in infos:
        with socket.socket(family, kind, proto) as probe:
            # as gRPC binds: a restart may reuse a port whose old connections linger
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(where)
            except OSError:
                return False
    return True


@dataclass
class Coordinator:
    """A running coordinator; ``stop`` shuts everything it started."""

    server: grpc.aio.Server
    join_server: grpc.aio.Server
    port: int
    join_port: int
    store: Store
    leadership: Leadership
    me: CoordinatorInfo
    """How clients and agents reach this coordinator."""
    election: LeaderElection | None = None
    """The election this coordinator takes part in (etcd), or None (always leads)."""
    election_task: asyncio.Task[None] | None = None
    history_task: asyncio.Task[None] | None = None
    """Compacts etcd's history (etcd only)."""
    revocations: RevocationBook | None = None
    """Every revocation, checked on every call, leader or not."""
    authorities: Authorities | None = None
    """The CAs in force: the trust bundle, the issuing CA, the server certificate."""
    revocation_task: asyncio.Task[None] | None = None
    """Keeps ``revocations`` current from the store's watch."""
    authorities_task: asyncio.Task[None] | None = None
    """Keeps ``authorities`` current from the store's watch (a rollover another led)."""
    probe: ProbeServer | None = None
    probe_endpoint: str = ""
    """Where agents measure their link to this coordinator (told in each welcome)."""

    async def stop(self, grace_s: float | None = 1.0) -> None:
        """Step down (giving the lease back at once), stop serving, close the store."""
        tasks = (self.election_task, self.history_task, self.revocation_task, self.authorities_task)
        for task in tasks:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.leadership.stop()
        await asyncio.gather(self.server.stop(grace_s), self.join_server.stop(grace_s))
        if self.probe is not None:
            await self.probe.close()
        await self.store.close()


def advertised(listen: str, port: int, advertise: str = "") -> str:
    """The address others should dial: ``advertise``, else the listen host and bound port."""
    if advertise:
        return advertise
    host = listen.rsplit(":", 1)[0]
    return f"{socket.getfqdn() if host in _WILDCARDS else host}:{port}"


STORE_RETRY_S = (0.5, 10.0)
"""First and longest wait between tries to reach an etcd that does not answer yet."""


async def open_store(config: CoordinatorConfig) -> Store:
    """The store the config names: SQLite in ``data_dir``, or etcd.

    An etcd that no endpoint of answers is waited for, as long as it takes (a coordinator that
    boots before etcd comes up once etcd does, whatever started it); any other refusal ends
    the coordinator at once.
    """
    if config.store == "etcd":
        tls = None
        if config.etcd_ca and config.etcd_cert and config.etcd_key:
            tls = TlsFiles(ca=config.etcd_ca, cert=config.etcd_cert, key=config.etcd_key)
        wait_s, longest_s = STORE_RETRY_S
        while True:
            try:
                return await EtcdStore.open(
                    config.etcd_endpoints, prefix=config.etcd_prefix, tls=tls
                )
            except StoreUnreachableError as err:
                log.warning("store_unreachable", error=str(err), retry_in_s=round(wait_s, 1))
                await asyncio.sleep(wait_s * random.uniform(0.8, 1.2))
                wait_s = min(wait_s * 2, longest_s)
    config.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    config.data_dir.chmod(0o700)  # a folder that already existed keeps its mode otherwise
    return await SqliteStore.open(config.data_dir / STORE_FILE)


def _servers(
    config: CoordinatorConfig,
    leadership: Leadership,
    health: tuple[health_aio.HealthServicer, health_aio.HealthServicer],
    authorities: Authorities,
    revocations: RevocationBook,
) -> tuple[grpc.aio.Server, grpc.aio.Server, int, int]:
    """The mTLS server and the join server, bound, not started; and their ports."""
    throttle = Throttle(
        ThrottleLimits(
            requests_per_s=config.client_requests_per_s,
            request_burst=config.client_request_burst,
            jobs_per_s=config.client_jobs_per_s,
            job_burst=config.client_job_burst,
            streams=config.client_streams,
            bytes_per_s=config.client_bytes_per_s,
            byte_burst=config.client_byte_burst,
            hold_s=config.client_refusal_hold_s,
            max_held=config.client_held_refusals,
        )
    )
    server = grpc.aio.server(
        interceptors=[
            AuthInterceptor(
                METHOD_ROLES,
                open_methods=OPEN_METHODS,
                throttle=throttle,
                job_counts=JOB_COUNTS,
                max_request_bytes=config.max_request_bytes,
                large_methods={CONNECT_METHOD},
                revocations=revocations,
                renew_methods={RENEW_METHOD},
                issuer_check=authorities.check,
            )
        ],
        options=[
            # Ping idle peers so a connection that vanished without a FIN is noticed.
            ("grpc.keepalive_time_ms", 20_000),
            ("grpc.keepalive_timeout_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ("grpc.max_receive_message_length", MAX_STREAM_MESSAGE_BYTES),
            _NO_PORT_SHARING,
        ],
    )
    current = leadership.current
    job_service_pb2_grpc.add_JobServiceServicer_to_server(JobServicer(current), server)
    serving_service_pb2_grpc.add_ServingServiceServicer_to_server(ServingServicer(current), server)
    admin_service_pb2_grpc.add_AdminServiceServicer_to_server(AdminServicer(current), server)
    audit_service_pb2_grpc.add_AuditServiceServicer_to_server(AuditServicer(current), server)
    certificate_service_pb2_grpc.add_CertificateServiceServicer_to_server(
        CertificateServicer(current), server
    )
    store_service_pb2_grpc.add_StoreServiceServicer_to_server(StoreServicer(current), server)
    data_service_pb2_grpc.add_DataServiceServicer_to_server(DataServicer(current), server)
    site_link_service_pb2_grpc.add_SiteLinkServiceServicer_to_server(
        SiteLinkServicer(current, serves_connect=True), server
    )
    health_pb2_grpc.add_HealthServicer_to_server(health[0], server)
    reflection.enable_server_reflection((*SERVICE_NAMES, reflection.SERVICE_NAME), server)
    port = _bind(server, config.listen, authorities.server_credentials())
    join_server = grpc.aio.server(
        interceptors=[AuthInterceptor(None, open_methods={JOIN_METHOD, *OPEN_METHODS})],
        options=[_NO_PORT_SHARING],
    )
    site_link_service_pb2_grpc.add_SiteLinkServiceServicer_to_server(
        SiteLinkServicer(current, serves_connect=False), join_server
    )
    health_pb2_grpc.add_HealthServicer_to_server(health[1], join_server)
    join_port = _bind(
        join_server, config.join_listen, authorities.server_credentials(require_client_auth=False)
    )
    return server, join_server, port, join_port


async def start_coordinator(config: CoordinatorConfig) -> Coordinator:
    """Open the store, serve on both ports (port 0 picks a free one), and lead or campaign."""
    store = await open_store(config)
    try:
        return await _start(config, store)
    except BaseException:
        await store.close()
        raise


async def _start(config: CoordinatorConfig, store: Store) -> Coordinator:
    """Build the servers on ``store``, then lead at once (SQLite) or set up the election."""
    await check_layout(store)  # a newer release's store is refused before anything is served
    # Read before serving, and followed from then on like the revocations: a server
    # certificate of a retired CA is replaced before the first handshake.
    authorities = await Authorities.load(
        store,
        ca_cert=config.ca_cert,
        ca_key=config.ca_key,
        issuing_cert=config.issuing_cert,
        server_cert=config.cert,
        server_key=config.key,
    )
    health = (health_aio.HealthServicer(), health_aio.HealthServicer())
    leadership = Leadership(health, SERVICE_NAMES)
    revocations = RevocationBook()
    # Read before serving, so no revoked peer is let in while the watch starts.
    read_at = await load(store, revocations)
    server, join_server, port, join_port = _servers(
        config, leadership, health, authorities, revocations
    )
    address = advertised(config.listen, port, config.advertise)
    host = address.rsplit(":", 1)[0]
    me = CoordinatorInfo(address, config.join_advertise or f"{host}:{join_port}")
    coordinator = Coordinator(server, join_server, port, join_port, store, leadership, me)
    coordinator.revocations = revocations
    coordinator.authorities = authorities
    coordinator.probe, coordinator.probe_endpoint = await _start_probe(config, host)
    if config.store == "sqlite":
        leadership.leader = lambda: me
        services = await start_services(
            store,
            config,
            authorities,
            _only(me),
            coordinator.probe_endpoint,
            revocations=revocations,
        )
        await leadership.lead(services)
    else:
        election = LeaderElection(
            store,
            me,
            lease_s=config.leader_lease_s,
            on_elected=lambda revision: _elected(coordinator, config, authorities, revision),
            on_deposed=leadership.follow,
        )
        leadership.leader = election.leader
        coordinator.election = election
    coordinator.revocation_task = asyncio.create_task(follow(store, revocations, read_at))
    coordinator.authorities_task = asyncio.create_task(authorities.follow(store))
    await server.start()
    await join_server.start()
    await leadership.serve_health()
    if coordinator.election is not None:
        coordinator.election_task = asyncio.create_task(coordinator.election.run())
    if isinstance(store, EtcdStore) and config.etcd_history_s > 0:
        # Every coordinator may: compacting to a revision already compacted does nothing.
        coordinator.history_task = asyncio.create_task(store.compact_history(config.etcd_history_s))
    log.info(
        "coordinator_started",
        version=__version__,
        port=port,
        join_port=join_port,
        store=config.store,
        advertise=me.address,
    )
    return coordinator


async def _start_probe(config: CoordinatorConfig, host: str) -> tuple[ProbeServer, str]:
    """The link probe agents measure this coordinator's link with, and its address."""
    listen = config.probe_listen or f"{config.listen.rsplit(':', 1)[0]}:0"
    probe = ProbeServer(listen)
    try:
        bound = await probe.start()
    except OSError as exc:
        raise ListenError(f"probe_listen {listen}: {exc.strerror or exc}") from None
    return probe, config.probe_advertise or f"{host}:{bound.rsplit(':', 1)[1]}"


async def _elected(
    coordinator: Coordinator, config: CoordinatorConfig, authorities: Authorities, revision: int
) -> None:
    """Won the election: load the state from the store, recover, start scheduling, serve."""
    election = coordinator.election
    assert election is not None
    fenced = FencedStore(coordinator.store, revision, election.leader)
    assert coordinator.revocations is not None
    services = await start_services(
        fenced,
        config,
        authorities,
        _members(election),
        coordinator.probe_endpoint,
        revocations=coordinator.revocations,
    )
    await coordinator.leadership.lead(services, fence=fenced)


def _only(me: CoordinatorInfo) -> ListCoordinators:
    """The list of coordinators when this one is the only one."""

    async def coordinators() -> list[admin_service_pb2.Coordinator]:
        return [
            admin_service_pb2.Coordinator(
                address=me.address, join_address=me.join_address, leader=True
            )
        ]

    return coordinators


def _members(election: LeaderElection) -> ListCoordinators:
    """The coordinators registered in the store, the leader marked."""

    async def coordinators() -> list[admin_service_pb2.Coordinator]:
        leader = election.leader()
        return [
            admin_service_pb2.Coordinator(
                address=member.address,
                join_address=member.join_address,
                leader=leader is not None and member.address == leader.address,
            )
            for member in await election.members()
        ]

    return coordinators
