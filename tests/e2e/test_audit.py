"""The audit trail through a real federation: every join, token, cordon and queue change is
recorded with who and when, newest first; refused changes record nothing; operators only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest

from federation.api.v1 import (
    admin_service_pb2,
    audit_service_pb2,
    audit_service_pb2_grpc,
    job_service_pb2,
    queues_pb2,
    resources_pb2,
)
from federation.local import LocalFederation

from .conftest import admin, channel_as, jobs, python_task, spec, tenant_tls

pytestmark = pytest.mark.xdist_group("e2e-audit")


def trail(channel: grpc.aio.Channel) -> audit_service_pb2_grpc.AuditServiceStub:
    return audit_service_pb2_grpc.AuditServiceStub(channel)


async def everything(
    channel: grpc.aio.Channel, **filters: str
) -> list[audit_service_pb2.AuditEvent]:
    """The whole trail, two entries a page."""
    out: list[audit_service_pb2.AuditEvent] = []
    token = ""
    while True:
        request = audit_service_pb2.ListAuditEventsRequest(limit=2, page_token=token, **filters)
        page = await trail(channel).ListAuditEvents(request)
        out.extend(page.events)
        if not page.next_page_token:
            return out
        token = page.next_page_token


async def test_the_sites_joins_are_recorded(operator: grpc.aio.Channel) -> None:
    joins = await everything(operator, action_prefix="certificate.")
    issued = sorted(e.detail.split(",")[0] for e in joins)
    assert issued == ["site:cloud-a", "site:dc-a", "site:edge-a"]
    assert {e.identity for e in joins} == {"join-token"}
    redeemed = await everything(operator, action_prefix="token.redeem")
    assert sorted(e.target for e in redeemed) == ["cloud-a", "dc-a", "edge-a"]


async def test_operator_changes_are_recorded_newest_first(operator: grpc.aio.Channel) -> None:
    stub = admin(operator)
    await stub.CordonSite(admin_service_pb2.CordonSiteRequest(site="edge-a"))
    await stub.UncordonSite(admin_service_pb2.UncordonSiteRequest(site="edge-a"))
    queue = queues_pb2.Queue(name="audited", tenant="team-a", weight=2)
    await stub.CreateQueue(admin_service_pb2.CreateQueueRequest(queue=queue))
    queue.weight = 3
    await stub.UpdateQueue(admin_service_pb2.UpdateQueueRequest(queue=queue))
    await stub.DeleteQueue(admin_service_pb2.DeleteQueueRequest(name="audited"))
    await stub.CreateJoinToken(
        admin_service_pb2.CreateJoinTokenRequest(site="edge-z", domain=resources_pb2.DOMAIN_EDGE)
    )
    recorded = await everything(operator)
    ours = [(e.action, e.target) for e in recorded if e.identity.startswith("operator:")]
    assert ours[:6] == [
        ("token.create", "edge-z"),
        ("queue.delete", "audited"),
        ("queue.update", "audited"),
        ("queue.create", "audited"),
        ("site.uncordon", "edge-a"),
        ("site.cordon", "edge-a"),
    ]
    update = next(e for e in recorded if e.action == "queue.update")
    assert "weight: 3" in update.detail
    times = [e.time.ToNanoseconds() for e in recorded]
    assert times == sorted(times, reverse=True)
    mine = await everything(operator, identity=recorded[0].identity)
    assert [e.action for e in mine][:1] == ["token.create"]
    assert all(e.identity == recorded[0].identity for e in mine)


async def test_a_refused_change_records_nothing(operator: grpc.aio.Channel) -> None:
    before = len(await everything(operator))
    with pytest.raises(grpc.aio.AioRpcError):
        await admin(operator).CordonSite(admin_service_pb2.CordonSiteRequest(site="nowhere"))
    with pytest.raises(grpc.aio.AioRpcError):
        await admin(operator).DeleteQueue(admin_service_pb2.DeleteQueueRequest(name="nothing"))
    bad = queues_pb2.Queue(name="Bad Name", tenant="team-a")
    with pytest.raises(grpc.aio.AioRpcError):
        await admin(operator).CreateQueue(admin_service_pb2.CreateQueueRequest(queue=bad))
    assert len(await everything(operator)) == before


async def test_a_bad_page_token_is_refused_on_its_field(operator: grpc.aio.Channel) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await trail(operator).ListAuditEvents(
            audit_service_pb2.ListAuditEventsRequest(page_token="/jobs/x")
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "page_token" in (caught.value.details() or "")


async def test_tenants_may_not_read_the_trail(federation: LocalFederation) -> None:
    async with channel_as(federation, tenant_tls(federation, "team-a")) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await trail(channel).ListAuditEvents(audit_service_pb2.ListAuditEventsRequest())
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_fedctl_audit_prints_a_table_and_json(federation: LocalFederation) -> None:
    env = {
        **os.environ,
        "FEDCTL_PKI_DIR": str(federation.pki.dir),
        "FEDCTL_COORDINATOR": federation.address,
    }

    def fedctl(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "federation.cli", "audit", *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)

    table = fedctl("--action", "certificate.")
    assert table.returncode == 0, table.stderr
    assert "certificate.issue" in table.stdout
    assert "join-token" in table.stdout
    data = json.loads(fedctl("-o", "json", "--limit", "1").stdout)
    assert len(data["events"]) == 1
    assert data["next_page_token"]


async def test_an_operator_acting_on_a_tenants_job_is_recorded(
    federation: LocalFederation, operator: grpc.aio.Channel
) -> None:
    """A job submitted for a tenant by an operator, and a tenant's job an operator cancels,
    are in the trail; the tenant's own submissions and cancels are not."""
    hold = [python_task("t", "import time; time.sleep(60)")]
    job = (
        await jobs(operator).SubmitJob(
            job_service_pb2.SubmitJobRequest(spec=spec("for-a", hold, tenant="team-a"))
        )
    ).job
    await jobs(operator).CancelJob(
        job_service_pb2.CancelJobRequest(job_id=job.id, reason="maintenance")
    )
    async with channel_as(federation, tenant_tls(federation, "team-b")) as b:
        own = (
            await jobs(b).SubmitJob(job_service_pb2.SubmitJobRequest(spec=spec("mine", hold)))
        ).job
        await jobs(b).CancelJob(job_service_pb2.CancelJobRequest(job_id=own.id))
    recorded = await everything(operator, action_prefix="job.")
    ours = {(e.action, e.target): e for e in recorded}
    assert ours[("job.submit", job.id)].detail == "for tenant team-a"
    assert ours[("job.cancel", job.id)].detail == "of tenant team-a: maintenance"
    assert all(e.identity.startswith("operator:") for e in recorded)
    assert all(e.target != own.id for e in recorded)
