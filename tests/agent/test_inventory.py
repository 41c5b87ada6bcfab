"""Loading declared nodes from YAML and TOML inventories, and rejecting bad ones precisely."""

from __future__ import annotations

from pathlib import Path

import pytest

from federation.agent.discovery.vendors import PLUGINS
from federation.agent.inventory import VENDORS, InventoryError, check_node_names, load_inventory
from federation.api.v1 import resources_pb2

EXAMPLE = """\
nodes:
  - name: edge-box-1
    arch: aarch64
    cpu_cores: 8
    memory_mib: 16384
    labels: {cann: "8.0.0", driver: "23.0.3"}
    devices:
      - kind: NPU
        vendor: huawei
        model: Ascend-310P
        memory_mib: 24576
        count: 2
        tflops_fp16: 22
        power_tdp_watts: 72
        interconnect_group: hccs-0
        attributes: {cann: "8.0.0"}
  - name: edge-box-2
    cpu_cores: 4.5
    memory_mib: 8192
    schedulable: false
"""


# A node with one 40 GiB GPU whose partitions list follows.
GPU_WITH = (
    "nodes:\n  - name: a\n    devices:\n      - kind: GPU\n        memory_mib: 40960\n"
    "        partitions: "
)


def write(tmp_path: Path, text: str, name: str = "inventory.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_example_inventory_expands_device_counts(tmp_path: Path) -> None:
    """A device entry with count 2 becomes two declared, healthy devices with indices 0 and 1."""
    first, second = load_inventory(write(tmp_path, EXAMPLE))
    assert first.name == "edge-box-1"
    assert first.arch == "aarch64"
    assert (first.cpu_cores, first.cpu_free) == (8, 8)
    assert (first.memory_mib, first.memory_free_mib) == (16384, 16384)
    assert dict(first.labels) == {"cann": "8.0.0", "driver": "23.0.3"}
    assert first.schedulable
    assert first.provenance == resources_pb2.PROVENANCE_DECLARED
    assert [d.index for d in first.devices] == [0, 1]
    assert [d.id for d in first.devices] == ["edge-box-1-npu0", "edge-box-1-npu1"]
    for device in first.devices:
        assert device.kind == resources_pb2.DEVICE_KIND_NPU
        assert device.vendor == "huawei"
        assert device.model == "Ascend-310P"
        assert device.memory_total_mib == device.memory_free_mib == 24576
        assert device.tflops_fp16 == 22
        assert device.power_tdp_watts == 72
        assert device.interconnect_group == "hccs-0"
        assert dict(device.attributes) == {"cann": "8.0.0"}
        assert device.health == resources_pb2.DEVICE_HEALTH_HEALTHY
        assert device.provenance == resources_pb2.PROVENANCE_DECLARED
        assert not device.allocated
    assert second.cpu_cores == 4.5
    assert not second.schedulable
    assert not second.devices


def test_indices_continue_across_entries_of_one_kind(tmp_path: Path) -> None:
    """Two GPU entries on a node number their devices 0..n-1, case-insensitive kinds."""
    text = """\
nodes:
  - name: mixed
    devices:
      - {kind: gpu, vendor: NVIDIA, model: A100, count: 2}
      - {kind: GPU, vendor: nvidia, model: H100}
      - {kind: Fpga, vendor: xilinx, model: U250}
"""
    (node,) = load_inventory(write(tmp_path, text))
    assert [(d.model, d.index, d.id) for d in node.devices] == [
        ("A100", 0, "mixed-gpu0"),
        ("A100", 1, "mixed-gpu1"),
        ("H100", 2, "mixed-gpu2"),
        ("U250", 0, "mixed-fpga0"),
    ]
    assert node.devices[0].vendor == "nvidia"
    assert node.devices[3].kind == resources_pb2.DEVICE_KIND_FPGA


def test_toml_inventory(tmp_path: Path) -> None:
    """A .toml inventory is read as TOML with the same schema."""
    text = """\
[[nodes]]
name = "edge-box-1"
cpu_cores = 8
memory_mib = 16384
labels = { cann = "8.0.0" }

[[nodes.devices]]
kind = "MLU"
vendor = "cambricon"
model = "MLU370"
count = 3
"""
    (node,) = load_inventory(write(tmp_path, text, "inventory.toml"))
    assert node.labels["cann"] == "8.0.0"
    assert [d.kind for d in node.devices] == [resources_pb2.DEVICE_KIND_MLU] * 3
    assert [d.index for d in node.devices] == [0, 1, 2]


def test_shareable_devices_and_partition_profiles(tmp_path: Path) -> None:
    """shareable and partitions carry over to every device of the entry, all of it free."""
    text = """\
nodes:
  - name: dc-gpu-1
    devices:
      - kind: GPU
        vendor: nvidia
        model: A100-80GB
        memory_mib: 81920
        count: 2
        shareable: true
        partitions:
          - {profile: 1g.10gb, count: 7, memory_mib: 9856}
          - {profile: 3g.40gb, count: 2}
      - {kind: GPU, vendor: nvidia, model: L4}
"""
    (node,) = load_inventory(write(tmp_path, text))
    first, second, plain = node.devices
    for device in (first, second):
        assert device.shareable
        assert device.free_fraction == 1.0
        assert list(device.partitions) == [
            resources_pb2.PartitionProfile(profile="1g.10gb", total=7, free=7, memory_mib=9856),
            resources_pb2.PartitionProfile(profile="3g.40gb", total=2, free=2),
        ]
    assert not plain.shareable
    assert not plain.partitions


def test_empty_inventory_declares_nothing(tmp_path: Path) -> None:
    """An empty file, or an empty node list, declares no nodes."""
    assert load_inventory(write(tmp_path, "")) == []
    assert load_inventory(write(tmp_path, "nodes: []\n")) == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "nodes:\n  - name: a\n  - name: b\n    devices:\n      - kind: TPU\n",
            "nodes[1].devices[0].kind: unknown kind 'TPU' "
            "(expected one of GPU, NPU, MLU, FPGA, DPU)",
        ),
        (
            "nodes:\n  - name: a\n    devices:\n      - vendor: nvidia\n",
            "nodes[0].devices[0].kind: is required",
        ),
        (
            "nodes:\n  - name: a\n    devices:\n      - {kind: GPU, colour: red}\n",
            "nodes[0].devices[0].colour: unknown key (expected one of attributes, count, ",
        ),
        (
            "nodes:\n  - name: a\n    gpus: 2\n",
            "nodes[0].gpus: unknown key (expected one of arch, cpu_cores, devices, ",
        ),
        ("sites: []\n", "sites: unknown key (expected one of node_types, nodes)"),
        ("nodes:\n  - arch: x86_64\n", "nodes[0].name: is required"),
        ("nodes:\n  - name: ''\n", "nodes[0].name: must not be empty"),
        (
            "nodes:\n  - name: a\n  - name: b\n  - name: a\n",
            "nodes[2].name: duplicate node name 'a' (also nodes[0])",
        ),
        (
            "nodes:\n  - name: a\n    cpu_cores: -2\n",
            "nodes[0].cpu_cores: must be non-negative, got -2",
        ),
        (
            "nodes:\n  - name: a\n    memory_mib: lots\n",
            "nodes[0].memory_mib: expected a non-negative integer, got 'lots'",
        ),
        (
            "nodes:\n  - name: a\n    memory_mib: 1.5\n",
            "nodes[0].memory_mib: expected a non-negative integer, got 1.5",
        ),
        (
            "nodes:\n  - name: a\n    cpu_cores: true\n",
            "nodes[0].cpu_cores: expected a non-negative number, got True",
        ),
        (
            "nodes:\n  - name: a\n    devices:\n      - {kind: NPU, count: -1}\n",
            "nodes[0].devices[0].count: must be non-negative, got -1",
        ),
        (
            "nodes:\n  - name: a\n    devices:\n      - {kind: NPU, tflops_fp16: fast}\n",
            "nodes[0].devices[0].tflops_fp16: expected a non-negative number, got 'fast'",
        ),
        ("nodes:\n  - name: a\n    labels: [x]\n", "nodes[0].labels: expected a mapping, got list"),
        (
            "nodes:\n  - name: a\n    labels: {cuda: [12]}\n",
            "nodes[0].labels.cuda: expected a string, got list",
        ),
        (
            "nodes:\n  - name: a\n    schedulable: maybe\n",
            "nodes[0].schedulable: expected true or false, got 'maybe'",
        ),
        (
            "nodes:\n  - name: a\n    devices:\n      - {kind: GPU, shareable: yes-please}\n",
            "nodes[0].devices[0].shareable: expected true or false, got 'yes-please'",
        ),
        (
            "nodes:\n  - name: a\n    devices:\n      - {kind: GPU, partitions: {1g.10gb: 7}}\n",
            "nodes[0].devices[0].partitions: expected a list, got dict",
        ),
        (
            f"{GPU_WITH}[{{profile: 1g.10gb, count: 7, slices: 1}}]\n",
            "nodes[0].devices[0].partitions[0].slices: unknown key "
            "(expected one of count, instances, memory_mib, profile)",
        ),
        (
            f"{GPU_WITH}[{{profile: 1g.10gb, count: 1, instances: [MIG-a, MIG-b]}}]\n",
            "nodes[0].devices[0].partitions[0].instances: at most count (1) instances, got 2",
        ),
        (
            f"{GPU_WITH}[{{profile: 1g.10gb, count: 2, instances: [MIG-a, MIG-a]}}]\n",
            "nodes[0].devices[0].partitions[0].instances: must be distinct, non-empty names",
        ),
        (
            "nodes:\n  - name: a\n    devices:\n      - kind: GPU\n        count: 2\n"
            "        partitions: [{profile: 1g.10gb, count: 2, instances: [MIG-a]}]\n",
            "nodes[0].devices[0].partitions[0].instances: names one device's instances: "
            "give that device count 1",
        ),
        (f"{GPU_WITH}[{{count: 7}}]\n", "nodes[0].devices[0].partitions[0].profile: is required"),
        (
            f"{GPU_WITH}[{{profile: 1g.10gb}}]\n",
            "nodes[0].devices[0].partitions[0].count: is required",
        ),
        (
            f"{GPU_WITH}[{{profile: '', count: 7}}]\n",
            "nodes[0].devices[0].partitions[0].profile: must not be empty",
        ),
        (
            f"{GPU_WITH}[{{profile: 1g.10gb, count: 0}}]\n",
            "nodes[0].devices[0].partitions[0].count: must be positive, got 0",
        ),
        (
            f"{GPU_WITH}[{{profile: 1g.10gb, count: 2.5}}]\n",
            "nodes[0].devices[0].partitions[0].count: expected a non-negative integer, got 2.5",
        ),
        (
            f"{GPU_WITH}[{{profile: 1g.10gb, count: 7}}, {{profile: 1g.10gb, count: 4}}]\n",
            "nodes[0].devices[0].partitions[1].profile: duplicate profile '1g.10gb' "
            "(also nodes[0].devices[0].partitions[0])",
        ),
        (
            f"{GPU_WITH}[{{profile: 7g.80gb, count: 1, memory_mib: 81920}}]\n",
            "nodes[0].devices[0].partitions[0].memory_mib: 81920 exceeds the device's "
            "memory_mib 40960",
        ),
        (
            f"{GPU_WITH}[3g.40gb]\n",
            "nodes[0].devices[0].partitions[0]: expected a mapping, got str",
        ),
        (
            "nodes:\n  - name: a\n    devices:\n      - {kind: GPU, vendor: nvida}\n",
            "nodes[0].devices[0].vendor: unknown vendor 'nvida' "
            "(expected one of amd, cambricon, huawei, intel, nvidia, xilinx)",
        ),
        (
            "nodes:\n  - name: a\n    devices:\n      - {kind: GPU, memory_mib: -81920}\n",
            "nodes[0].devices[0].memory_mib: must be non-negative, got -81920",
        ),
        (
            "nodes:\n  - name: a\n    devices:\n      - {kind: GPU, memory_mib: 80.5}\n",
            "nodes[0].devices[0].memory_mib: expected a non-negative integer, got 80.5",
        ),
        (
            "nodes:\n  - name: a\n    devices:\n      - {kind: GPU, memory_mib: 80GiB}\n",
            "nodes[0].devices[0].memory_mib: expected a non-negative integer, got '80GiB'",
        ),
        (
            "nodes:\n  - name: a\n    devices:\n      - {kind: GPU, memory_mib: 1e30}\n",
            "nodes[0].devices[0].memory_mib: expected a non-negative integer, got '1e30'",
        ),
        (
            "nodes:\n  - name: a\n    devices:\n"
            "      - {kind: GPU, memory_mib: 100000000000000000000}\n",
            "nodes[0].devices[0].memory_mib: must be at most 1073741824, got 100000000000000000000",
        ),
        (
            "nodes:\n  - name: a\n    memory_mib: 100000000000000000000\n",
            "nodes[0].memory_mib: must be at most 1099511627776, got 100000000000000000000",
        ),
        (
            "nodes:\n  - name: a\n    cpu_cores: .nan\n",
            "nodes[0].cpu_cores: expected a finite number, got nan",
        ),
        (
            "nodes:\n  - name: a\n    devices:\n      - {kind: GPU, tflops_fp16: .inf}\n",
            "nodes[0].devices[0].tflops_fp16: expected a finite number, got inf",
        ),
        (
            "nodes:\n  - name: a\n    devices:\n"
            "      - {kind: GPU, count: 1000}\n      - {kind: NPU, count: 100}\n",
            "nodes[0].devices[1].count: the node would have 1100 devices, more than the 1024 ",
        ),
        (
            f"{GPU_WITH}[{{profile: 1g.10gb, count: 10000000000}}]\n",
            "nodes[0].devices[0].partitions[0].count: must be at most 4294967295, got 10000000000",
        ),
        ("nodes: {a: 1}\n", "nodes: expected a list, got dict"),
        ("nodes:\n  - just-a-name\n", "nodes[0]: expected a mapping, got str"),
        ("nodes: [\n", "cannot parse: "),
    ],
)
def test_errors_name_file_and_field(tmp_path: Path, text: str, message: str) -> None:
    """Each malformed inventory raises InventoryError naming the file and the field path."""
    path = write(tmp_path, text)
    with pytest.raises(InventoryError) as caught:
        load_inventory(path)
    assert str(caught.value).startswith(f"{path}: {message}")


def test_missing_file_is_an_inventory_error(tmp_path: Path) -> None:
    """A file that cannot be read is an InventoryError too, naming the file."""
    path = tmp_path / "absent.yaml"
    with pytest.raises(InventoryError, match=r"absent\.yaml: cannot read: No such file"):
        load_inventory(path)


def test_known_vendors_are_those_discovery_knows() -> None:
    """The vendors an inventory may name are NVIDIA (NVML) and every discovery plugin's."""
    assert set(VENDORS) == {"nvidia", *(plugin.vendor for plugin in PLUGINS)}


def _node(name: str, provenance: resources_pb2.Provenance.ValueType) -> resources_pb2.Node:
    return resources_pb2.Node(name=name, provenance=provenance)


def test_inventory_node_named_as_the_host_is_refused(tmp_path: Path) -> None:
    """An inventory node with the discovered host's name is an error naming that node."""
    path = tmp_path / "inventory.yaml"
    nodes = [
        _node("gpu-box", resources_pb2.PROVENANCE_DISCOVERED),
        _node("edge-1", resources_pb2.PROVENANCE_DECLARED),
        _node("gpu-box", resources_pb2.PROVENANCE_DECLARED),
    ]
    with pytest.raises(InventoryError) as caught:
        check_node_names(nodes, path)
    assert str(caught.value) == (
        f"{path}: nodes[1].name: node name 'gpu-box' is the discovered host's: rename the "
        "node, or set host_node_name in the agent's config"
    )


def test_distinct_node_names_pass(tmp_path: Path) -> None:
    """Distinct names, with or without a discovered host, pass; so does no node at all."""
    declared = load_inventory(write(tmp_path, EXAMPLE))
    check_node_names([_node("host", resources_pb2.PROVENANCE_DISCOVERED), *declared], tmp_path)
    check_node_names(declared, tmp_path)
    check_node_names([], tmp_path)


def test_repeated_declared_names_are_refused(tmp_path: Path) -> None:
    """Two declared nodes of one name (nodes built by hand): the later one is named."""
    nodes = [_node(n, resources_pb2.PROVENANCE_DECLARED) for n in ("a", "b", "a")]
    with pytest.raises(InventoryError, match=r"nodes\[2\]\.name: duplicate node name 'a' "):
        check_node_names(nodes, tmp_path / "inv.yaml")
