"""Concurrent SubmitJob calls to a real coordinator over mTLS share store commits (group
commit), and each caller still gets its own job or its own precise refusal."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.local import LocalFederation

from .conftest import jobs, python_task, running, spec
from .test_refusals import violations

pytestmark = pytest.mark.xdist_group("e2e-group-commit")

CALLS = 32
GOOD = {"cpu": 1, "memory_mib": 128}


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    """A coordinator alone: with no site, the jobs stay PENDING and nothing else is written."""
    args = ["--metrics-listen", "127.0.0.1:0"]
    with running(tmp_path_factory.mktemp("group-commit"), [], args) as federation:
        yield federation


@pytest_asyncio.fixture
async def operator(fed: LocalFederation) -> AsyncIterator[grpc.aio.Channel]:
    async with fed.operator().channel() as channel:
        yield channel


def submit_commits(fed: LocalFederation) -> float:
    url = f"http://127.0.0.1:{fed.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "federation_submit_commits_total":
                return sample.value
    raise AssertionError("no federation_submit_commits_total")


async def submit_all(
    channel: grpc.aio.Channel, specs: list[jobs_pb2.JobSpec]
) -> list[job_service_pb2.SubmitJobResponse | BaseException]:
    stub = jobs(channel)
    return await asyncio.gather(
        *(stub.SubmitJob(job_service_pb2.SubmitJobRequest(spec=s)) for s in specs),
        return_exceptions=True,
    )


async def test_concurrent_submits_share_commits_and_each_gets_its_own_job(
    fed: LocalFederation, operator: grpc.aio.Channel
) -> None:
    before = submit_commits(fed)
    names = [f"grouped-{i}" for i in range(CALLS)]
    replies = await submit_all(
        operator, [spec(n, [python_task("t", "", resources=GOOD)]) for n in names]
    )
    commits = submit_commits(fed) - before
    assert 1 <= commits < CALLS, commits
    got = []
    for name, reply in zip(names, replies, strict=True):
        assert isinstance(reply, job_service_pb2.SubmitJobResponse), reply
        assert reply.job.spec.name == name  # the caller's own job, not a neighbour's
        assert reply.job.state == jobs_pb2.JOB_STATE_PENDING
        got.append(reply.job.id)
    assert len(set(got)) == CALLS
    for job_id, name in zip(got, names, strict=True):
        stored = await jobs(operator).GetJob(job_service_pb2.GetJobRequest(job_id=job_id))
        assert stored.job.spec.name == name


async def test_a_bad_spec_among_concurrent_good_ones_is_refused_alone(
    operator: grpc.aio.Channel,
) -> None:
    """Validated before grouping: the bad one gets INVALID_ARGUMENT naming its own field,
    as a single call's (``spec.…``, never ``specs[i]``); the others are stored."""
    specs = [spec(f"mixed-{i}", [python_task("t", "", resources=GOOD)]) for i in range(CALLS)]
    bad = CALLS // 2
    specs[bad] = spec("mixed-bad", [python_task("t", "", resources={"cpu": -1})])
    replies = await submit_all(operator, specs)
    for i, reply in enumerate(replies):
        if i == bad:
            assert isinstance(reply, grpc.aio.AioRpcError), reply
            assert reply.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert list(violations(reply)) == ["spec.tasks[0].resources.cpu"]
        else:
            assert isinstance(reply, job_service_pb2.SubmitJobResponse), reply
            assert reply.job.spec.name == f"mixed-{i}"


async def test_concurrent_submits_of_one_chosen_id_make_one_job(
    operator: grpc.aio.Channel,
) -> None:
    """Two callers choosing the same id at once, among others: one job, one refusal on
    ``spec.id``, as when they come one after the other."""
    specs = [spec(f"chosen-{i}", [python_task("t", "", resources=GOOD)]) for i in range(8)]
    specs[2].id = specs[5].id = "same-id"
    replies = await submit_all(operator, specs)
    refused = [r for r in replies if isinstance(r, grpc.aio.AioRpcError)]
    assert len(refused) == 1
    assert refused[0].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert list(violations(refused[0])) == ["spec.id"]
    stored = [r.job for r in replies if isinstance(r, job_service_pb2.SubmitJobResponse)]
    assert len(stored) == 7
    assert [j.id for j in stored].count("same-id") == 1
