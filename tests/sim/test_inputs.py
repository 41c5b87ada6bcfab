"""Topology and trace files: what they mean, and errors that name the file, line and field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from federation.api.v1 import resources_pb2
from federation.sim.fields import InputFileError
from federation.sim.links import load_rtt_csv, load_throughput_csv
from federation.sim.replay import replay
from federation.sim.topology import load_topology
from federation.sim.trace import TraceTask, load_trace, write_trace

from .conftest import REGIONS, write

SITES = """
sites:
  - name: a
    nodes: [{cpu: 8, memory_mib: 8192, devices: [{model: V100, count: 2}]}]
  - name: b
    domain: edge
    nodes: [{cpu: 8, memory_mib: 8192}]
"""


@pytest.mark.parametrize(
    ("text", "where", "problem"),
    [
        ("sites: [{name: a, nodes: [{cpu: x, memory_mib: 1}]}]", "sites[0].nodes[0].cpu", "number"),
        ("sites: [{name: a, domain: moon, nodes: [{cpu: 1, memory_mib: 1}]}]", "domain", "moon"),
        (
            "sites: [{name: a, nodes: [{cpu: 1, memory_mib: 1, devices: [{model: Z9}]}]}]",
            "sites[0].nodes[0].devices[0].model",
            "not a known model",
        ),
        ("sites: [{name: a, nodes: [{cpu: 1, memory_mib: 1, gpus: 2}]}]", "nodes[0]", "gpus"),
        ("sites: [{name: a}]", "sites[0].nodes", "required"),
        (SITES + "links: {declared: [{from: a, to: z, bandwidth_mbps: 1, rtt_ms: 1}]}", "to", "z"),
        (SITES + "links: {measured: {throughput: nowhere.csv}}", "throughput", "no such file"),
    ],
)
def test_topology_errors_name_the_file_and_field(
    tmp_path: Path, text: str, where: str, problem: str
) -> None:
    """A bad topology is refused with its path, the field's path and what is wrong."""
    path = write(tmp_path, "topo.yaml", text)
    with pytest.raises(InputFileError) as err:
        load_topology(path)
    assert str(path) in str(err.value)
    assert where in str(err.value)
    assert problem in str(err.value)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("submit_s,duration_s\n0,10\n5,ten\n", ":3: column 'duration_s'"),
        ("submit_s,duration_s,accelerator_count\n0,10,1.5\n", ":2: column 'accelerator_count'"),
        (
            "submit_s,duration_s,accelerator_fraction\n0,10,1.5\n",
            ":2: column 'accelerator_fraction'",
        ),
        ("submit_s,duration_s,accelerator_kind\n0,10,QPU\n", ":2: column 'accelerator_kind'"),
        ("submit_s,duration_s,domains\n0,10,edge|moon\n", ":2: column 'domains'"),
        ("submit_s\n0\n", ":1: missing column(s) duration_s"),
        ("submit_s,duration_s,gpus\n0,10,1\n", ":1: unknown column(s) gpus"),
        ("job_id,submit_s,duration_s\nj,0,1\nj,0,2\n", ":3: task 'main' of job 'j' repeats line 2"),
        ("submit_s,duration_s\n", ": no rows"),
    ],
)
def test_trace_errors_name_the_file_line_and_column(tmp_path: Path, text: str, where: str) -> None:
    """A bad trace is refused with its path, the line and the column."""
    path = write(tmp_path, "trace.csv", text)
    with pytest.raises(InputFileError) as err:
        load_trace(path)
    assert f"{path}{where}" in str(err.value)


def test_unknown_datasets_are_refused_against_the_topology(tmp_path: Path) -> None:
    """A task reading data no site holds is refused, naming its line."""
    topology = load_topology(write(tmp_path, "t.yaml", SITES))
    path = write(tmp_path, "trace.csv", "submit_s,duration_s,dataset\n0,1,\n0,1,imagenet\n")
    with pytest.raises(InputFileError, match=r"trace\.csv:3: column 'dataset'"):
        replay(topology, load_trace(path), ["completion-time"], trace_source=str(path))


def test_optional_columns_take_their_defaults_and_round_trip(tmp_path: Path) -> None:
    """Missing columns mean the documented defaults; writing and reading gives the same tasks."""
    path = write(tmp_path, "trace.csv", "submit_s,duration_s\n5,60\n1,30\n")
    tasks = load_trace(path)
    assert [t.submit_s for t in tasks] == [1.0, 5.0]  # submit order
    first = tasks[0]
    assert (first.job_id, first.task, first.replicas, first.cpu, first.memory_mib) == (
        "job-2",
        "main",
        1,
        1.0,
        1024.0,
    )
    assert not first.request(0).wants_accelerator
    full = TraceTask(
        line=2,
        job_id="j",
        task="t",
        submit_s=1.5,
        duration_s=10.0,
        replicas=2,
        accelerator_count=4,
        accelerator_models=frozenset({"V100", "T4"}),
        priority=-3,
        dataset="d",
        input_bytes=7,
        dataset_site="a",
        deadline_s=99.0,
        workload_class="inference",
        domains=frozenset({resources_pb2.DOMAIN_EDGE, resources_pb2.DOMAIN_CLOUD}),
        max_cost_usd=2.5,
    )
    write_trace(tmp_path / "out.csv", [full])
    assert load_trace(tmp_path / "out.csv") == [full]


def test_measured_link_tables_are_read_in_both_shapes(tmp_path: Path, data_dir: Path) -> None:
    """Throughput runs give medians in Mbit/s; RTT comes from pair rows or from a matrix."""
    runs = load_throughput_csv(data_dir / "network/skyplane_throughput_2022-01.csv")
    assert runs[REGIONS[0], REGIONS[1]] == pytest.approx(3000.0)  # 3e9 bit/s
    pairs = load_rtt_csv(data_dir / "network/skyplane_rtt_2022-04.csv")
    assert pairs[REGIONS[2], REGIONS[1]] == pytest.approx(30.0)
    matrix = write(tmp_path, "m.csv", "Source,East,West\nEast,,70\nWest,71,\n")
    assert load_rtt_csv(matrix) == {("East", "West"): 70.0, ("West", "East"): 71.0}


def test_links_declared_then_measured_then_same_region_then_default(
    tmp_path: Path, data_dir: Path
) -> None:
    """Each pair takes the first source that covers it; edge sites scale measured bandwidth."""
    net = data_dir / "network"
    text = f"""
links:
  default: {{bandwidth_mbps: 50, rtt_ms: 80}}
  same_region: {{bandwidth_mbps: 9000, rtt_ms: 1}}
  measured: {{throughput: {net}/skyplane_throughput_2022-01.csv,
              rtt: {net}/skyplane_rtt_2022-04.csv, edge_scale: 0.5}}
  declared: [{{from: a, to: d, bandwidth_mbps: 7, rtt_ms: 3, both_ways: false}}]
sites:
  - {{name: a, region: "{REGIONS[0]}", nodes: [{{cpu: 1, memory_mib: 1}}]}}
  - {{name: b, region: "{REGIONS[1]}", nodes: [{{cpu: 1, memory_mib: 1}}]}}
  - {{name: c, region: "{REGIONS[1]}", domain: edge, nodes: [{{cpu: 1, memory_mib: 1}}]}}
  - {{name: d, region: nowhere, nodes: [{{cpu: 1, memory_mib: 1}}]}}
"""
    topo = load_topology(write(tmp_path, "t.yaml", text))
    bw, rtt = topo.bandwidth_mbps, topo.rtt_ms
    a, b, c, d = range(4)
    assert (bw[a, d], rtt[a, d]) == (7.0, 3.0)  # declared, one way only
    assert (bw[d, a], rtt[d, a]) == (50.0, 80.0)  # default
    assert not topo.link_known[d, a]
    assert (bw[a, b], rtt[a, b]) == (3000.0, 10.0)  # measured
    assert bw[a, c] == pytest.approx(1500.0)  # measured, edge scaled
    assert (bw[b, c], rtt[b, c]) == (9000.0, 1.0)  # same region
    assert np.isinf(bw[a, a])
    assert rtt[a, a] == 0.0


def test_device_models_fill_in_known_figures(tmp_path: Path) -> None:
    """A known model needs only its name; a site's device_power_watts overrides the default."""
    text = """
sites:
  - name: a
    device_power_watts: 250
    nodes: [{count: 3, cpu: 8, memory_mib: 8192, devices: [{model: H100-80GB, count: 4}]}]
"""
    topo = load_topology(write(tmp_path, "t.yaml", text))
    device = topo.sites[0].nodes[0].devices[0]
    assert dataclasses.astuple(device)[1:] == ("nvidia", "H100-80GB", 81920, 989.0, 250.0, 4, False)
    assert (topo.n_nodes, topo.n_devices) == (3, 12)
