"""The Python client (``federation.client``) against a real federation: what fedctl's job
commands do, as a script would, and each refusal as its own exception."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from federation.api.v1 import jobs_pb2
from federation.client import Client, InvalidArgument, NotFound, PermissionDenied
from federation.local import LocalFederation
from federation.security.identity import Identity, Role
from federation.security.pki import issue_client_files

pytestmark = pytest.mark.xdist_group("e2e-client")

OK = jobs_pb2.JOB_STATE_SUCCEEDED


def as_tenant(fed: LocalFederation, tenant: str) -> Client:
    issue_client_files(fed.pki, Identity(Role.TENANT, tenant))
    return Client.from_pki(fed.pki.dir, fed.address, identity=f"tenant-{tenant}")


def task(code: str, **extra: object) -> dict[str, object]:
    return {"name": "t", "command": [sys.executable, "-c", code], **extra}


async def test_submit_a_dict_and_wait_for_it(federation: LocalFederation) -> None:
    seen: list[jobs_pb2.JobEvent] = []
    async with as_tenant(federation, "py-a") as client:
        job = await client.submit({"name": "from-python", "tasks": [task("print('py ok')")]})
        assert job.spec.tenant == "py-a"
        ended = await client.wait([job.id], seen.append)
        assert ended == {job.id: OK}
        done = await client.get(job.id)
        assert "py ok" in done.tasks[0].output_tail
        assert [e.job_state for e in await client.events(job.id)][-1] == OK
        assert seen
        assert seen[-1].job_state == OK
        assert job.id in [j.id for j in await client.list_jobs()]
        (explained,) = await client.explain(job.id)
        assert explained.task == "t"


async def test_a_yaml_file_with_short_names(federation: LocalFederation, tmp_path: Path) -> None:
    path = tmp_path / "npu.yaml"
    path.write_text(
        f"name: short\ntasks:\n  - name: t\n    command: [{sys.executable}, -c, 'pass']\n"
        "    resources: {accelerator: {kind: NPU, count: 1}}\n"
    )
    async with Client.from_pki(federation.pki.dir, federation.address) as client:
        job, placement = await client.plan(path)
        assert [s.site for s in placement[0].sites if s.feasible] == ["edge-a"]
        with pytest.raises(NotFound):
            await client.get(job.id)  # planned, not stored
        (stored,) = await client.submit_many([path])
        assert (await client.wait([stored.id])) == {stored.id: OK}
        assert (await client.get(stored.id)).tasks[0].site == "edge-a"


async def test_refusals_are_exceptions_with_their_fields(federation: LocalFederation) -> None:
    async with as_tenant(federation, "py-b") as b, as_tenant(federation, "py-c") as c:
        with pytest.raises(InvalidArgument) as caught:
            await b.submit({"name": "bad", "tasks": [{"name": "t", "command": []}]})
        assert "spec.tasks[0].command" in caught.value.violations
        job = await b.submit({"name": "mine", "tasks": [task("import time; time.sleep(30)")]})
        with pytest.raises(NotFound):
            await c.get(job.id)  # another tenant's job does not exist for it
        with pytest.raises(NotFound):
            await c.cancel(job.id)
        with pytest.raises(PermissionDenied):
            await b.submit({"name": "x", "tenant": "py-c", "tasks": [task("pass")]})
        cancelled = await b.cancel(job.id, "done with it")
        assert cancelled.cancel_requested
        assert await b.wait([job.id]) == {job.id: jobs_pb2.JOB_STATE_CANCELLED}
