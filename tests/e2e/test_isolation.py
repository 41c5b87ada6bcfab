"""Two tenants' jobs at a real agent that allocates each tenant a uid of its own."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Iterator

import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.local import LocalFederation, SiteSpec

from .conftest import channel_as, jobs, spec, tenant_tls, wait_for_job

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the agent switches to task uids"),
    pytest.mark.xdist_group("e2e-isolation"),
]

UIDS = (200_000, 200_099)


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    root = tmp_path_factory.mktemp("isolation")
    root.chmod(0o755)  # the work folder below must be reachable by the task uids
    work = root / "tasks"
    site = SiteSpec(
        "shared",
        "datacenter",
        nodes=[{"name": "n", "cpu_cores": 4}],
        settings={
            "task_uid_range": f"{UIDS[0]}-{UIDS[1]}",
            "work_dir": str(work),
            "run_tasks_as_agent": False,
        },
    )
    fed = LocalFederation(root, [site])
    try:
        asyncio.run(fed.start())
        yield fed
    finally:
        fed.stop()


async def run_as(federation: LocalFederation, tenant: str, script: str) -> jobs_pb2.Job:
    async with channel_as(federation, tenant_tls(federation, tenant)) as channel:
        task = {"name": "t", "command": ["/bin/sh", "-c", script]}
        reply = await jobs(channel).SubmitJob(
            job_service_pb2.SubmitJobRequest(spec=spec("who", [task]))
        )
        return await wait_for_job(channel, reply.job.id)


async def test_each_tenant_runs_as_its_own_uid(federation: LocalFederation) -> None:
    """Tenants get distinct uids from the range, the same one for each of their jobs, and
    their work folders are private to that uid."""
    who = 'echo "uid=$(id -u) home=$HOME"; pwd'
    first_a = await run_as(federation, "tenant-a", who)
    b = await run_as(federation, "tenant-b", who)
    second_a = await run_as(federation, "tenant-a", who)
    uids = []
    for job in (first_a, b, second_a):
        assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, job.tasks[0].reason
        said, home, folder = job.tasks[0].output_tail.split()
        uid = int(said.removeprefix("uid="))
        assert home == f"home={folder}"  # an allocated uid has no home but its folder
        assert UIDS[0] <= uid <= UIDS[1]
        info = os.stat(folder)
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (uid, 0o700)
        uids.append(uid)
    assert uids[0] == uids[2] != uids[1]
