"""How fast a coordinator takes in view deltas, and how much memory a large federation costs.

A real coordinator process (embedded store, mTLS). From a second process, N sites join with
their own certificates and open the real Connect stream, each saying hello with a view of
100 nodes x 8 GPUs. Then every site sends view deltas (one node changed each) as fast as its
stream takes them, and the coordinator's own counters tell when all were applied. In the same
run, the same streams carry bare heartbeats (which the coordinator only counts): the baseline
that deltas are compared with. Memory is the coordinator's resident set before the sites
joined (the baseline) and after. Last, in this process: how long the placement snapshot of
such a federation takes to build from scratch, and again after one site's delta.

    python bench/views.py [--sites 1000] [--deltas 50] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

from federation.agent.config import AgentConfig
from federation.agent.enroll import ensure_enrolled
from federation.api.v1 import resources_pb2, site_link_service_pb2, site_link_service_pb2_grpc
from federation.coordinator.sites.live_view import LiveView
from federation.envelopes import envelopes
from federation.local import LocalFederation
from federation.placement.snapshot import SiteInput, build_snapshot
from federation.security.tls import channel_credentials

NODES, GPUS = 100, 8
HEARTBEAT_ROUNDS = 100
"""Heartbeats each site sends for the baseline, unless told otherwise (``--heartbeats``)."""


def view(site: str) -> resources_pb2.SiteView:
    out = resources_pb2.SiteView(site=site, domain=resources_pb2.DOMAIN_DATACENTER)
    for n in range(NODES):
        node = out.nodes.add(
            name=f"n{n:03d}",
            cpu_cores=128,
            cpu_free=128,
            schedulable=True,
            memory_mib=1 << 20,
            memory_free_mib=1 << 20,
            labels={"driver": "550.54", "cuda": "12.4"},
        )
        for g in range(GPUS):
            node.devices.add(
                id=f"n{n}-g{g}",
                index=g,
                kind=resources_pb2.DEVICE_KIND_GPU,
                vendor="nvidia",
                model="H100-80GB",
                memory_total_mib=81920,
                memory_free_mib=81920,
                health=resources_pb2.DEVICE_HEALTH_HEALTHY,
                interconnect_group=f"nvl-{n}",
                provenance=2,
            )
    return out


def metric(port: int, name: str) -> float:
    """One sample of the coordinator's Prometheus metrics, by its full name and labels. Only
    its own series are asked for: the whole page costs the coordinator 50-60 us per site (its
    per-site gauges; 60 ms at 1,000 sites), which polled as often as here would weigh more
    than what is measured."""
    series = name.partition("{")[0]
    url = f"http://127.0.0.1:{port}/metrics?name[]={series}"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def counter(port: int, kind: str) -> float:
    return metric(port, f'federation_site_messages_total{{kind="{kind}"}}')


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Site:
    """One site's Connect stream, fed from a queue."""

    def __init__(self, name: str, channel: grpc.aio.Channel) -> None:
        self.name = name
        self.queue: asyncio.Queue[site_link_service_pb2.AgentMessage | None] = asyncio.Queue()
        self.generation = 1
        stub = site_link_service_pb2_grpc.SiteLinkServiceStub(channel)
        # As the agent writes: everything queued goes in one stream message.
        self.call = stub.Connect(
            envelopes(
                self.queue, lambda messages: site_link_service_pb2.ConnectRequest(messages=messages)
            )
        )

    async def hello(self, base: resources_pb2.SiteView) -> None:
        own = resources_pb2.SiteView()
        own.CopyFrom(base)
        own.site = self.name
        hello = site_link_service_pb2.Hello(view=own, generation=1)
        self.queue.put_nowait(site_link_service_pb2.AgentMessage(hello=hello))
        await self.call.read()  # the welcome: the coordinator has the view

    def send_heartbeats(self, count: int) -> None:
        for _ in range(count):
            self.queue.put_nowait(
                site_link_service_pb2.AgentMessage(
                    heartbeat=site_link_service_pb2.Heartbeat(generation=self.generation)
                )
            )

    def send_deltas(self, count: int, node: resources_pb2.Node) -> None:
        for i in range(count):
            self.generation += 1
            changed = resources_pb2.Node()
            changed.CopyFrom(node)
            changed.cpu_free = float(i % 128)
            delta = resources_pb2.SiteViewDelta(upserted_nodes=[changed])
            update = site_link_service_pb2.ViewUpdate(generation=self.generation, delta=delta)
            self.queue.put_nowait(site_link_service_pb2.AgentMessage(view=update))


async def wait_for(port: int, kind: str, target: float, sites: int) -> None:
    """Poll the coordinator's counter (another process: nothing to await but its metrics)
    every 10 ms (a phase of 4,000 heartbeats lasts about 80 ms); fail if it dropped a site,
    whose messages would then never all arrive."""
    while True:
        if counter(port, kind) >= target:
            return
        if metric(port, "federation_sites_connected") < sites:
            raise RuntimeError(f"the coordinator dropped sites while {kind} messages were sent")
        await asyncio.sleep(0.01)


async def measure(n_sites: int, deltas: int, beats: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-views-") as root:
        # These sites send heartbeats only in the heartbeat phase, not on a timer: a long
        # silence window keeps them connected while the coordinator works through the deltas.
        fed = LocalFederation(
            Path(root),
            [],
            coordinator_args=["--metrics-listen", "127.0.0.1:0", "--missed-heartbeats", "100"],
        )
        await fed.start_coordinator()
        pid = fed.processes["coordinator"].pid
        channels: list[grpc.aio.Channel] = []
        try:
            idle = rss_mib(pid)
            base = view("template")
            sites = []
            for i in range(n_sites):
                name = f"site-{i:04d}"
                config = AgentConfig(
                    site=name,
                    domain="datacenter",
                    coordinator=fed.address,
                    ca=fed.pki.ca_cert,
                    state_dir=Path(root) / "sites" / name,
                    token=await fed.create_token(name, "datacenter"),
                    join_address=f"127.0.0.1:{fed.join_port}",
                )
                creds = await ensure_enrolled(config)
                channel = grpc.aio.secure_channel(fed.address, channel_credentials(creds.tls))
                channels.append(channel)
                sites.append(Site(name, channel))
            await asyncio.gather(*(s.hello(base) for s in sites))
            loaded = rss_mib(pid)

            before = counter(fed.metrics_port, "heartbeat")
            start = time.perf_counter()
            for s in sites:
                s.send_heartbeats(beats)
            await wait_for(fed.metrics_port, "heartbeat", before + n_sites * beats, n_sites)
            heartbeats_per_s = n_sites * beats / (time.perf_counter() - start)

            before = counter(fed.metrics_port, "view")
            start = time.perf_counter()
            for s in sites:
                s.send_deltas(deltas, base.nodes[0])
            await wait_for(fed.metrics_port, "view", before + n_sites * deltas, n_sites)
            deltas_per_s = n_sites * deltas / (time.perf_counter() - start)
            after = rss_mib(pid)
        finally:
            for channel in channels:
                await channel.close()
            fed.stop()
    return {
        "devices": float(n_sites * NODES * GPUS),
        "node_updates_per_s": deltas_per_s,
        "heartbeats_per_s": heartbeats_per_s,
        "updates_vs_heartbeats": deltas_per_s / heartbeats_per_s,
        "rss_idle_mib": idle,
        "rss_loaded_mib": loaded,
        "rss_after_deltas_mib": after,
    }


def snapshot_rebuild(n_sites: int) -> dict[str, float]:
    """Seconds to build the placement snapshot of the whole federation from its views (the
    baseline), and to build it again after one site's delta, with the coordinator's own live
    views (which keep each unchanged site's arrays). In this process, not the coordinator."""
    base = view("template")
    sites = []
    for i in range(n_sites):
        own = resources_pb2.SiteView()
        own.CopyFrom(base)
        own.site = f"site-{i:04d}"
        sites.append(LiveView(own))

    def build() -> float:
        start = time.perf_counter()
        build_snapshot([SiteInput(s.header, True, False, s.part()) for s in sites])
        return time.perf_counter() - start

    full = build()
    changed = resources_pb2.Node()
    changed.CopyFrom(base.nodes[0])
    changed.cpu_free = 1
    sites[0].apply(resources_pb2.SiteViewDelta(upserted_nodes=[changed]))
    return {"snapshot_full_s": full, "snapshot_after_delta_s": build()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sites", type=int, default=1000)
    parser.add_argument("--deltas", type=int, default=50, help="per site")
    parser.add_argument(
        "--heartbeats",
        type=int,
        default=HEARTBEAT_ROUNDS,
        help=f"per site, for the baseline (default {HEARTBEAT_ROUNDS}; a phase as short as the "
        "deltas' (20 a site: about 80 ms) measured 42,000 to 134,000 a second run to run)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    measured = asyncio.run(measure(args.sites, args.deltas, args.heartbeats))
    result = measured | snapshot_rebuild(args.sites)
    if args.json:
        json.dump({str(args.sites): result}, sys.stdout, indent=2)
        print()
        return
    print(
        f"{'sites':>6} {'devices':>9} {'node updates/s':>15} {'heartbeats/s':>13} {'ratio':>6} "
        f"{'RSS idle MiB':>13} {'RSS loaded MiB':>15} {'RSS after deltas MiB':>21} "
        f"{'snapshot s: full, after a delta':>32}"
    )
    print(
        f"{args.sites:>6} {int(result['devices']):>9} {result['node_updates_per_s']:>15.0f} "
        f"{result['heartbeats_per_s']:>13.0f} {result['updates_vs_heartbeats']:>6.2f} "
        f"{result['rss_idle_mib']:>13.0f} {result['rss_loaded_mib']:>15.0f} "
        f"{result['rss_after_deltas_mib']:>21.0f} "
        f"{result['snapshot_full_s']:>23.2f}, {result['snapshot_after_delta_s']:.3f}"
    )


if __name__ == "__main__":
    main()
