"""A task's replicas spread and divided over sites, through real agents and processes: the
site each part ran at is the one its own processes saw (``FEDERATION_SITE``)."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.cli.explain import division as explain_division
from federation.cli.render import division_line
from federation.coordinator.jobs import spread
from federation.local import LocalFederation

from .conftest import gpu_site, jobs, python_task, running, spec, wait_for_job
from .test_refusals import job_count, violations

pytestmark = pytest.mark.xdist_group("e2e-spread")

# dc-a is the fastest: placement by completion time alone would put every part there.
SITES = [
    gpu_site("dc-a", 8, "H100-80GB"),
    gpu_site("dc-b", 8, "V100"),
    gpu_site("cloud-a", 8, "V100"),
]
MARK = (
    "import os, sys; open(sys.argv[1], 'a').write("
    "os.environ['FEDERATION_SITE'] + ' ' + os.environ['FEDERATION_TASK'] + ' ' + "
    "os.environ['FEDERATION_REPLICA'] + '\\n')"
)


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    with running(tmp_path_factory.mktemp("spread"), SITES) as federation:
        yield federation


def divided(name: str, marker: Path, replicas: int, **rule: object) -> jobs_pb2.JobSpec:
    task = python_task(
        "train",
        MARK,
        replicas=replicas,
        estimated_duration_s=3600,
        resources={"cpu": 1, "accelerator": {"kind": "GPU", "count": 1}},
        spread=rule,
    )
    task["command"] = [*task["command"], str(marker)]  # type: ignore[misc]
    return spec(name, [task])


async def run(channel: grpc.aio.Channel, job_spec: jobs_pb2.JobSpec) -> jobs_pb2.Job:
    job = (await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=job_spec))).job
    return await wait_for_job(channel, job.id, timeout_s=90)


def ran(marker: Path) -> dict[str, set[str]]:
    """Per part, the sites its replicas ran at, as they wrote them."""
    out: dict[str, set[str]] = collections.defaultdict(set)
    for line in marker.read_text().splitlines():
        site, task, _replica = line.split()
        out[task].add(site)
    return out


def per_site(job: jobs_pb2.Job) -> dict[str, int]:
    return dict(collections.Counter(t.site for t in job.tasks))


def test_six_replicas_over_three_sites_with_max_skew_one_land_two_each(
    fed: LocalFederation, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"

    async def go() -> tuple[jobs_pb2.Job, job_service_pb2.ExplainJobResponse]:
        async with fed.operator().channel() as channel:
            job = await run(channel, divided("skew", marker, 6, max_skew=1))
            request = job_service_pb2.ExplainJobRequest(job_id=job.id)
            return job, await jobs(channel).ExplainJob(request)

    job, explained = asyncio.run(go())
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, job
    assert [t.name for t in job.tasks] == [f"train/{n}" for n in range(6)]
    assert {t.part_of for t in job.tasks} == {"train"}
    assert all(s.replicas == 1 for s in job.spec.tasks)
    assert per_site(job) == {"dc-a": 2, "dc-b": 2, "cloud-a": 2}
    assert {task: sites for task, sites in ran(marker).items()} == {
        t.name: {t.site} for t in job.tasks
    }
    line = division_line("train", spread.division(job)["train"])
    assert line.startswith("train: 6 replicas in 6 parts: ")
    assert sorted(line.split(": ")[2].split(", ")) == ["cloud-a 2", "dc-a 2", "dc-b 2"]
    [shown] = explain_division(explained.tasks)
    assert shown.plain.startswith("train: 6 parts: ")


def test_a_gang_part_stays_whole_at_one_site(fed: LocalFederation, tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    async def go() -> jobs_pb2.Job:
        async with fed.operator().channel() as channel:
            return await run(channel, divided("gang", marker, 4, part_replicas=2, max_skew=1))

    job = asyncio.run(go())
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, job
    assert [(s.name, s.replicas) for s in job.spec.tasks] == [("train/0", 2), ("train/1", 2)]
    lines = marker.read_text().splitlines()
    assert len(lines) == 4
    by_part = ran(marker)
    assert all(len(sites) == 1 for sites in by_part.values()), by_part
    assert len({site for sites in by_part.values() for site in sites}) == 2  # within skew 1


def test_static_weights_two_to_one_divide_six_parts_four_and_two(
    fed: LocalFederation, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"

    async def go() -> jobs_pb2.Job:
        async with fed.operator().channel() as channel:
            rule = {"site_weights": {"dc-b": 2, "cloud-a": 1}}
            return await run(channel, divided("weights", marker, 6, **rule))

    job = asyncio.run(go())
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, job
    assert per_site(job) == {"dc-b": 4, "cloud-a": 2}
    assert {task: sites for task, sites in ran(marker).items()} == {
        t.name: {t.site} for t in job.tasks
    }


@pytest.mark.parametrize(
    ("replicas", "rule", "field", "words"),
    [
        (6, {"part_replicas": 4}, "spec.tasks[0].spread.part_replicas", "must divide replicas"),
        (6, {"site_weights": {"dc-a": 0}}, "spec.tasks[0].spread.site_weights[dc-a]", "positive"),
        (6, {"site_weights": {"Bad_Site": 1}}, "spec.tasks[0].spread.site_weights['Bad_Site']", ""),
        (
            6,
            {"max_skew": 1, "site_weights": {"dc-a": 1}},
            "spec.tasks[0].spread.max_skew",
            "not both",
        ),
        (
            6,
            {"topology": "region", "site_weights": {"dc-a": 1}},
            "spec.tasks[0].spread.topology",
            "by site",
        ),
        (600, {}, "spec.tasks[0].spread.part_replicas", "at most 256"),
    ],
)
def test_bad_spreads_are_refused_with_the_field_and_nothing_stored(
    fed: LocalFederation,
    tmp_path: Path,
    replicas: int,
    rule: dict[str, object],
    field: str,
    words: str,
) -> None:
    async def go() -> tuple[grpc.aio.AioRpcError, int, int]:
        async with fed.operator().channel() as channel:
            before = await job_count(channel)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await jobs(channel).SubmitJob(
                    job_service_pb2.SubmitJobRequest(
                        spec=divided("bad", tmp_path / "ran", replicas, **rule)
                    )
                )
            return caught.value, before, await job_count(channel)

    err, before, after = asyncio.run(go())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    found = violations(err)
    assert field in found, found
    assert words in found[field]
    assert after == before
