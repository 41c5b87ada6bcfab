"""Full logs over real agents: a replica's lines read through the coordinator from the site
that ran it, followed as they come until the run ends, after the job ended, the last N, and
never another tenant's."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.client import Client, NotFound
from federation.local import LocalFederation
from federation.security.tls import TlsFiles

from .conftest import channel_as, jobs, running, spec, tenant_tls, until, wait_for_job
from .test_cli import fedctl

pytestmark = pytest.mark.xdist_group("e2e-logs")

# Prints 1000 numbered lines (stderr too), then waits for the file "go", then prints a last one.
TASK = """
import os, sys, time
markers = sys.argv[1]
for i in range(1000):
    print("line %04d" % i, flush=True)
print("to stderr \\x1b[2J with a tab:\\there", file=sys.stderr, flush=True)
while not os.path.exists(os.path.join(markers, "go")):
    time.sleep(0.05)
print("the end", flush=True)
"""


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    from federation.testing.cluster import cpu_site

    with running(tmp_path_factory.mktemp("logs"), [cpu_site("logs-a")]) as fed:
        yield fed


def client_for(fed: LocalFederation, tls: TlsFiles) -> Client:
    return Client(fed.address, tls)


async def test_logs_follow_a_running_task_to_its_end_and_stay_readable_after(
    federation: LocalFederation, tmp_path: Path
) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    tls = tenant_tls(federation, "team-logs")
    task = {
        "name": "t",
        "command": [sys.executable, "-c", TASK, str(markers)],
        "resources": {"cpu": 1, "memory_mib": 64},
    }
    async with channel_as(federation, tls) as channel:
        reply = await jobs(channel).SubmitJob(
            job_service_pb2.SubmitJobRequest(spec=spec("logged", [task]))
        )
    job_id = reply.job.id
    async with client_for(federation, tls) as client:

        async def printed_all() -> bool:
            try:
                lines = [line.text async for line in client.logs(job_id, tail=1)]
            except Exception:  # not placed, or not started yet
                return False
            return lines == ["to stderr \x1b[2J with a tab:\there"]

        await until(printed_all, "the task's first 1001 lines")

        # Followed by fedctl in another process, as a person would: every line in order,
        # the first ones read while the task still runs.
        follower = await asyncio.create_subprocess_exec(
            *fedctl_argv(federation, tls, "jobs", "logs", job_id, "-f"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert follower.stdout is not None
        first = await asyncio.wait_for(follower.stdout.readline(), 60)
        assert first == b"line 0000\n"
        assert (await client.get(job_id)).state == jobs_pb2.JOB_STATE_RUNNING
        (markers / "go").touch()
        out, err = await asyncio.wait_for(follower.communicate(), 60)
        assert follower.returncode == 0, err
        printed = ["line 0000", *out.decode().splitlines()]
        assert printed[:1000] == [f"line {i:04d}" for i in range(1000)]
        # A terminal never gets the task's escape sequences; tabs stay.
        assert printed[1000] == "to stderr \\x1b[2J with a tab:\there"
        assert printed[1001:] == ["the end"]

        done = await client.get(job_id)
        assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED
        # After the job ended, while the site keeps them: the last lines, exactly (-o json).
        after = fedctl_as(federation, tls, "jobs", "logs", job_id, "--tail", "2", "-o", "json")
        assert after.returncode == 0, after.stderr
        records = [json.loads(line) for line in after.stdout.splitlines()]
        assert [r["text"] for r in records] == ["to stderr \x1b[2J with a tab:\there", "the end"]
        assert records[0]["stamp_ns"] < records[1]["stamp_ns"]

    # Another tenant cannot tell the job exists.
    async with client_for(federation, tenant_tls(federation, "team-other")) as other:
        with pytest.raises(NotFound):
            async for _ in other.logs(job_id):
                pass


def fedctl_argv(fed: LocalFederation, tls: TlsFiles, *args: str) -> list[str]:
    """fedctl as a tenant: its own certificate."""
    tenant = ["--ca", str(tls.ca), "--cert", str(tls.cert), "--key", str(tls.key)]
    return [sys.executable, "-m", "federation.cli", *args, "--coordinator", fed.address, *tenant]


def fedctl_as(fed: LocalFederation, tls: TlsFiles, *args: str) -> subprocess.CompletedProcess[str]:
    argv = fedctl_argv(fed, tls, *args)
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


async def test_a_task_not_placed_yet_and_a_bad_replica_are_refused_clearly(
    federation: LocalFederation, operator: grpc.aio.Channel
) -> None:
    task = {"name": "t", "command": ["true"], "resources": {"cpu": 64}}  # fits nowhere
    await jobs(operator).SubmitJob(
        job_service_pb2.SubmitJobRequest(spec=spec("nowhere", [task], id="nowhere"))
    )
    await wait_for_job(operator, "nowhere", frozenset({jobs_pb2.JOB_STATE_PENDING}))
    refused = fedctl(federation, "jobs", "logs", "nowhere")
    assert refused.returncode == 1
    assert "has not run anywhere yet" in refused.stderr
    bad = fedctl(federation, "jobs", "logs", "nowhere", "t", "--replica", "3")
    assert bad.returncode == 1
    assert "replica" in bad.stderr
