"""AMD GPUs from ``amd-smi static --json`` (ROCm 6 and later), else ``rocm-smi --json``."""

from __future__ import annotations

import json
import re

from federation.agent.discovery.plugin import Tool, VendorPlugin, lookup, number
from federation.api.v1 import resources_pb2

_MIB = 1024 * 1024
# amd-smi's "MB" are MiB: an MI210's 64 GiB read "65520 MB".
_UNIT_MIB = {"B": 1 / _MIB, "KB": 1 / 1024, "MB": 1.0, "MIB": 1.0, "GB": 1024.0, "GIB": 1024.0}
_NOT_AN_ID = {"", "N/A", "0", "0X0"}


def _gpu(index: int, name: str, memory_mib: int, used_mib: int = 0) -> resources_pb2.Device:
    return resources_pb2.Device(
        index=index,
        kind=resources_pb2.DEVICE_KIND_GPU,
        model=name,
        memory_total_mib=memory_mib,
        memory_free_mib=max(0, memory_mib - used_mib),
    )


def _size_mib(size: object) -> int:
    """amd-smi's VRAM size: ``{"value": 65520, "unit": "MB"}``, or ``"65520 MB"`` before 6.1."""
    if isinstance(size, dict):
        value, unit = size.get("value"), str(size.get("unit", "MB"))
    else:
        value, _, unit = str(size).strip().partition(" ")
    return int(number(value) * _UNIT_MIB.get(unit.strip().upper() or "MB", 0.0))


def parse_amd_smi(text: str) -> list[resources_pb2.Device]:
    """Devices in ``amd-smi static --json``: a list of GPUs, wrapped in ``gpu_data`` since 6.3.

    Raises:
        ValueError: The report is not JSON or lists no GPUs.
    """
    doc = json.loads(text)
    gpus = doc.get("gpu_data") if isinstance(doc, dict) else doc
    if not isinstance(gpus, list):
        raise ValueError("no list of GPUs in amd-smi's report")
    devices: list[resources_pb2.Device] = []
    for position, gpu in enumerate(gpus):
        if not isinstance(gpu, dict):
            raise ValueError(f"GPU {position} is not a JSON object")
        name = lookup(gpu, "asic", "market_name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"GPU {position} has no asic.market_name")
        index = gpu["gpu"] if isinstance(gpu.get("gpu"), int) else position
        device = _gpu(index, name, _size_mib(lookup(gpu, "vram", "size")))
        serial, bdf = lookup(gpu, "asic", "asic_serial"), lookup(gpu, "bus", "bdf")
        device.id = next(
            (str(v) for v in (serial, bdf) if v and str(v).upper() not in _NOT_AN_ID), str(index)
        )
        for key, value in (
            ("bdf", bdf),
            ("gfx_version", lookup(gpu, "asic", "target_graphics_version")),
            ("driver", lookup(gpu, "driver", "version")),
        ):
            if isinstance(value, str | int) and str(value) not in ("", "N/A"):
                device.attributes[key] = str(value)
        devices.append(device)
    return devices


def parse_rocm_smi(text: str) -> list[resources_pb2.Device]:
    """Devices in ``rocm-smi --showproductname --showmeminfo vram --showuniqueid --json``.

    Its keys are ``card0``, ``card1``… (and ``system``), each a flat object whose key spelling
    varies by ROCm release ("Card series", "Card Series"), so keys are matched ignoring case.

    Raises:
        ValueError: The report is not JSON or a card has no name.
    """
    doc = json.loads(text)
    if not isinstance(doc, dict):
        raise ValueError("rocm-smi's report is not a JSON object")
    cards = sorted(
        (int(m.group(1)), card)
        for key, card in doc.items()
        if (m := re.fullmatch(r"card(\d+)", key)) and isinstance(card, dict)
    )
    devices: list[resources_pb2.Device] = []
    for index, (card_number, card) in enumerate(cards):
        fields = {str(k).lower(): str(v) for k, v in card.items()}
        name = fields.get("card series") or fields.get("device name") or ""
        if not name:
            raise ValueError(f"card{card_number} has no card series")
        # VRAM in bytes on AMD's builds; Hygon's build reports MiB.
        if "vram total memory (b)" in fields:
            total = number(fields["vram total memory (b)"]) / _MIB
            used = number(fields.get("vram total used memory (b)", 0)) / _MIB
        else:
            total = number(fields.get("vram total memory (mib)", 0))
            used = number(fields.get("vram total used memory (mib)", 0))
        device = _gpu(index, name, int(total), int(used))
        unique_id = fields.get("unique id", "")
        device.id = unique_id if unique_id.upper() not in _NOT_AN_ID else f"card{card_number}"
        if gfx := fields.get("gfx version"):
            device.attributes["gfx_version"] = gfx
        devices.append(device)
    return devices


PLUGIN = VendorPlugin(
    vendor="amd",
    tools=(
        Tool(("amd-smi", "static", "--json"), parse_amd_smi),
        Tool(
            (
                "rocm-smi",
                "--showproductname",
                "--showmeminfo",
                "vram",
                "--showuniqueid",
                "--json",
            ),
            parse_rocm_smi,
        ),
    ),
)
