"""What a site agent knows about its hardware: the host it runs on, and an inventory file.

The host is discovered (psutil, NVML, and one plugin per other vendor, each running that
vendor's tool: see ``vendors.py``); an inventory (``federation.agent.inventory``, re-exported
here) declares nodes this machine lacks, such as edge boxes behind the agent or hardware
simulated on a laptop. Both yield plain ``Node`` protos.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from federation.agent.discovery.host import device_kind_name, discover_host_node
from federation.agent.discovery.models import canonical_model
from federation.agent.inventory import (
    KIND_NAMES,
    VENDORS,
    InventoryError,
    check_node_names,
    load_inventory,
)

if TYPE_CHECKING:
    from federation.agent.discovery.nvidia import discover_nvidia_gpus

__all__ = [
    "KIND_NAMES",
    "VENDORS",
    "InventoryError",
    "canonical_model",
    "check_node_names",
    "device_kind_name",
    "discover_host_node",
    "discover_nvidia_gpus",
    "load_inventory",
]


def __getattr__(name: str) -> object:
    # NVML's bindings load with the first NVIDIA scan, not with the agent.
    if name == "discover_nvidia_gpus":
        from federation.agent.discovery.nvidia import discover_nvidia_gpus

        return discover_nvidia_gpus
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
