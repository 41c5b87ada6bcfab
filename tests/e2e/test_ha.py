"""Three coordinators on one etcd: the leader is SIGKILLed mid-stream and a follower takes over.

Real processes on loopback: an etcd, three coordinators (one leads, two stand by) and two
agents given all three addresses. Jobs keep arriving while the leader dies; every job the
federation accepted must finish, each run exactly once.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from federation.api.v1 import (
    job_service_pb2,
    jobs_pb2,
)
from federation.local import LocalFederation
from federation.testing.cluster import (
    etcd_coordinator_args,
    federation_status,
    first_serving,
    health_watches,
    name_of,
    submit,
)
from federation.testing.etcd import LocalEtcd, etcd_binary

from .conftest import SITES, jobs, python_task, read_marker, spec, wait_for_job

pytestmark = [
    pytest.mark.xdist_group("ha"),
    pytest.mark.skipif(
        etcd_binary() is None, reason="etcd is not installed (apt-get install -y etcd-server)"
    ),
]

LEASE_S = 3.0
COORDINATORS = ("coord-a", "coord-b", "coord-c")
JOBS = 24
KILL_AFTER = 8  # jobs accepted before the leader is killed
SUBMIT_TIMEOUT_S = 60.0


@pytest.fixture
def fed(tmp_path: Path, etcd: LocalEtcd) -> Iterator[LocalFederation]:
    """A federation whose coordinators keep their state in ``etcd`` (not yet started)."""
    federation = LocalFederation(
        tmp_path / "fed",
        SITES[:2],
        coordinator_args=etcd_coordinator_args(etcd.endpoint, "/ha", LEASE_S),
    )
    try:
        yield federation
    finally:
        federation.stop()


def fedctl(fed: LocalFederation, *args: str) -> subprocess.CompletedProcess[str]:
    """Run fedctl given every coordinator's address, as an operator would."""
    env = {**os.environ, "FEDCTL_PKI_DIR": str(fed.pki.dir), "COLUMNS": "200"}
    result = subprocess.run(
        [sys.executable, "-m", "federation.cli", "--coordinator", fed.address, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result


async def test_leader_sigkill_mid_stream_fails_over(fed: LocalFederation, tmp_path: Path) -> None:
    """A follower leads within the lease plus 3 s of a SIGKILL; every accepted job runs once."""
    for name in COORDINATORS:
        await fed.start_coordinator(name=name)
    for site in fed.sites:
        await fed.start_site(site)
    await fed.wait_connected()
    status = await federation_status(fed)
    leader = name_of(fed, status.leader)
    assert sorted((c.address, c.leader) for c in status.coordinators) == sorted(
        (fed.address_of(name), name == leader) for name in COORDINATORS
    )

    markers = tmp_path / "markers"
    markers.mkdir()
    # Each run appends to its own marker file at its start: two lines would mean two runs.
    code = (
        "import os, sys, time; "
        f"open(os.path.join({str(markers)!r}, sys.argv[1]), 'a').write(sys.argv[1] + '\\n'); "
        "time.sleep(1.0)"
    )
    specs = []
    for i in range(JOBS):
        task = python_task("t", code, resources={"cpu": 1, "memory_mib": 64})
        task["command"] = [*task["command"], f"ha-{i}"]  # type: ignore[misc]
        specs.append(spec(f"ha-{i}", [task], id=f"ha-{i}"))

    accepted: list[str] = []
    enough = asyncio.Event()

    async def stream() -> None:
        for job in specs:
            accepted.append(await submit(fed, job, SUBMIT_TIMEOUT_S))
            if len(accepted) == KILL_AFTER:
                enough.set()
            await asyncio.sleep(0.15)  # a steady stream of jobs, spread over the failover

    followers = [name for name in COORDINATORS if name != leader]
    async with health_watches(fed, followers) as streams:
        submitter = asyncio.create_task(stream())
        await asyncio.wait_for(enough.wait(), SUBMIT_TIMEOUT_S)
        killed_at = time.monotonic()
        fed.kill(leader)
        successor = await asyncio.wait_for(first_serving(streams), LEASE_S + 10)
        failover_s = time.monotonic() - killed_at
    print(f"failover: {leader} SIGKILLed, {successor} led {failover_s:.2f} s later")
    assert failover_s <= LEASE_S + 3.0, f"failover took {failover_s:.2f} s"
    await asyncio.wait_for(submitter, SUBMIT_TIMEOUT_S)
    assert accepted == [job.id for job in specs]

    async with fed.operator().at(fed.address_of(successor)).channel() as channel:
        for job_id in accepted:
            done = await wait_for_job(channel, job_id)
            assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, (job_id, done.reason)
        listed = await jobs(channel).ListJobs(job_service_pb2.ListJobsRequest(page_size=100))
    assert sorted(j.id for j in listed.jobs) == sorted(accepted)
    for job_id in accepted:
        assert read_marker(markers / job_id) == [job_id], f"{job_id} ran a wrong number of times"

    status = await federation_status(fed)
    assert status.leader == fed.address_of(successor)
    assert dict(status.sites_by_state) == {"SITE_STATE_CONNECTED": len(fed.sites)}
    shown = fedctl(fed, "status").stdout
    assert f"leader {fed.address_of(successor)}" in shown
    assert all(fed.address_of(name) in shown for name in followers)
    members = json.loads(fedctl(fed, "--json", "status").stdout)["coordinators"]
    # The killed leader's registration lapsed with its lease; the survivors remain.
    assert {c["address"]: c.get("leader", False) for c in members} == {
        fed.address_of(name): name == successor for name in followers
    }
