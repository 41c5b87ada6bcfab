"""Fixtures for the simulator tests: small input files in the shapes of the shared data."""

from __future__ import annotations

from pathlib import Path

import pytest

from federation.sim.fields import InputFileError
from federation.sim.replay import ReplayResult, replay
from federation.sim.topology import load_topology
from federation.sim.trace import load_trace

REGIONS = ("aws:us-east-1", "aws:eu-west-1", "gcp:us-central1-a")


def write(folder: Path, name: str, text: str) -> Path:
    """Write ``text`` (dedented by the caller) to ``folder/name`` and return the path."""
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def replay_texts(
    folder: Path, topology: str, trace: str, policies: list[str], seed: int = 0
) -> ReplayResult:
    """Replays ``trace`` (CSV text) over ``topology`` (YAML text), written to ``folder``."""
    return replay(
        load_topology(write(folder, "t.yaml", topology)),
        load_trace(write(folder, "trace.csv", trace)),
        policies,
        seed=seed,
    )


def refusal(folder: Path, topology: str, old: str, new: str) -> str:
    """Why ``topology`` (YAML text) with ``old`` put as ``new`` is refused."""
    assert old in topology
    with pytest.raises(InputFileError) as refused:
        load_topology(write(folder, "t.yaml", topology.replace(old, new, 1)))
    return str(refused.value)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    """A folder laid out like ../shared/data, with a few made-up rows in each file's shape."""
    root = tmp_path / "data"
    fleet = ["machine,gpu_type,cap_cpu,cap_mem,cap_gpu"]
    shapes = [
        ("V100", 96, 512, 8),
        ("V100M32", 96, 384, 8),
        ("P100", 64, 512, 2),
        ("T4", 96, 512, 2),
        ("MISC", 96, 512, 8),
        ("CPU", 96, 512, 0),
    ]
    for i in range(24):
        gpu_type, cpu, mem, gpus = shapes[i % len(shapes)]
        fleet.append(f"m{i:03d},{gpu_type},{cpu},{mem},{gpus}")
    write(root, "fleets/pai_machine_spec.csv", "\n".join(fleet) + "\n")
    runtimes = ["runtime", *(str(v) for v in (0.0, 12, 60, 300, 900, 1800, 3600, 7200, 20000))]
    write(root, "runtimes/philly_runtime.csv", "\n".join(runtimes) + "\n")
    throughput = [
        "src_region,src_tier,src_instance_class,dst_region,dst_tier,dst_instance_class,"
        "iperf3_connections,iperf3_runtime_s,throughput_sent_bps,throughput_received_bps,"
        "cpu_utilization_pct"
    ]
    rtt = [
        "src_region,src_tier,src_instance_class,dst_region,dst_tier,dst_instance_class,"
        "min_rtt,avg_rtt,max_rtt,mdev_rtt"
    ]
    for i, a in enumerate(REGIONS):
        for j, b in enumerate(REGIONS):
            if a != b:
                gbps = 2.0 + i + j
                throughput.append(f"{a},PREMIUM,x,{b},PREMIUM,x,64,5,{gbps}e9,{gbps}e9,10")
                rtt.append(f"{a},PREMIUM,x,{b},PREMIUM,x,1,{10 * (i + j)},2,0.1")
    write(root, "network/skyplane_throughput_2022-01.csv", "\n".join(throughput) + "\n")
    write(root, "network/skyplane_rtt_2022-04.csv", "\n".join(rtt) + "\n")
    return root
