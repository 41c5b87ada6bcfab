"""Probes of a local federation with several coordinators: who leads, when a follower serves.

The HA, chaos and partition tests and ``bench/failover.py`` share them, and the small sites
and proxied start-up they use.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from federation.api.v1 import (
    admin_service_pb2,
    admin_service_pb2_grpc,
    job_service_pb2,
    job_service_pb2_grpc,
    jobs_pb2,
)
from federation.connection import Connection, on_leader
from federation.coordinator.server import SERVICE_NAMES
from federation.listing import list_sites
from federation.local import LocalFederation, SiteSpec
from federation.testing.proxy import PausableProxy

JOB_SERVICE = SERVICE_NAMES[0]
POLL_S = 0.05

HealthStreams = dict[str, AsyncIterator[health_pb2.HealthCheckResponse]]


def cpu_site(name: str, **settings: object) -> SiteSpec:
    """A small edge site with one 4-CPU node and no accelerators; ``settings`` go to its agent."""
    return SiteSpec(
        name,
        "edge",
        nodes=[{"name": f"{name}-box", "cpu_cores": 4, "memory_mib": 4096}],
        settings=dict(settings),
    )


async def start_with_proxied_site(
    fed: LocalFederation,
    proxy: PausableProxy,
    coordinators: Sequence[str],
    proxied: str,
    start_coordinator: Callable[[str], Awaitable[None]] | None = None,
) -> str:
    """Start ``coordinators``, point ``proxy`` at the one that leads, then start the
    federation's sites and ``proxied``, a ``cpu_site`` that reaches the leader only through
    ``proxy``; returns the leader's name once every site is connected."""
    for name in coordinators:
        if start_coordinator is None:
            await fed.start_coordinator(name=name)
        else:
            await start_coordinator(name)
    leader = await leader_name(fed)
    proxy.target_port = fed.coordinators[leader][0]
    for site in fed.sites:
        await fed.start_site(site)
    site = cpu_site(proxied, coordinator=f"127.0.0.1:{proxy.port}")
    fed.sites.append(site)
    await fed.start_site(site)
    await fed.wait_connected()
    return leader


def etcd_coordinator_args(endpoint: str, prefix: str, lease_s: float) -> list[str]:
    """Coordinator arguments that keep state in the etcd at ``endpoint`` and elect a leader."""
    return [
        "--store",
        "etcd",
        "--etcd-endpoints",
        endpoint,
        "--etcd-prefix",
        prefix,
        "--leader-lease-s",
        str(lease_s),
    ]


async def federation_status(fed: LocalFederation) -> admin_service_pb2.GetFederationStatusResponse:
    """The status as the leader reports it, found among all coordinators."""

    async def status(conn: Connection) -> admin_service_pb2.GetFederationStatusResponse:
        async with conn.channel() as channel:
            admin = admin_service_pb2_grpc.AdminServiceStub(channel)
            return await admin.GetFederationStatus(admin_service_pb2.GetFederationStatusRequest())

    return await on_leader(fed.operator(), status)


def name_of(fed: LocalFederation, address: str) -> str:
    """The coordinator started under ``address``."""
    return next(name for name in fed.coordinators if fed.address_of(name) == address)


async def leader_name(fed: LocalFederation) -> str:
    """The name of the coordinator that leads now."""
    return name_of(fed, (await federation_status(fed)).leader)


async def submit(fed: LocalFederation, job: jobs_pb2.JobSpec, timeout_s: float = 60.0) -> str:
    """Submit until the federation has the job; a retry of an accepted one reports it exists."""
    deadline = time.monotonic() + timeout_s

    async def once(conn: Connection) -> str:
        async with conn.channel() as channel:
            stub = job_service_pb2_grpc.JobServiceStub(channel)
            reply = await stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))
        return reply.job.id

    while True:
        try:
            return await on_leader(fed.operator(), once)
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise


@asynccontextmanager
async def health_watches(fed: LocalFederation, names: list[str]) -> AsyncIterator[HealthStreams]:
    """The JobService health stream of each named coordinator, each past its first answer."""
    conn = fed.operator()
    channels = [conn.at(fed.address_of(name)).channel() for name in names]
    try:
        streams: HealthStreams = {}
        for name, channel in zip(names, channels, strict=True):
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service=JOB_SERVICE)
            stream = stub.Watch(request)  # type: ignore[attr-defined]  # untyped generated stub
            first = await anext(aiter(stream))
            if first.status != health_pb2.HealthCheckResponse.NOT_SERVING:
                raise AssertionError(f"{name} serves already")
            streams[name] = stream
        yield streams
    finally:
        for channel in channels:
            await channel.close()


async def first_serving(streams: HealthStreams) -> str:
    """The first coordinator whose JobService turns SERVING."""

    async def serving(name: str) -> str:
        async for reply in streams[name]:
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return name
        raise AssertionError(f"{name}'s health stream ended")

    waits = [asyncio.create_task(serving(name)) for name in streams]
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        return next(iter(done)).result()
    finally:
        for task in waits:
            task.cancel()


async def until(condition: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> float:
    """Poll an async condition every 50 ms; returns when it first held (monotonic)."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(POLL_S)
    return time.monotonic()


async def site_state(channel: grpc.aio.Channel, name: str) -> admin_service_pb2.Site:
    """The site ``name`` as the coordinator on ``channel`` lists it."""
    sites = await list_sites(admin_service_pb2_grpc.AdminServiceStub(channel))
    return next(s for s in sites if s.name == name)
