"""Cambricon MLUs from ``cnmon``'s summary table (its JSON export only writes to a file in the
working folder, under a fixed name)."""

from __future__ import annotations

import re

from federation.agent.discovery.plugin import Tool, VendorPlugin, number, table_rows
from federation.api.v1 import resources_pb2

_BUS_ID = re.compile(r"[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d")
_MEMORY = re.compile(r"(\d+)\s*MiB\s*/\s*(\d+)\s*MiB")
_POWER = re.compile(r"([\d.]+)\s*W\s*/\s*([\d.]+)\s*W")
_TEMPERATURE = re.compile(r"(\d+)C\b")


def _card(first: list[str], second: list[str], index: int, driver: str) -> resources_pb2.Device:
    """One card from its two rows: ``Card VF Name Firmware | Bus-Id (or Inited Driver) | Util
    Ecc-Error`` and ``Fan Temp Pwr:Usage/Cap | Memory-Usage | …``."""
    card = first[0].split()
    if len(card) < 3 or not card[0].isdigit():
        raise ValueError(f"unexpected row in cnmon's table: {' | '.join(first)}")
    memory = _MEMORY.search(second[1])
    if memory is None:
        raise ValueError(f"no memory usage for card {card[0]} in cnmon's table")
    used, total = int(memory.group(1)), int(memory.group(2))
    power = _POWER.search(second[0])
    temperature = _TEMPERATURE.search(second[0])
    bus_id = _BUS_ID.search(first[1])
    # Before v5 the middle column held the driver version ("On  v4.20.11"), not the bus id.
    driver = driver or next((t[1:] for t in first[1].split() if re.fullmatch(r"v[\d.]+", t)), "")
    device = resources_pb2.Device(
        id=bus_id.group(0) if bus_id else f"mlu{card[0]}",
        index=index,
        kind=resources_pb2.DEVICE_KIND_MLU,
        model=card[2],
        memory_total_mib=total,
        memory_free_mib=max(0, total - used),
        power_watts=number(power.group(1)) if power else 0.0,
        power_tdp_watts=number(power.group(2)) if power else 0.0,
        temperature_c=number(temperature.group(1)) if temperature else 0.0,
    )
    if len(card) > 3:
        device.attributes["firmware"] = card[3]
    if driver:
        device.attributes["driver"] = driver
    ecc = first[2].split()[-1:] if len(first) > 2 else []
    if ecc and ecc[0].isdigit():
        device.attributes["ecc_errors"] = ecc[0]
    return device


def parse_cnmon(text: str) -> list[resources_pb2.Device]:
    """Cards in ``cnmon``'s table: two rows per card, then a table of processes.

    Raises:
        ValueError: The report holds no card table or a row of it is malformed.
    """
    rows = table_rows(text)
    header = next((i for i, row in enumerate(rows) if row[0].split()[:2] == ["Card", "VF"]), None)
    if header is None:
        raise ValueError("no card table in cnmon's report")
    body = rows[header + 2 :]  # past the two header rows
    driver = re.search(r"Driver\s+v(\S+)", text)
    devices: list[resources_pb2.Device] = []
    for first, second in zip(body[::2], body[1::2], strict=False):
        if any("Processes" in cell for cell in first + second):
            break
        if len(first) < 2 or len(second) < 2:
            raise ValueError(f"unexpected row in cnmon's table: {' | '.join(first)}")
        devices.append(_card(first, second, len(devices), driver.group(1) if driver else ""))
    return devices


PLUGIN = VendorPlugin(vendor="cambricon", tools=(Tool(("cnmon",), parse_cnmon),))
