"""The vendor plugins host discovery runs, and what every device they find gets.

NVIDIA is not among them: NVML is a library, read in-process (``nvidia.py``).
"""

from __future__ import annotations

from collections.abc import Mapping

from federation.agent.discovery import amd, ascend, cambricon, intel, xilinx
from federation.agent.discovery.models import canonical_model
from federation.agent.discovery.plugin import DEFAULT_TIMEOUT_S, Scan, VendorPlugin, scan_vendor
from federation.api.v1 import resources_pb2
from federation.placement.selector_cost import MAX_ATTRIBUTE_CHARS

PLUGINS: tuple[VendorPlugin, ...] = (
    amd.PLUGIN,
    ascend.PLUGIN,
    cambricon.PLUGIN,
    intel.PLUGIN,
    xilinx.PLUGIN,
)
"""Every vendor discovery runs, each a module of this package with its tool and parser."""


def _finish(
    device: resources_pb2.Device, vendor: str, model_names: Mapping[str, str] | None
) -> None:
    """Gives a parsed device its vendor, canonical model and provenance.

    The tool's own name stays as the ``product_name`` attribute. Texts are cut to what the
    coordinator accepts, so one odd report cannot get the whole site view refused.
    """
    device.vendor = vendor
    device.attributes["product_name"] = device.model
    device.model = canonical_model(device.model, model_names)
    device.id = device.id or f"{vendor}{device.index}"
    device.provenance = resources_pb2.PROVENANCE_DISCOVERED
    device.model = device.model[:MAX_ATTRIBUTE_CHARS]
    for key, value in device.attributes.items():
        device.attributes[key] = value[:MAX_ATTRIBUTE_CHARS]


def scan_vendors(
    model_names: Mapping[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    plugins: tuple[VendorPlugin, ...] = PLUGINS,
) -> Scan:
    """Every installed vendor tool's devices, and what went wrong with the others.

    Args:
        model_names: The site's extra canonical names (see ``models.canonical_model``).
        timeout_s: How long each tool may take.
        plugins: The plugins to run.
    """
    devices: list[resources_pb2.Device] = []
    problems: list[str] = []
    for plugin in plugins:
        scan = scan_vendor(plugin, timeout_s)
        for device in scan.devices:
            _finish(device, plugin.vendor, model_names)
        devices.extend(scan.devices)
        problems.extend(scan.problems)
    return Scan(tuple(devices), tuple(problems))
