"""How long one placement decision (filter + score, no I/O) takes as the federation grows.

Synthetic federations of 10 to 10,000 sites (mixed domains, 1-100 nodes per site, 0-8 devices
per node from the PAI fleet's GPU mix), with site-to-site links drawn from measured
inter-region throughput and RTT (Skyplane, 2022; edge uplinks scaled down 10x, since a cloud
VM's 64-stream iperf is no edge uplink). Each figure stands beside a baseline measured in the
same run: the same decision made by a plain Python loop over sites and nodes.

    python bench/placement.py [--sizes 10,100,1000,10000] [--repeat 50] [--json]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from federation.api.v1 import jobs_pb2, resources_pb2
from federation.placement.registry import build_framework
from federation.placement.request import Request
from federation.placement.snapshot import DeviceClass, Snapshot

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
MODELS = ["P100", "T4", "V100", "V100-32GB", "A100-80GB", "H100-80GB"]
GPU = resources_pb2.DEVICE_KIND_GPU


def load_links(data: Path) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Regions, and (from, to) throughput in Mbit/s and RTT in ms; NaN where unmeasured."""
    throughput: dict[tuple[str, str], list[float]] = defaultdict(list)
    with (data / "network" / "skyplane_throughput_2022-01.csv").open() as f:
        for row in csv.DictReader(f):
            bps = float(row["throughput_received_bps"])
            throughput[row["src_region"], row["dst_region"]].append(bps / 1e6)
    rtt: dict[tuple[str, str], float] = {}
    with (data / "network" / "skyplane_rtt_2022-04.csv").open() as f:
        for row in csv.DictReader(f):
            rtt[row["src_region"], row["dst_region"]] = float(row["avg_rtt"])
    regions = sorted({r for pair in throughput for r in pair})
    index = {r: i for i, r in enumerate(regions)}
    bw = np.full((len(regions), len(regions)), np.nan)
    lat = np.full((len(regions), len(regions)), np.nan)
    for (a, b), values in throughput.items():
        bw[index[a], index[b]] = statistics.median(values)
    for (a, b), value in rtt.items():
        if a in index and b in index:
            lat[index[a], index[b]] = value
    return regions, bw, lat


def synthetic(
    n_sites: int, rng: np.random.Generator, links: tuple[list[str], np.ndarray, np.ndarray]
) -> Snapshot:
    """A federation as placement sees it, built straight into arrays (no protobuf)."""
    regions, region_bw, region_rtt = links
    nodes_per_site = rng.integers(1, 101, n_sites)
    node_site = np.repeat(np.arange(n_sites), nodes_per_site)
    n_nodes = len(node_site)
    devices_per_node = rng.integers(0, 9, n_nodes)
    device_node = np.repeat(np.arange(n_nodes), devices_per_node)
    n_dev = len(device_node)
    # Machines carry one GPU model each, as in the PAI fleet.
    node_model = rng.integers(0, len(MODELS), n_nodes)
    device_class = node_model[device_node]
    available = rng.random(n_dev) > 0.5
    classes = tuple(
        DeviceClass(
            GPU,
            "nvidia",
            m,
            32768.0,
            {
                "vendor": "nvidia",
                "model": m,
                "kind": "GPU",
                "memory_gib": 32.0,
                "power_tdp_watts": 300.0,
                "attributes": {},
            },
        )
        for m in MODELS
    )
    site_region = rng.integers(0, len(regions), n_sites)
    bw = region_bw[np.ix_(site_region, site_region)]
    rtt = region_rtt[np.ix_(site_region, site_region)]
    domain = rng.integers(1, 4, n_sites)
    edge = domain == 1
    bw[edge, :] /= 10
    bw[:, edge] /= 10
    known = ~np.isnan(bw)
    bw = np.where(known, bw, 100.0)
    rtt = np.where(np.isnan(rtt), 100.0, rtt)
    np.fill_diagonal(bw, np.inf)
    np.fill_diagonal(rtt, 0.0)
    holders = set(rng.choice(n_sites, size=min(3, n_sites), replace=False).tolist())
    datasets = tuple({"imagenet": 150 * 10**9} if i in holders else {} for i in range(n_sites))
    free_per_node = np.bincount(device_node, weights=available, minlength=n_nodes)
    has_devices = devices_per_node > 0
    return Snapshot(
        site_ids=tuple(f"site-{i:05d}" for i in range(n_sites)),
        domain=domain.astype(np.int64),
        region=np.array([regions[r] for r in site_region], dtype=object),
        is_connected=rng.random(n_sites) > 0.02,
        is_cordoned=rng.random(n_sites) < 0.01,
        node_site=node_site.astype(np.int64),
        node_cpu_free=rng.uniform(0, 96, n_nodes),
        node_memory_free_mib=rng.uniform(0, 512 * 1024, n_nodes),
        node_schedulable=rng.random(n_nodes) > 0.02,
        node_labels=tuple({} for _ in range(n_nodes)),
        device_node=device_node.astype(np.int64),
        device_kind=np.full(n_dev, GPU, dtype=np.int64),
        device_vendor=np.full(n_dev, "nvidia", dtype=object),
        device_model=np.array(MODELS, dtype=object)[device_class],
        device_memory_mib=np.full(n_dev, 32768.0),
        device_available=available,
        device_class=device_class.astype(np.int64),
        device_shareable=np.zeros(n_dev, dtype=bool),
        device_free_fraction=np.zeros(n_dev),
        device_group=np.arange(n_dev, dtype=np.int64),
        device_tflops_fp16=np.full(n_dev, 100.0),
        device_power_watts=np.full(n_dev, 300.0),
        classes=classes,
        pair_node=np.flatnonzero(has_devices).astype(np.int64),
        pair_class=node_model[has_devices].astype(np.int64),
        pair_free=free_per_node[has_devices].astype(np.float64),
        queue_wait_s=rng.exponential(600, n_sites),
        price_per_device_hour=np.where(domain == 3, 2.5, 0.0),
        datasets=datasets,
        bandwidth_mbps=bw,
        rtt_ms=rtt,
        link_known=known,
    )


def request() -> Request:
    task = jobs_pb2.TaskSpec(
        name="train",
        command=["x"],
        replicas=2,
        estimated_duration_s=3600,
        resources=jobs_pb2.ResourceRequest(
            cpu=8,
            memory_mib=65536,
            accelerator=jobs_pb2.AcceleratorRequest(
                kind=GPU, count=2, models=["V100", "A100-80GB", "H100-80GB"]
            ),
        ),
        inputs=[jobs_pb2.DataInput(dataset="imagenet")],
    )
    return Request.from_spec(jobs_pb2.JobSpec(name="bench", tasks=[task]), task)


def baseline_decision(req: Request, snap: Snapshot) -> str | None:
    """The same feasibility and completion-time choice, one site and one node at a time."""
    free_by_node: dict[int, int] = defaultdict(int)
    models = req.accelerator_models
    for d in range(len(snap.device_node)):
        if snap.device_available[d] and snap.device_model[d] in models:
            free_by_node[int(snap.device_node[d])] += 1
    room: dict[int, float] = defaultdict(float)
    for n in range(snap.n_nodes):
        if not snap.node_schedulable[n]:
            continue
        fit = min(
            snap.node_cpu_free[n] // req.cpu,
            snap.node_memory_free_mib[n] // req.memory_mib,
            free_by_node[n] // req.accelerator_count,
        )
        room[int(snap.node_site[n])] += fit
    holders = [i for i, d in enumerate(snap.datasets) if "imagenet" in d]
    best, best_time = None, float("inf")
    for s in range(snap.n_sites):
        if not snap.is_connected[s] or snap.is_cordoned[s] or room[s] < req.replicas:
            continue
        transfer = min(
            (150e9 * 8 / (snap.bandwidth_mbps[h, s] * 1e6) for h in holders), default=0.0
        )
        total = snap.queue_wait_s[s] + transfer + req.duration_s
        if total < best_time:
            best, best_time = snap.site_ids[s], total
    return best


def percentile(samples: list[float], q: float) -> float:
    return float(np.percentile(np.array(samples), q))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100,1000,10000")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--data", type=Path, default=DATA, help="the shared/data folder")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    links = load_links(args.data)
    framework = build_framework()
    req = request()
    results: dict[str, dict[str, float]] = {}
    for size in (int(s) for s in args.sizes.split(",")):
        snap = synthetic(size, rng, links)
        framework.place(req, snap)  # warm-up: per-snapshot indexes, as a live coordinator has
        times = []
        for i in range(args.repeat):
            # A request never placed on this snapshot: nothing is reused from the last one.
            fresh = dataclasses.replace(req, duration_s=req.duration_s + i + 1)
            start = time.perf_counter()
            framework.place(fresh, snap)
            times.append((time.perf_counter() - start) * 1000)
        base_runs = max(3, args.repeat // 10)
        base = []
        for _ in range(base_runs):
            start = time.perf_counter()
            baseline_decision(req, snap)
            base.append((time.perf_counter() - start) * 1000)
        results[str(size)] = {
            "nodes": float(snap.n_nodes),
            "devices": float(len(snap.device_node)),
            "p50_ms": percentile(times, 50),
            "p99_ms": percentile(times, 99),
            "baseline_p50_ms": percentile(base, 50),
            "speedup_vs_baseline": percentile(base, 50) / percentile(times, 50),
        }
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
        return
    print(
        f"{'sites':>7} {'nodes':>9} {'devices':>10} {'p50 ms':>9} {'p99 ms':>9} "
        f"{'loop p50 ms':>12} {'speedup':>8}"
    )
    for label, r in results.items():
        print(
            f"{label:>7} {int(r['nodes']):>9} {int(r['devices']):>10} {r['p50_ms']:>9.2f} "
            f"{r['p99_ms']:>9.2f} {r['baseline_p50_ms']:>12.1f} "
            f"{r['speedup_vs_baseline']:>7.0f}x"
        )


if __name__ == "__main__":
    main()
