"""A site owner's share over real agents: the site publishes the room it keeps for its
owner's tenants, the coordinator offers other tenants only what is left (saying why it will
not send them there), and the owner's tenants still get the room kept for them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2
from federation.local import LocalFederation

from .conftest import (
    admin,
    channel_as,
    gpu_site,
    jobs,
    python_task,
    running,
    spec,
    tenant_tls,
    until,
    wait_for_job,
)

pytestmark = pytest.mark.xdist_group("e2e-owner-share")

OWNED = gpu_site("owned", 3, owner_share={"tenants": ["lab"], "keep": {"gpu": 2}})
RUNNING = jobs_pb2.JOB_STATE_RUNNING


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    with running(tmp_path_factory.mktemp("owner-share"), [OWNED]) as fed:
        yield fed


def gpu_job(name: str, go: Path) -> jobs_pb2.JobSpec:
    wait = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)"
    task = python_task("t", wait, resources={"accelerator": {"kind": "GPU", "count": 1}})
    return spec(name, [task])


async def task_of(channel: grpc.aio.Channel, job_id: str) -> jobs_pb2.TaskStatus:
    reply = await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
    return reply.job.tasks[0]


async def submit(channel: grpc.aio.Channel, name: str, go: Path) -> str:
    reply = await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=gpu_job(name, go)))
    return reply.job.id


async def test_guests_get_what_the_owner_share_leaves_and_the_owner_the_rest(
    federation: LocalFederation, operator: grpc.aio.Channel, tmp_path: Path
) -> None:
    """3 GPUs, 2 kept for "lab": a visitor's first job runs, its second waits with the
    coordinator's reason (not a site's refusal), and lab's two jobs still run beside it."""
    listed = await admin(operator).ListSites(admin_service_pb2.ListSitesRequest())
    (site,) = listed.sites
    assert list(site.view.owner_share.tenants) == ["lab"]
    assert dict(site.view.owner_share.keep) == {"gpu": 2}
    go = tmp_path / "go"
    async with (
        channel_as(federation, tenant_tls(federation, "visitor")) as visitor,
        channel_as(federation, tenant_tls(federation, "lab")) as lab,
    ):
        first = await submit(visitor, "v1", go)

        async def runs(channel: grpc.aio.Channel, job_id: str) -> bool:
            return (await task_of(channel, job_id)).state == RUNNING

        await until(lambda: runs(visitor, first), "the visitor's first job to run")
        second = await submit(visitor, "v2", go)
        words = (
            "the site keeps 2 gpu for its owner's tenants: other tenants hold 1 of the 1 left "
            "to them; this task needs 1"
        )

        async def waits_for_the_share() -> bool:
            verdicts = (await task_of(visitor, second)).verdicts
            return any(v.stage == "OwnerShare" and v.reason == words for v in verdicts)

        await until(waits_for_the_share, "the visitor's second job to wait for the share")
        owned = [await submit(lab, f"l{i}", go) for i in range(2)]
        for job_id in owned:
            await until(lambda j=job_id: runs(lab, j), "lab's jobs to run in the kept room")
        assert (await task_of(visitor, second)).state == jobs_pb2.JOB_STATE_PENDING
        go.touch()
        for channel, job_id in ((visitor, first), (visitor, second), *((lab, j) for j in owned)):
            assert (await wait_for_job(channel, job_id)).state == jobs_pb2.JOB_STATE_SUCCEEDED
