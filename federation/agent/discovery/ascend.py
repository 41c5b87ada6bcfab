"""Huawei Ascend NPUs from ``npu-smi info``, a text table (the tool prints no JSON)."""

from __future__ import annotations

import re

from federation.agent.discovery.plugin import Tool, VendorPlugin, number, table_rows
from federation.api.v1 import resources_pb2

# npu-smi's Health column; anything else it says (Alarm, Critical, …) is unhealthy.
_HEALTH = {
    "OK": resources_pb2.DEVICE_HEALTH_HEALTHY,
    "WARNING": resources_pb2.DEVICE_HEALTH_DEGRADED,
}


def _chip(first: list[str], second: list[str], index: int | None) -> resources_pb2.Device:
    """One chip from its two rows: ``NPU Name | Health | Power Temp …`` and
    ``Chip [Device or Phy-ID] | Bus-Id | AICore Memory-Usage [HBM-Usage]``; ``index`` None
    takes the chip's logical device from its Device column."""
    npu_name, chip_device = first[0].split(), second[0].split()
    ids = [*npu_name[:1], *chip_device]
    needed = 1 if index is not None else 2  # chip [, device]
    if len(npu_name) != 2 or len(chip_device) < needed or not all(i.isdigit() for i in ids):
        raise ValueError(f"unexpected row in npu-smi's table: {' | '.join(first)}")
    readings = first[2].split()
    # Used / total pairs: Memory-Usage, then HBM-Usage on chips that have HBM (910 series).
    usage = [(int(used), int(total)) for used, total in re.findall(r"(\d+)\s*/\s*(\d+)", second[2])]
    used, total = next((pair for pair in reversed(usage) if pair[1]), (0, 0))
    health = first[1]
    device = resources_pb2.Device(
        id=second[1] or f"npu{npu_name[0]}-chip{chip_device[0]}",
        index=int(chip_device[1]) if index is None else index,
        kind=resources_pb2.DEVICE_KIND_NPU,
        model=f"Ascend {npu_name[1]}",
        memory_total_mib=total,
        memory_free_mib=max(0, total - used),
        power_watts=number(readings[0]) if readings else 0.0,
        temperature_c=number(readings[1]) if len(readings) > 1 else 0.0,
        health=_HEALTH.get(health.upper(), resources_pb2.DEVICE_HEALTH_UNHEALTHY),
        attributes={"npu": npu_name[0], "chip": chip_device[0]},
    )
    if device.health != resources_pb2.DEVICE_HEALTH_HEALTHY:
        device.health_reason = f"npu-smi reports health {health or 'unknown'}"
    return device


def parse_npu_smi(text: str) -> list[resources_pb2.Device]:
    """Chips in ``npu-smi info``: two table rows per chip, then a table of processes.

    Raises:
        ValueError: The report holds no NPU table or a row of it is malformed.
    """
    rows = table_rows(text)
    header = next((i for i, row in enumerate(rows) if row[0].split()[:2] == ["NPU", "Name"]), None)
    if header is None:
        raise ValueError("no NPU table in npu-smi's report")
    body = rows[header + 2 :]  # past the two header rows
    # Older tables name each chip's logical device ("Chip Device"); newer ones its physical id
    # ("Chip Phy-ID") or nothing, and logical devices count up in table order.
    has_device_column = "Device" in rows[header + 1][0].split() if len(rows) > header + 1 else False
    version = re.search(r"Version:\s*(\S+)", text)
    devices: list[resources_pb2.Device] = []
    for first, second in zip(body[::2], body[1::2], strict=False):
        if any("Process" in cell for cell in first + second):
            break  # the table of processes
        if len(first) < 3 or len(second) < 3:
            raise ValueError(f"unexpected row in npu-smi's table: {' | '.join(first)}")
        device = _chip(first, second, None if has_device_column else len(devices))
        if version:
            device.attributes["driver"] = version.group(1)
        devices.append(device)
    return devices


PLUGIN = VendorPlugin(vendor="huawei", tools=(Tool(("npu-smi", "info"), parse_npu_smi),))
