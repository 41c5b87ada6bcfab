"""What a site agent knows about its hardware: the host it runs on, and an inventory file.

The host is discovered (psutil, NVML, and one plugin per other vendor, each running that
vendor's tool: see ``vendors.py``); an inventory (``federation.agent.inventory``, re-exported
here) declares nodes this machine lacks, such as edge boxes behind the agent or hardware
simulated on a laptop. Both yield plain ``Node`` protos.
"""

from __future__ import annotations

from federation.agent.discovery.host import device_kind_name, discover_host_node
from federation.agent.discovery.models import canonical_model
from federation.agent.discovery.nvidia import discover_nvidia_gpus
from federation.agent.inventory import (
    KIND_NAMES,
    VENDORS,
    InventoryError,
    check_node_names,
    load_inventory,
)

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
