"""A tenant sees its own world: the federation's capacity per domain and model, with what its
own jobs hold, and no site's name or other tenant's job; ``fedctl top`` shows it that."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.local import LocalFederation
from federation.security.tls import TlsFiles
from federation.testing.cluster import cpu_site

from .conftest import channel_as, gpu_site, jobs, running, spec, tenant_tls, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-capacity")

HOLD = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.05)\n"


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    sites = [gpu_site("gpu-cap", 2, model="H100-80GB"), cpu_site("cpu-cap")]
    with running(tmp_path_factory.mktemp("capacity"), sites) as fed:
        yield fed


def fedctl_as(fed: LocalFederation, tls: TlsFiles, *args: str) -> subprocess.CompletedProcess[str]:
    tenant = ["--ca", str(tls.ca), "--cert", str(tls.cert), "--key", str(tls.key)]
    argv = [sys.executable, "-m", "federation.cli", *args, "--coordinator", fed.address, *tenant]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


async def capacity(
    fed: LocalFederation, tls: TlsFiles
) -> dict[tuple[str, str, str], tuple[int, float, float, float]]:
    """(domain, kind, model) -> (sites, total, free, yours), as the tenant sees it."""
    async with channel_as(fed, tls) as channel:
        reply = await jobs(channel).GetCapacity(job_service_pb2.GetCapacityRequest())
    for site in ("gpu-cap", "cpu-cap"):
        assert site not in str(reply)  # no site's name
    return {(r.domain, r.kind, r.model): (r.sites, r.total, r.free, r.yours) for r in reply.rows}


async def test_a_tenant_sees_capacity_and_what_its_own_jobs_hold(
    federation: LocalFederation, tmp_path: Path
) -> None:
    go = tmp_path / "go"
    mine, other = tenant_tls(federation, "team-cap"), tenant_tls(federation, "team-else")
    task = {
        "name": "t",
        "command": [sys.executable, "-c", HOLD, str(go)],
        "resources": {"cpu": 1, "memory_mib": 64, "accelerator": {"kind": "GPU", "count": 1}},
    }
    async with channel_as(federation, mine) as channel:
        job = (
            await jobs(channel).SubmitJob(
                job_service_pb2.SubmitJobRequest(spec=spec("holds-one", [task]))
            )
        ).job
        await wait_for_job(channel, job.id, frozenset({jobs_pb2.JOB_STATE_RUNNING}))
        try:
            # Free counts come from the site's view, whose change may trail the task's report
            # by its 20 ms coalescing: what the job holds shows within moments.
            for _ in range(50):
                seen = await capacity(federation, mine)
                if seen[("datacenter", "GPU", "H100-80GB")][2] == 1.0:
                    break
                await asyncio.sleep(0.1)
            assert seen[("datacenter", "GPU", "H100-80GB")] == (1, 2.0, 1.0, 1.0)
            assert seen[("datacenter", "CPU", "")][3] == 1.0  # its one core
            assert seen[("edge", "CPU", "")][3] == 0.0
            theirs = await capacity(federation, other)
            assert theirs[("datacenter", "GPU", "H100-80GB")] == (1, 2.0, 1.0, 0.0)
            assert theirs[("datacenter", "CPU", "")][3] == 0.0
            # fedctl top, as each tenant: the summary and only its own running jobs.
            top = json.loads(fedctl_as(federation, mine, "top", "--once", "-o", "json").stdout)
            assert not top["sites"]
            assert [j["job"] for j in top["jobs"]] == [job.id]
            gpu = next(r for r in top["capacity"] if r["kind"] == "GPU")
            assert (gpu["free"], gpu["yours"]) == (1.0, 1.0)
            other_top = fedctl_as(federation, other, "top", "--once", "-o", "json")
            assert json.loads(other_top.stdout)["jobs"] == []
            table = fedctl_as(federation, mine, "capacity")
            assert table.returncode == 0, table.stderr
            assert "H100-80GB" in table.stdout
        finally:
            go.touch()
        done = await wait_for_job(channel, job.id)
        assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED, done.reason
