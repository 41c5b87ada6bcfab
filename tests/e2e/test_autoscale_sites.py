"""An autoscaled service that grows past its site, end to end: two sites with room for 2
replicas each; under load the service (max 4) fills its own site, and the 2 replicas more go to
the other site as another part of the service, placed by the scheduling cycle; every replica's
endpoint is listed. Under no load it shrinks back to 1: the other site's part is drained and
stopped first, then the first site's replicas, and no request fails meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from federation.api.v1 import job_service_pb2
from federation.local import LocalFederation, SiteSpec

from .conftest import jobs, running, spec, until
from .test_autoscale import Load, inference, serving_now
from .test_service_changes import event_reasons, stop
from .test_services import watching

pytestmark = pytest.mark.xdist_group("e2e-autoscale-sites")


def box(name: str) -> dict[str, object]:
    """Room for 2 replicas of 1 core."""
    return {"name": name, "cpu_cores": 2, "memory_mib": 8192}


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    sites = [
        SiteSpec("east", "edge", nodes=[box("east-box")]),
        SiteSpec("west", "edge", nodes=[box("west-box")]),
    ]
    with running(tmp_path_factory.mktemp("autoscale-sites"), sites) as f:
        yield f


async def test_a_service_grows_past_its_site_and_shrinks_back_without_dropping_a_request(
    fed: LocalFederation,
) -> None:
    async with fed.operator().channel() as channel:
        request = job_service_pb2.SubmitJobRequest(
            spec=spec("overflow", [inference(maxReplicas=4)])
        )
        job_id = (await jobs(channel).SubmitJob(request)).job.id
        follower, seen = await watching(channel, job_id)
        load = Load(seen)
        try:

            async def ready(count: int) -> bool:
                now = serving_now(seen)
                return len(now) == count and all(e.ready for e in now)

            await until(lambda: ready(1), "the first replica ready")
            first_site = serving_now(seen)[0].site
            load.to(6)
            started_up = time.monotonic()
            await until(lambda: ready(4), "4 replicas under load", timeout_s=90)
            up_s = time.monotonic() - started_up
            by_site = {e.site for e in serving_now(seen)}
            assert by_site == {"east", "west"}, serving_now(seen)
            assert sum(e.site == first_site for e in serving_now(seen)) == 2
            assert len({(e.site, e.port) for e in serving_now(seen)}) == 4
            await until(lambda: asyncio.sleep(0, len(load.served) >= 2), "replicas serving")
            load.to(1)
            started_down = time.monotonic()
            await until(lambda: ready(2), "the other site's part gone", timeout_s=90)
            assert {e.site for e in serving_now(seen)} == {first_site}
            await until(lambda: ready(1), "back to 1 replica", timeout_s=90)
            await until(lambda: asyncio.sleep(0, len(seen[-1]) == 1), "the drained ones gone")
            down_s = time.monotonic() - started_down
            print(f"scaled out 1 to 4 in {up_s:.1f}s, back to 1 in {down_s:.1f}s")
            served_before = sum(load.served.values())
            await until(
                lambda: asyncio.sleep(0, sum(load.served.values()) > served_before + 3),
                "requests served by the one replica left",
            )
        finally:
            await load.stop()
            follower.cancel()
        assert load.failed == [], load.failed
        other = [e for listed in seen for e in listed if e.site != first_site]
        assert any(e.draining for e in other), "the other site's replicas were not drained"
        reasons = await event_reasons(channel, job_id)
        assert any("placed as another part" in r for r in reasons), reasons
        assert any("drained and stopped" in r for r in reasons), reasons
        await stop(channel, job_id)
