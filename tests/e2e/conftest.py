"""A real federation for end-to-end tests: coordinator and agents as processes, real mTLS."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from federation.api.v1 import (
    admin_service_pb2_grpc,
    job_service_pb2,
    job_service_pb2_grpc,
    jobs_pb2,
)
from federation.common.job_state import is_terminal
from federation.jobspec import job_spec_from_dict
from federation.local import LocalFederation, SiteSpec
from federation.security.identity import Identity, Role
from federation.security.pki import issue_client_files
from federation.security.tls import TlsFiles, channel_credentials
from federation.testing.etcd import LocalEtcd, etcd_binary
from federation.watch import events_of

SITES = [
    SiteSpec(
        "edge-a",
        "edge",
        nodes=[
            {
                "name": "edge-box",
                "cpu_cores": 8,
                "memory_mib": 16384,
                "devices": [
                    {
                        "kind": "NPU",
                        "vendor": "huawei",
                        "model": "Ascend-910B",
                        "memory_mib": 65536,
                        "count": 2,
                    }
                ],
            }
        ],
    ),
    SiteSpec(
        "dc-a",
        "datacenter",
        nodes=[
            {
                "name": "dgx",
                "cpu_cores": 64,
                "memory_mib": 524288,
                "devices": [
                    {
                        "kind": "GPU",
                        "vendor": "nvidia",
                        "model": "A100-80GB",
                        "memory_mib": 81920,
                        "count": 4,
                    }
                ],
            }
        ],
    ),
    SiteSpec(
        "cloud-a",
        "cloud",
        price_per_device_hour=3.0,
        nodes=[
            {
                "name": "p5",
                "cpu_cores": 96,
                "memory_mib": 1048576,
                "devices": [
                    {
                        "kind": "GPU",
                        "vendor": "nvidia",
                        "model": "H100-80GB",
                        "memory_mib": 81920,
                        "count": 2,
                    }
                ],
            }
        ],
    ),
]


def gpu_site(name: str, count: int, model: str = "A100-80GB", **settings: object) -> SiteSpec:
    """A datacenter site of one node with ``count`` declared NVIDIA GPUs of ``model``."""
    device = {
        "kind": "GPU",
        "vendor": "nvidia",
        "model": model,
        "memory_mib": 81920,
        "count": count,
    }
    node = {"name": "box", "cpu_cores": 64, "memory_mib": 524288, "devices": [device]}
    return SiteSpec(name, "datacenter", nodes=[node], settings=settings)


@contextlib.contextmanager
def running(
    root: Path, sites: Sequence[SiteSpec], coordinator_args: Sequence[str] = ()
) -> Iterator[LocalFederation]:
    """A local federation of ``sites``, started, and stopped afterwards."""
    fed = LocalFederation(root, list(sites), coordinator_args=list(coordinator_args))
    try:
        asyncio.run(fed.start())
        yield fed
    finally:
        fed.stop()


def scheduling_cycles(fed: LocalFederation) -> float:
    """How many scheduling cycles the leader has run (its federation must listen for metrics,
    ``--metrics-listen``): a test that must see nothing happen waits for cycles, not time."""
    url = f"http://127.0.0.1:{fed.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "federation_scheduling_walk_seconds_count":
                return sample.value
    raise AssertionError("the leader exports no federation_scheduling_walk_seconds")


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 45) -> None:
    """Await ``check`` every 0.1 s until it holds; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    """One federation shared by a test module (tests use unique jobs and small demands)."""
    args = ["--metrics-listen", "127.0.0.1:0"]
    with running(tmp_path_factory.mktemp("fed"), SITES, args) as fed:
        yield fed


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[LocalEtcd]:
    """A real etcd member on free loopback ports, for one test."""
    directory = tmp_path / "etcd"
    directory.mkdir()
    server = LocalEtcd.start(directory)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def shared_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    """One real etcd member for the whole run (per xdist worker): each federation on it keeps
    its keys under an ``etcd_prefix()`` of its own, so none sees another's."""
    if etcd_binary() is None:
        pytest.skip("etcd is not installed (apt-get install -y etcd-server)")
    server = LocalEtcd.start(tmp_path_factory.mktemp("shared-etcd"))
    try:
        yield server
    finally:
        server.stop()


def etcd_prefix() -> str:
    """A key prefix no other federation uses (all the same length, so none nests in another)."""
    return f"/e2e-{uuid.uuid4().hex}"


def tls_for(fed: LocalFederation, identity: Identity) -> TlsFiles:
    cert, key = issue_client_files(fed.pki, identity)
    return TlsFiles(ca=fed.pki.ca_cert, cert=cert, key=key)


def site_tls(fed: LocalFederation, site: str) -> TlsFiles:
    """The certificate the site's agent got at Join."""
    state = fed.root / "sites" / site / "state"
    return TlsFiles(ca=state / "ca.pem", cert=state / "site.pem", key=state / "site-key.pem")


@pytest_asyncio.fixture
async def operator(federation: LocalFederation) -> AsyncIterator[grpc.aio.Channel]:
    async with federation.operator().channel() as channel:
        yield channel


def channel_as(fed: LocalFederation, tls: TlsFiles) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(fed.address, channel_credentials(tls))


def jobs(channel: grpc.aio.Channel) -> job_service_pb2_grpc.JobServiceStub:
    return job_service_pb2_grpc.JobServiceStub(channel)


def admin(channel: grpc.aio.Channel) -> admin_service_pb2_grpc.AdminServiceStub:
    return admin_service_pb2_grpc.AdminServiceStub(channel)


def python_task(name: str, code: str, **extra: object) -> dict[str, object]:
    """A task that runs ``python -c code``."""
    return {"name": name, "command": [sys.executable, "-c", code], **extra}


def spec(name: str, tasks: Sequence[dict[str, object]], **extra: object) -> jobs_pb2.JobSpec:
    return job_spec_from_dict({"name": name, "tasks": list(tasks), **extra})


async def wait_for_job(
    channel: grpc.aio.Channel,
    job_id: str,
    until: frozenset[int] | None = None,
    timeout_s: float = 60.0,
) -> jobs_pb2.Job:
    """Follow WatchJobs until the job reaches one of ``until`` (default: any final state)."""
    stub = jobs(channel)

    async def follow() -> jobs_pb2.Job:
        request = job_service_pb2.WatchJobsRequest(job_ids=[job_id], include_current=True)
        async for event in events_of(stub.WatchJobs(request)):
            state = event.job_state
            if (until is None and is_terminal(state)) or (until is not None and state in until):
                break
        return (await stub.GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job

    return await asyncio.wait_for(follow(), timeout_s)


def tenant_tls(fed: LocalFederation, name: str) -> TlsFiles:
    return tls_for(fed, Identity(Role.TENANT, name))


def read_marker(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


async def until_event(
    channel: grpc.aio.Channel,
    job_id: str,
    matches: Callable[[jobs_pb2.JobEvent], bool],
    what: str,
    timeout_s: float = 45,
) -> job_service_pb2.GetJobResponse:
    """Poll GetJob (with its events) until one of the job's recorded events ``matches``; the
    evidence that the coordinator took the decision that event records. Returns that answer,
    its job at least as new as the event (GetJob reads the job, then its events)."""
    request = job_service_pb2.GetJobRequest(job_id=job_id, include_events=True)
    found: list[job_service_pb2.GetJobResponse] = []

    async def recorded() -> bool:
        reply = await jobs(channel).GetJob(request)
        found[:] = [reply]
        newest = reply.job.last_event_sequence
        return any(matches(e) for e in reply.events if e.sequence <= newest)

    await until(recorded, what, timeout_s)
    return found[0]


async def until_past(unix_s: float, what: str) -> None:
    """Poll the wall clock until it is past ``unix_s`` (a moment the coordinator named, such as
    an expiry it keeps in whole seconds)."""

    async def past() -> bool:
        return time.time() > unix_s

    await until(past, what, timeout_s=max(0.0, unix_s - time.time()) + 10)


def fedctl_env(fed: LocalFederation) -> dict[str, str]:
    """fedctl's environment for ``fed``: its operator's certificate, a wide table."""
    return {
        **os.environ,
        "FEDCTL_PKI_DIR": str(fed.pki.dir),
        "FEDCTL_COORDINATOR": fed.address,
        "COLUMNS": "200",
    }


def fedctl(
    fed: LocalFederation, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``fedctl ARGS`` as a process of its own against ``fed``, as its operator."""
    return subprocess.run(
        [sys.executable, "-m", "federation.cli", *args],
        env={**fedctl_env(fed), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
