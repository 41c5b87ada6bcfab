"""ExplainJob lists every filter that rejects a site, each with its reason code, through a real
coordinator, real agents and fedctl."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2
from federation.local import LocalFederation

from .conftest import admin, jobs, python_task, spec, wait_for_job
from .test_cli import fedctl

pytestmark = pytest.mark.xdist_group("e2e-explain")

H100 = {"accelerator": {"kind": "GPU", "count": 1, "models": ["H100-80GB"]}}


async def submit(channel: grpc.aio.Channel, job: jobs_pb2.JobSpec) -> jobs_pb2.Job:
    return (await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job))).job


async def written_verdicts(channel: grpc.aio.Channel, job_id: str) -> jobs_pb2.Job:
    """The job once the scheduler has written why its task fits nowhere."""
    for _ in range(200):
        job = (await jobs(channel).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))).job
        if job.tasks[0].verdicts:
            return job
        await asyncio.sleep(0.05)
    raise AssertionError(f"no verdicts written for {job_id}")


def codes(task: jobs_pb2.TaskExplanation) -> dict[str, list[tuple[str, str]]]:
    """Rejected site -> (stage, code) of every rejection, in order."""
    return {s.site: [(r.stage, r.code) for r in s.rejections] for s in task.sites if not s.feasible}


async def test_explain_lists_every_rejection_with_its_code(
    operator: grpc.aio.Channel, federation: LocalFederation
) -> None:
    """A cordoned edge site outside the job's domain, with no H100, is rejected three times;
    the cloud site twice (domain, budget); the stored verdicts keep the first of each."""
    ops = admin(operator)
    await ops.CordonSite(admin_service_pb2.CordonSiteRequest(site="edge-a"))
    try:
        job = await submit(
            operator,
            spec(
                "rejected-twice",
                [python_task("t", "print()", resources=H100, estimated_duration_s=3600)],
                constraints={"domains": ["datacenter"]},
                objective={"max_cost_usd": 1.0},
            ),
        )
        pending = await written_verdicts(operator, job.id)
        reply = await jobs(operator).ExplainJob(job_service_pb2.ExplainJobRequest(job_id=job.id))
        # fedctl, piped: every rejection is one whole row, even with a narrow COLUMNS.
        table = fedctl(federation, "jobs", "explain", job.id, env={"COLUMNS": "40"})
        as_json = fedctl(federation, "jobs", "explain", job.id, "-o", "json")
    finally:
        await ops.UncordonSite(admin_service_pb2.UncordonSiteRequest(site="edge-a"))
    (task,) = reply.tasks
    assert codes(task) == {
        "edge-a": [
            ("SiteState", "SITE_CORDONED"),
            ("Constraints", "DOMAIN_NOT_ALLOWED"),
            ("CapacityFit", "NO_DEVICE_OF_MODEL"),
        ],
        "dc-a": [("CapacityFit", "NO_DEVICE_OF_MODEL")],
        "cloud-a": [("Constraints", "DOMAIN_NOT_ALLOWED"), ("CostCap", "OVER_BUDGET")],
    }
    cloud = next(s for s in task.sites if s.site == "cloud-a")
    assert (cloud.plugin, cloud.code) == ("Constraints", "DOMAIN_NOT_ALLOWED")
    assert "exceeds the job's $1.00" in cloud.rejections[1].reason
    # The job record keeps one verdict per site: the first filter's, with its code.
    stored = {v.site: (v.stage, v.code) for v in pending.tasks[0].verdicts}
    assert stored == {
        "edge-a": ("SiteState", "SITE_CORDONED"),
        "dc-a": ("CapacityFit", "NO_DEVICE_OF_MODEL"),
        "cloud-a": ("Constraints", "DOMAIN_NOT_ALLOWED"),
    }

    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    expected = ["SITE_CORDONED", "DOMAIN_NOT_ALLOWED", "NO_DEVICE_OF_MODEL"]
    rows = [line.split() for line in lines if "edge-a" in line]
    assert [[c for c in expected if c in row] for row in rows] == [[c] for c in expected]
    assert any("job wants domain datacenter, site is edge" in line for line in lines)
    assert as_json.returncode == 0, as_json.stderr
    (doc_task,) = json.loads(as_json.stdout)["tasks"]
    by_site = {s["site"]: [r["code"] for r in s.get("rejections", [])] for s in doc_task["sites"]}
    assert by_site["cloud-a"] == ["DOMAIN_NOT_ALLOWED", "OVER_BUDGET"]

    await jobs(operator).CancelJob(job_service_pb2.CancelJobRequest(job_id=job.id))
    assert (await wait_for_job(operator, job.id)).state == jobs_pb2.JOB_STATE_CANCELLED


async def test_explain_puts_the_ranked_estimate_beside_the_committed_one(
    operator: grpc.aio.Channel,
) -> None:
    """A task placed on the cloud H100s: the other sites are rejected for domain and model,
    and the explanation carries placement's estimate there and the one the site committed to."""
    job = await submit(
        operator,
        spec(
            "ranked-committed",
            [python_task("t", "print()", resources=H100, estimated_duration_s=600)],
            constraints={"domains": ["cloud"]},
        ),
    )
    done = await wait_for_job(operator, job.id)
    assert done.state == jobs_pb2.JOB_STATE_SUCCEEDED
    reply = await jobs(operator).ExplainJob(job_service_pb2.ExplainJobRequest(job_id=job.id))
    (task,) = reply.tasks
    both = [("Constraints", "DOMAIN_NOT_ALLOWED"), ("CapacityFit", "NO_DEVICE_OF_MODEL")]
    assert codes(task) == {"edge-a": both, "dc-a": both}
    assert task.ranked_site == "cloud-a"
    assert task.ranked_estimate.run_s > 0
    assert task.committed_estimate == done.tasks[0].estimate
    assert task.committed_estimate.device_model == "H100-80GB"
