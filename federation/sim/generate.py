"""Synthetic fleets and traces from measured public data.

The fleet samples machines from Alibaba PAI's machine list (``fleets/pai_machine_spec.csv``:
GPU model, CPUs, memory, GPUs per machine) and spreads them over edge, datacenter and cloud
sites in measured regions (links: ``network/skyplane_*.csv``). The trace samples run times
from Microsoft Philly's (``runtimes/philly_runtime.csv``), GPUs per job from Philly's mix
(mean 1.93 GPUs per job: AcmeTrace's ``cluster_summary.csv``), and arrivals from a Poisson
process whose rate makes the offered load what ``load`` asks for. Every knob is in
``Knobs``; docs/simulator.md lists them.
"""

from __future__ import annotations

import csv
import io
import os
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from federation.jobspec import parse_domain
from federation.placement.devices import REFERENCE_TFLOPS_FP16, speed_table
from federation.sim.fields import InputFileError, read_text
from federation.sim.links import load_rtt_csv, load_throughput_csv
from federation.sim.topology import KNOWN_MODELS
from federation.sim.trace import TraceTask

DATA = Path(__file__).resolve().parent / "data"
"""The measured data the package ships (``data/README.md`` names each file's source and
licence), so that a clone or an installed wheel generates alike."""
THROUGHPUT_CSV = Path("network/skyplane_throughput_2022-01.csv")
RTT_CSV = Path("network/skyplane_rtt_2022-04.csv")
FLEET_CSV = Path("fleets/pai_machine_spec.csv")
RUNTIME_CSV = Path("runtimes/philly_runtime.csv")
# PAI's GPU types as models the speed table knows; MISC machines hold K40m/K80/M60 cards.
PAI_MODELS = {"P100": "P100", "T4": "T4", "V100": "V100", "V100M32": "V100-32GB", "MISC": "K80"}
SHAREABLE = frozenset({"T4", "P100"})
"""Models whose devices tasks may share by fraction (PAI shares its small GPUs)."""
# Cloud on-demand list prices per GPU-hour (AWS p3/p3dn/g4dn/p2, GCP P100), 2024, rounded.
PRICE_PER_DEVICE_HOUR = {"V100": 3.06, "V100-32GB": 3.90, "T4": 0.53, "P100": 1.46, "K80": 0.90}
CLOUD_EGRESS_USD_PER_GB = 0.09
# Philly's GPUs per job (mean 1.98 against the measured 1.93).
GPU_COUNTS = {1: 0.70, 2: 0.12, 4: 0.10, 8: 0.08}
MODEL_CHOICES: tuple[tuple[str, float], ...] = (
    ("", 0.5),  # any model
    ("V100|V100-32GB", 0.3),
    ("P100|T4|V100|V100-32GB", 0.2),
)
# Relative size of a site, by domain.
SITE_WEIGHT = {"edge": 1.0, "datacenter": 8.0, "cloud": 4.0}


@dataclass(frozen=True, slots=True)
class Knobs:
    """What the generator makes; the defaults are the 10,000-job, 1,500-node benchmark."""

    jobs: int = 10_000
    nodes: int = 1_500
    sites: int = 60
    domains: Mapping[str, float] = field(
        default_factory=lambda: {"edge": 0.2, "datacenter": 0.5, "cloud": 0.3}
    )
    """Share of sites per domain."""
    load: float = 1.0
    """Offered load: device-seconds asked for / device-seconds the fleet has, over the trace."""
    input_share: float = 0.3
    """Share of jobs that read a dataset."""
    datasets: int = 20
    dataset_gb: float = 100.0
    """Median dataset size (log-normal, sigma 1, within 1 GB and 10x the median)."""
    fraction_share: float = 0.1
    """Share of single-GPU jobs that ask for half or a quarter of a shareable GPU instead."""
    cpu_share: float = 0.05
    """Share of jobs with no accelerator."""
    gang_share: float = 0.2
    """Share of 8-GPU jobs that are 2 replicas of 8 GPUs."""
    priority_share: float = 0.2
    """Share of jobs with priority 100 (the rest 0)."""
    deadline_share: float = 0.2
    """Share of jobs with a deadline of 2-5x their run time on the reference device."""
    reference_speed: float = 0.15
    """Speed (A100 = 1) of the devices the sampled run times were measured on (Philly: P100
    class); durations in the trace are scaled to a speed-1.0 device."""
    max_runtime_h: float = 168.0
    """Sampled run times are capped here (Philly's longest is 53 days)."""
    edge_decline_rate: float = 0.05
    """Share of offers edge sites decline although they have room (local work)."""
    edge_scale: float = 0.1
    """Measured cloud-VM bandwidth scale for links that touch an edge site."""


def _csv_column(path: Path, column: str) -> list[str]:
    try:
        return [row[column] for row in csv.DictReader(io.StringIO(read_text(path), newline=""))]
    except KeyError:
        raise InputFileError(f"{path}: no column {column!r}") from None


def load_fleet(data: Path) -> list[dict[str, str]]:
    """The PAI machine list."""
    path = data / FLEET_CSV
    return list(csv.DictReader(io.StringIO(read_text(path), newline="")))


def load_runtimes(data: Path) -> np.ndarray:
    """Philly's job run times in seconds."""
    path = data / RUNTIME_CSV
    return np.array([float(v) for v in _csv_column(path, "runtime")])


def _site_domains(knobs: Knobs, rng: np.random.Generator) -> list[str]:
    total = sum(knobs.domains.values())
    counts = {d: round(knobs.sites * share / total) for d, share in knobs.domains.items()}
    biggest = max(counts, key=lambda d: counts[d])
    counts[biggest] += knobs.sites - sum(counts.values())
    domains = [d for d, n in counts.items() for _ in range(max(n, 0))]
    for d in domains:
        parse_domain(d)  # fails on an unknown domain name
    return [str(d) for d in rng.permutation(domains)]


def generate_topology(
    knobs: Knobs, rng: np.random.Generator, data: Path, out_dir: Path
) -> dict[str, Any]:
    """A topology document; link data paths are written relative to ``out_dir``."""
    machines = load_fleet(data)
    picked = rng.choice(len(machines), size=knobs.nodes, replace=knobs.nodes > len(machines))
    # Edge sites get the small cards first, then sites fill up by GPU generation.
    order = ["T4", "P100", "CPU", "MISC", "V100", "V100M32"]
    chosen = sorted(
        (machines[int(i)] for i in picked),
        key=lambda m: (order.index(m["gpu_type"]) if m["gpu_type"] in order else 99, m["machine"]),
    )
    domains = sorted(_site_domains(knobs, rng), key=lambda d: d != "edge")
    weights = np.array([SITE_WEIGHT.get(d, 1.0) for d in domains]) * rng.lognormal(
        0, 0.5, len(domains)
    )
    extra = rng.multinomial(knobs.nodes - len(domains), weights / weights.sum())
    sizes = 1 + extra
    regions = sorted(
        set(load_throughput_csv(data / THROUGHPUT_CSV)) & set(load_rtt_csv(data / RTT_CSV))
    )
    region_names = sorted({r for pair in regions for r in pair})
    sites: list[dict[str, Any]] = []
    start = 0
    for n, (domain, size) in enumerate(zip(domains, sizes, strict=True)):
        mine = chosen[start : start + int(size)]
        start += int(size)
        shapes = Counter(
            (m["gpu_type"], float(m["cap_cpu"]), int(float(m["cap_mem"])), int(m["cap_gpu"]))
            for m in mine
        )
        nodes = []
        models: Counter[str] = Counter()
        for (gpu_type, cpu, mem_gb, gpus), count in sorted(shapes.items()):
            node: dict[str, Any] = {"count": count, "cpu": cpu, "memory_mib": mem_gb * 1024}
            model = PAI_MODELS.get(gpu_type)
            if model and gpus:
                device: dict[str, Any] = {"model": model, "count": gpus}
                if model in SHAREABLE:
                    device["shareable"] = True
                node["devices"] = [device]
                models[model] += count * gpus
            nodes.append(node)
        site: dict[str, Any] = {
            "name": f"{domain[:2]}-{n:03d}",
            "domain": domain,
            "region": str(region_names[int(rng.integers(len(region_names)))]),
            "nodes": nodes,
        }
        if domain == "cloud" and models:
            site["price_per_device_hour"] = PRICE_PER_DEVICE_HOUR[models.most_common(1)[0][0]]
            site["egress_usd_per_gb"] = CLOUD_EGRESS_USD_PER_GB
        if domain == "edge" and knobs.edge_decline_rate:
            site["decline_rate"] = knobs.edge_decline_rate
        sites.append(site)
    # Data is made where work is done today: at the edge and in datacenters.
    holders = [i for i, d in enumerate(domains) if d != "cloud"] or list(range(len(sites)))
    for k in range(knobs.datasets):
        site = sites[int(rng.choice(holders))]
        size_gb = min(max(knobs.dataset_gb * rng.lognormal(0, 1.0), 1.0), 10 * knobs.dataset_gb)
        site.setdefault("datasets", {})[f"ds-{k:03d}"] = int(size_gb * 1e9)
    return {
        "links": {
            "default": {"bandwidth_mbps": 100, "rtt_ms": 100},
            "same_region": {"bandwidth_mbps": 10000, "rtt_ms": 1},
            "measured": {
                "throughput": os.path.relpath(data / THROUGHPUT_CSV, out_dir),
                "rtt": os.path.relpath(data / RTT_CSV, out_dir),
                "edge_scale": knobs.edge_scale,
            },
        },
        "sites": sites,
    }


def _model_speed(table: Mapping[str, float], model: str) -> float:
    """The speed table's figure, or its fallback from fp16 TFLOPS (as placement computes)."""
    if model in table:
        return table[model]
    known = KNOWN_MODELS.get(model)
    return known.tflops_fp16 / REFERENCE_TFLOPS_FP16 if known else 1.0


def _fleet_speed(topology: Mapping[str, Any]) -> tuple[float, float, dict[str, int]]:
    """Devices in the fleet, their mean training speed, and devices per model."""
    table = speed_table()["training"]
    per_model: Counter[str] = Counter()
    for site in topology["sites"]:
        for node in site["nodes"]:
            for device in node.get("devices", []):
                per_model[device["model"]] += node["count"] * device["count"]
    total = sum(per_model.values())
    if not total:
        return 0.0, 1.0, {}
    speed = sum(_model_speed(table, m) * n for m, n in per_model.items()) / total
    return float(total), speed, dict(per_model)


def generate_trace(
    knobs: Knobs, rng: np.random.Generator, runtimes: np.ndarray, topology: Mapping[str, Any]
) -> list[TraceTask]:
    """Jobs of one task each, in submit order."""
    datasets = [name for site in topology["sites"] for name in site.get("datasets", {})]
    popularity = 1.0 / np.arange(1, len(datasets) + 1)  # a few datasets are read most
    devices, mean_speed, _ = _fleet_speed(topology)
    counts, count_p = zip(*GPU_COUNTS.items(), strict=True)
    choices, choice_p = zip(*MODEL_CHOICES, strict=True)
    cap = knobs.max_runtime_h * 3600.0
    drafts: list[dict[str, Any]] = []
    for n in range(knobs.jobs):
        measured = min(max(float(rng.choice(runtimes)), 1.0), cap)
        job: dict[str, Any] = {
            "job_id": f"job-{n:06d}",
            "duration_s": round(measured * knobs.reference_speed, 3),
            "priority": 100 if rng.random() < knobs.priority_share else 0,
        }
        if rng.random() < knobs.cpu_share:
            job.update(cpu=float(rng.choice([4, 8, 16])), memory_mib=16384.0)
        else:
            count = int(rng.choice(counts, p=np.array(count_p) / sum(count_p)))
            if count == 1 and rng.random() < knobs.fraction_share:
                job.update(
                    accelerator_fraction=float(rng.choice([0.25, 0.5])),
                    workload_class="inference",
                    cpu=2.0,
                    memory_mib=8192.0,
                )
            else:
                models = str(rng.choice(choices, p=np.array(choice_p) / sum(choice_p)))
                replicas = 2 if count == 8 and rng.random() < knobs.gang_share else 1
                job.update(
                    accelerator_count=count,
                    accelerator_models=frozenset(models.split("|")) - {""},
                    replicas=replicas,
                    cpu=4.0 * count,
                    memory_mib=24576.0 * count,
                )
        if datasets and rng.random() < knobs.input_share:
            job["dataset"] = datasets[
                int(rng.choice(len(datasets), p=popularity / popularity.sum()))
            ]
        if rng.random() < knobs.deadline_share:
            job["deadline_s"] = round(measured * float(rng.uniform(2.0, 5.0)), 3)
        drafts.append(job)
    # Arrivals: Poisson, at the rate that offers ``load`` of the fleet's device-seconds.
    work = [
        (j.get("accelerator_count", 0) * j.get("replicas", 1) + j.get("accelerator_fraction", 0.0))
        * j["duration_s"]
        / mean_speed
        for j in drafts
    ]
    rate = knobs.load * devices / max(float(np.mean(work)), 1e-9) if devices else 1.0 / 60
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(drafts))) if drafts else np.zeros(0)
    return [
        TraceTask(line=n + 2, task="main", submit_s=round(float(t), 3), **job)
        for n, (job, t) in enumerate(zip(drafts, arrivals, strict=True))
    ]


def generate(
    knobs: Knobs, seed: int, data: Path, out_dir: Path
) -> tuple[dict[str, Any], list[TraceTask]]:
    """A topology document and a trace, the same for the same knobs and seed."""
    rng = np.random.default_rng(seed)
    topology = generate_topology(knobs, rng, data, out_dir)
    return topology, generate_trace(knobs, rng, load_runtimes(data), topology)


def write_topology(path: Path, topology: Mapping[str, Any]) -> None:
    """Write a topology document as YAML."""
    path.write_text(yaml.safe_dump(dict(topology), sort_keys=False, width=100))


def describe(topology: Mapping[str, Any]) -> str:
    """One line about a generated fleet."""
    devices, speed, per_model = _fleet_speed(topology)
    nodes = sum(n["count"] for s in topology["sites"] for n in s["nodes"])
    by_domain = Counter(s["domain"] for s in topology["sites"])
    models = ", ".join(f"{m} {c}" for m, c in sorted(per_model.items()))
    domains = ", ".join(f"{d} {c}" for d, c in sorted(by_domain.items()))
    return (
        f"{len(topology['sites'])} sites ({domains}), {nodes} nodes, {int(devices)} devices "
        f"({models}; mean training speed {speed:.2f})"
    )
