"""Intel data center GPUs from ``xpu-smi discovery --dump``: one CSV line per GPU.

``xpu-smi discovery -j`` lists GPUs without their memory, which needs one more call per GPU;
the dump gives every property asked for in one call.
"""

from __future__ import annotations

import csv

from federation.agent.discovery.plugin import Tool, VendorPlugin, number
from federation.api.v1 import resources_pb2

# Property ids of ``xpu-smi discovery --dump`` and the column headers they print.
_PROPERTIES = {
    1: "Device ID",
    2: "Device Name",
    4: "UUID",
    11: "PCI BDF Address",
    16: "Memory Physical Size",
    22: "GFX Firmware Status",
}


def parse_xpu_smi_dump(text: str) -> list[resources_pb2.Device]:
    """GPUs in ``xpu-smi discovery --dump 1,2,4,11,16,22``.

    A GPU that xpu-smi finds on the PCI bus but cannot open has an empty Device ID and the
    status "GPU in bad state"; it becomes an unhealthy device.

    Raises:
        ValueError: The report lacks the header or a line is malformed.
    """
    reader = csv.DictReader(line for line in text.splitlines() if line.strip())
    if missing := set(_PROPERTIES.values()) - set(reader.fieldnames or ()):
        raise ValueError(f"xpu-smi's report lacks the columns {', '.join(sorted(missing))}")
    devices: list[resources_pb2.Device] = []
    for row in reader:
        if None in row or any(value is None for value in row.values()):
            raise ValueError(f"malformed line in xpu-smi's report: {row}")
        device_id, bdf = row["Device ID"].strip(), row["PCI BDF Address"].strip()
        if device_id and not device_id.isdigit():
            raise ValueError(f"device id {device_id!r} is not a number")
        memory_mib = int(number(row["Memory Physical Size"].removesuffix("MiB")))
        device = resources_pb2.Device(
            id=row["UUID"].strip() or bdf or device_id,
            index=int(device_id) if device_id else len(devices),
            kind=resources_pb2.DEVICE_KIND_GPU,
            model=row["Device Name"].strip(),
            memory_total_mib=memory_mib,
            memory_free_mib=memory_mib,
        )
        if bdf:
            device.attributes["bdf"] = bdf
        status = row["GFX Firmware Status"].strip()
        if not device_id or "bad" in status.lower():
            device.health = resources_pb2.DEVICE_HEALTH_UNHEALTHY
            device.health_reason = f"xpu-smi cannot use it: {status or 'no device id'}"
        devices.append(device)
    return devices


PLUGIN = VendorPlugin(
    vendor="intel",
    tools=(
        Tool(
            ("xpu-smi", "discovery", "--dump", ",".join(map(str, _PROPERTIES))),
            parse_xpu_smi_dump,
        ),
    ),
)
