"""Xilinx (AMD) Alveo FPGA cards from ``xbutil examine``'s host report in JSON.

xbutil writes JSON only to a file (``--output``), never to its standard output.
"""

from __future__ import annotations

import json

from federation.agent.discovery.plugin import OUTPUT_FILE, Tool, VendorPlugin, lookup
from federation.api.v1 import resources_pb2


def parse_xbutil_examine(text: str) -> list[resources_pb2.Device]:
    """Cards in ``xbutil examine --format JSON``: the host report's ``system.host.devices``.

    The card's board is the second word of its shell name (``xilinx_u250_gen3x16_xdma_shell_4_1``
    → ``U250``), kept whole as the ``shell`` attribute. Ryzen AI NPUs, which XRT also lists, are
    left out. A card that is not ready (XRT tools reduce what they do with it) is degraded.

    Raises:
        ValueError: The report is not JSON or lists no devices.
    """
    doc = json.loads(text)
    cards = lookup(doc, "system", "host", "devices")
    if cards == "":  # boost's JSON writer prints an empty list as ""
        return []
    if not isinstance(cards, list):
        raise ValueError("no system.host.devices in xbutil's report")
    devices: list[resources_pb2.Device] = []
    for card in cards:
        if not isinstance(card, dict):
            raise ValueError("a device in xbutil's report is not a JSON object")
        if str(card.get("device_class", "Alveo")).lower() != "alveo":
            continue
        shell, bdf = str(card.get("vbnv", "")), str(card.get("bdf", ""))
        parts = shell.split("_")
        if len(parts) < 2 or not bdf:
            raise ValueError(f"device {bdf or '?'} has no shell name in xbutil's report")
        device = resources_pb2.Device(
            id=bdf,
            index=len(devices),
            kind=resources_pb2.DEVICE_KIND_FPGA,
            model=parts[1].upper(),
            health=resources_pb2.DEVICE_HEALTH_HEALTHY,
            attributes={"shell": shell, "bdf": bdf},
        )
        if str(card.get("is_ready", "true")).lower() != "true":
            device.health = resources_pb2.DEVICE_HEALTH_DEGRADED
            device.health_reason = "xbutil reports the card not ready"
        devices.append(device)
    return devices


PLUGIN = VendorPlugin(
    vendor="xilinx",
    tools=(
        Tool(
            ("xbutil", "examine", "--format", "JSON", "--output", OUTPUT_FILE),
            parse_xbutil_examine,
        ),
    ),
)
