"""Discovery that keeps looking, through a real agent: a device that turns unhealthy or
disappears reaches the coordinator's view, gets no new work, and fedctl shows why."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from rich.console import Console

from federation.api.v1 import admin_service_pb2, job_service_pb2, jobs_pb2, resources_pb2
from federation.cli.render import sites_table, unhealthy_devices_table
from federation.local import LocalFederation, SiteSpec

from .conftest import admin, jobs, python_task, spec, until_event, wait_for_job

pytestmark = pytest.mark.xdist_group("e2e-rediscovery")

RECORDING = Path(__file__).parents[1] / "agent" / "fixtures" / "ascend" / "npu-smi-910b.txt"
HEALTHY = resources_pb2.DEVICE_HEALTH_HEALTHY
UNHEALTHY = resources_pb2.DEVICE_HEALTH_UNHEALTHY


def npu_smi_report() -> list[str]:
    """``npu-smi info`` of four healthy 910B chips, as lines."""
    lines = [line for line in RECORDING.read_text().splitlines() if not line.startswith("#")]
    return [line.replace("| Warning       |", "| OK            |") for line in lines]


@pytest.fixture(scope="module")
def fed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalFederation, Path]]:
    """A site that discovers its host, where a fake ``npu-smi`` (a real program on the agent's
    PATH) prints whatever ``report`` holds."""
    root = tmp_path_factory.mktemp("rediscovery")
    bin_dir, report = root / "bin", root / "npu-smi.txt"
    bin_dir.mkdir()
    report.write_text("\n".join(npu_smi_report()) + "\n")
    tool = bin_dir / "npu-smi"
    tool.write_text(
        f"#!{sys.executable}\nimport sys\nsys.stdout.write(open({str(report)!r}).read())\n"
    )
    tool.chmod(0o755)
    site = SiteSpec(
        "edge-npu", "edge", discover_host=True, settings={"rediscover_interval_s": 3600}
    )
    federation = LocalFederation(root / "fed", [site])
    path = os.environ["PATH"]
    os.environ["PATH"] = f"{bin_dir}:{path}"  # the agent inherits it when it starts
    try:
        asyncio.run(federation.start())
    finally:
        os.environ["PATH"] = path
    try:
        yield federation, report
    finally:
        federation.stop()


@pytest_asyncio.fixture
async def operator(fed: tuple[LocalFederation, Path]) -> AsyncIterator[grpc.aio.Channel]:
    async with fed[0].operator().channel() as channel:
        yield channel


async def npus(channel: grpc.aio.Channel) -> list[resources_pb2.Device]:
    reply = await admin(channel).ListSites(admin_service_pb2.ListSitesRequest())
    (site,) = reply.sites
    return [
        d for n in site.view.nodes for d in n.devices if d.kind == resources_pb2.DEVICE_KIND_NPU
    ]


async def test_a_device_that_fails_or_goes_away_gets_no_new_work(
    fed: tuple[LocalFederation, Path], operator: grpc.aio.Channel
) -> None:
    federation, report = fed
    found = await npus(operator)
    assert [d.health for d in found] == [HEALTHY] * 4
    reply = await admin(operator).ListSites(admin_service_pb2.ListSitesRequest())
    assert reply.sites[0].view.nodes[0].measured.measured_at > 0  # the host's use, measured

    # NPU 1 raises an alarm and NPU 2 vanishes from npu-smi's table.
    lines = npu_smi_report()
    first = next(i for i, line in enumerate(lines) if line.startswith("| 1     910B3"))
    lines[first] = lines[first].replace("| OK            |", "| Alarm         |")
    second = next(i for i, line in enumerate(lines) if line.startswith("| 2     910B3"))
    del lines[second : second + 3]
    report.write_text("\n".join(lines) + "\n")
    federation.processes["edge-npu"].send_signal(signal.SIGUSR1)  # discover again now
    deadline = time.monotonic() + 20
    expected = [HEALTHY, UNHEALTHY, UNHEALTHY, HEALTHY]
    found = await npus(operator)
    while [d.health for d in found] != expected:
        assert time.monotonic() < deadline, [d.health for d in found]
        await asyncio.sleep(0.2)
        found = await npus(operator)
    assert found[1].health_reason == "npu-smi reports health Alarm"
    assert found[2].health_reason == "not found when the host was discovered again"

    # fedctl status lists both, with the reasons.
    reply = await admin(operator).ListSites(admin_service_pb2.ListSitesRequest())
    table = unhealthy_devices_table(reply.sites)
    assert table is not None
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(table)
    shown = console.export_text()
    assert "npu-smi reports health Alarm" in shown
    assert "not found when the host was discovered again" in shown

    # Work goes only to the two healthy NPUs: two fit, three do not.
    ask = {"resources": {"accelerator": {"kind": "NPU", "count": 2}}}
    stub = jobs(operator)
    two = await stub.SubmitJob(
        job_service_pb2.SubmitJobRequest(spec=spec("two-npus", [python_task("t", "pass", **ask)]))
    )
    job = await wait_for_job(operator, two.job.id)
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, job.tasks[0].reason
    assert [d.split(":")[-1] for d in job.tasks[0].devices] == ["0", "3"]
    ask["resources"]["accelerator"]["count"] = 3  # type: ignore[index]
    three = await stub.SubmitJob(
        job_service_pb2.SubmitJobRequest(spec=spec("three-npus", [python_task("t", "pass", **ask)]))
    )

    def tried_with_two_free(event: jobs_pb2.JobEvent) -> bool:
        return (
            event.task == "t"
            and event.state == jobs_pb2.JOB_STATE_PENDING
            and "2 matching free device(s)" in event.reason
        )

    # The scheduler has tried it once two-npus had given its NPUs back: it recorded the task
    # PENDING because the site has two free NPUs that count (four, were the bad ones counted).
    seen = await until_event(operator, three.job.id, tried_with_two_free, "the scheduler's verdict")
    job = seen.job
    assert job.state == jobs_pb2.JOB_STATE_PENDING
    (verdict,) = job.tasks[0].verdicts
    assert verdict.site == "edge-npu"
    assert verdict.code == "INSUFFICIENT_FREE_CAPACITY"
    assert "3xNPU" in verdict.reason
    assert (job.tasks[0].site, job.tasks[0].epoch) == ("", 0)  # never offered
    await stub.CancelJob(job_service_pb2.CancelJobRequest(job_id=three.job.id))


async def test_the_site_measures_its_link_to_the_coordinator(operator: grpc.aio.Channel) -> None:
    """The welcome names the coordinator's link probe; the agent measures the link there and
    publishes it in its view (it paces its readings by it)."""
    deadline = time.monotonic() + 30
    while True:
        reply = await admin(operator).ListSites(admin_service_pb2.ListSitesRequest())
        link = reply.sites[0].view.coordinator_link
        if link.measured_at:
            break
        assert time.monotonic() < deadline, "the agent never measured its coordinator link"
        await asyncio.sleep(0.1)
    assert link.bandwidth_mbps > 0
    assert link.rtt_ms > 0
    assert not link.peer_site
    out = io.StringIO()
    Console(file=out, width=250).print(sites_table(reply.sites))
    assert f"{link.bandwidth_mbps:,.0f} Mbit/s" in out.getvalue()  # fedctl sites shows it
