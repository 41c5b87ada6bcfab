"""Canonical model names: vendor tools' names become the names placement's tables use."""

from __future__ import annotations

from importlib import resources

import pytest
import yaml

from federation.agent.discovery import canonical_model
from federation.agent.discovery.models import shipped_model_names


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("A100-SXM4-40GB", "A100-40GB"),  # drivers before R470 print no "NVIDIA "
        ("NVIDIA A100 80GB PCIe", "A100-80GB"),
        ("Tesla V100-SXM2-32GB", "V100-32GB"),
        ("Tesla V100-PCIE-16GB", "V100"),
        ("NVIDIA GeForce RTX 4090", "RTX-4090"),
        ("Tesla T4", "T4"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA H200", "H200-141GB"),
        ("AMD Instinct MI300X", "MI300X"),
        ("Ascend 910B3", "Ascend-910B"),
        ("Ascend 310P3", "Ascend-310P"),
        ("MLU370-X8", "MLU370-X8"),
    ],
)
def test_tool_names_map_to_table_names(raw: str, canonical: str) -> None:
    """Each tool's spelling of a model maps to the tables' name for it."""
    assert canonical_model(raw) == canonical


def test_names_match_ignoring_case_and_spacing() -> None:
    """Case and repeated spaces do not matter."""
    assert canonical_model("nvidia  h100 80gb   HBM3") == "H100-80GB"


def test_unknown_names_lose_their_prefix_and_spaces() -> None:
    """A name the table lacks keeps its words, without the vendor prefix, joined by dashes."""
    assert canonical_model("NVIDIA B200") == "B200"
    assert canonical_model("Intel(R) Data Center GPU Max 1550") == "Max-1550"
    assert canonical_model("Ascend 910C") == "Ascend-910C"
    assert canonical_model("NVIDIA") == "NVIDIA"  # nothing but a prefix stays as it is


def test_site_entries_add_and_override() -> None:
    """The site's own entries win over the shipped ones and add new names."""
    site = {"NVIDIA H100 80GB HBM3": "H100-SXM", "nvidia b200": "B200-180GB"}
    assert canonical_model("NVIDIA H100 80GB HBM3", site) == "H100-SXM"
    assert canonical_model("NVIDIA B200", site) == "B200-180GB"
    assert canonical_model("Tesla T4", site) == "T4"


def test_canonical_names_map_to_themselves() -> None:
    """A canonical name read back (say, from an inventory) stays what it is."""
    for name in set(shipped_model_names().names.values()):
        assert canonical_model(name) == name


def test_table_covers_the_speed_table_models_nvml_names() -> None:
    """Every NVIDIA model of the speed table is the target of some shipped NVML name."""
    data = resources.files("federation.placement").joinpath("data/speed.yaml").read_text()
    speed = yaml.safe_load(data)
    targets = set(shipped_model_names().names.values())
    nvidia = {"H100-80GB", "H200-141GB", "A100-80GB", "A100-40GB", "V100-32GB", "V100", "T4"}
    assert nvidia <= set(speed["training"]) & targets
