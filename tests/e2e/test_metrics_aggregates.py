"""The coordinator's federation-wide gauges, scraped from a real coordinator's /metrics while
real agents connect, run a task on a device, and leave."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from federation.api.v1 import job_service_pb2
from federation.local import LocalFederation, SiteSpec

from .conftest import gpu_site, jobs, python_task, running, spec

pytestmark = pytest.mark.xdist_group("e2e-metrics")

SITES = [
    gpu_site("gpu-m", 2),
    SiteSpec(
        "host-m",
        "edge",
        discover_host=True,  # this machine's node: a measured CPU reading, whatever devices
        nodes=[
            {
                "name": "box",
                "cpu_cores": 8,
                "memory_mib": 16384,
                "devices": [
                    {"kind": "NPU", "vendor": "huawei", "model": "Ascend-910B", "count": 1}
                ],
            }
        ],
    ),
]

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFederation]:
    with running(
        tmp_path_factory.mktemp("metrics"), SITES, ["--metrics-listen", "127.0.0.1:0"]
    ) as federation:
        yield federation


def scrape(fed: LocalFederation) -> Samples:
    url = f"http://127.0.0.1:{fed.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def get(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def eventually(
    fed: LocalFederation, check: Callable[[Samples], bool], timeout_s: float = 30
) -> Samples:
    """Scrape until ``check`` holds; the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(fed)
        if check(samples):
            return samples
        assert time.monotonic() < deadline, {k: v for k, v in samples.items() if "site" in str(k)}
        time.sleep(0.2)


def site_devices(samples: Samples, site: str, state: str = "total") -> float | None:
    return get(samples, "federation_site_devices", site=site, state=state)


def all_devices(samples: Samples) -> float:
    """federation_devices{state="total"} summed over kinds and models."""
    return sum(
        value
        for (name, labels), value in samples.items()
        if name == "federation_devices" and ("state", "total") in labels
    )


def test_aggregates_follow_the_sites(fed: LocalFederation) -> None:
    """Connected sites' devices and cores are counted per kind and model and per site; a task
    on a GPU books one and runs at its site; a site that leaves is no longer counted. (The
    host's own devices, if any, are counted at host-m: totals are checked against it.)"""
    samples = eventually(fed, lambda s: site_devices(s, "gpu-m") == 2)
    assert site_devices(samples, "gpu-m", "healthy") == 2
    assert site_devices(samples, "gpu-m", "booked") == 0
    host_devices = site_devices(samples, "host-m")
    assert host_devices is not None
    assert host_devices >= 1  # the declared NPU and whatever this machine has
    assert all_devices(samples) == 2 + host_devices
    a100 = {"kind": "GPU", "model": "A100-80GB"}
    assert (get(samples, "federation_devices", **a100, state="total") or 0) >= 2
    host_cores = get(samples, "federation_site_cpu_cores", site="host-m", state="total")
    assert host_cores is not None
    assert host_cores > 8  # the declared node and this machine's
    assert get(samples, "federation_cpu_cores", state="total") == host_cores + 64
    # This machine's node has a reading; declared nodes have none.
    assert get(samples, "federation_cpu_cores", state="measured") == host_cores - 8
    assert get(samples, "federation_site_cpu_utilization_mean", site="host-m") is not None
    assert get(samples, "federation_site_cpu_utilization_mean", site="gpu-m") is None

    async def submit() -> str:
        async with fed.operator().channel() as channel:
            task = python_task(
                "t",
                "import time; time.sleep(120)",
                resources={"accelerator": {"kind": "GPU", "count": 1}},
            )
            pinned = spec("booked", [task], constraints={"sites": ["gpu-m"]})
            request = job_service_pb2.SubmitJobRequest(spec=pinned)
            return (await jobs(channel).SubmitJob(request)).job.id

    job_id = asyncio.run(submit())
    samples = eventually(
        fed,
        lambda s: (
            site_devices(s, "gpu-m", "booked") == 1
            and get(s, "federation_site_tasks", site="gpu-m", state="running") == 1
        ),
    )
    assert get(samples, "federation_tasks", state="running") == 1
    assert get(samples, "federation_devices", **a100, state="booked") == 1

    async def cancel() -> None:
        async with fed.operator().channel() as channel:
            await jobs(channel).CancelJob(job_service_pb2.CancelJobRequest(job_id=job_id))

    asyncio.run(cancel())
    eventually(fed, lambda s: site_devices(s, "gpu-m", "booked") == 0)
    assert fed.terminate("host-m")
    samples = eventually(fed, lambda s: site_devices(s, "host-m") is None)
    assert all_devices(samples) == 2
    assert (
        get(samples, "federation_devices", kind="NPU", model="Ascend-910B", state="total") is None
    )
    assert get(samples, "federation_cpu_cores", state="total") == 64
    assert get(samples, "federation_cpu_cores", state="measured") == 0
