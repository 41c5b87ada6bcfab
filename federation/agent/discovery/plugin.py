"""What a vendor discovery plugin is, and how one runs: a vendor tool and a parser of its report.

A plugin never raises out of discovery. A tool that is not installed finds nothing; one that
hangs, fails or prints what its parser cannot read finds nothing and says why, so that the host
node can carry the note (``health=degraded``), as a Slurm site's node does when Slurm does not
answer.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from federation.api.v1 import resources_pb2

log = structlog.get_logger()

DEFAULT_TIMEOUT_S = 10.0
"""How long one vendor tool may take; ``npu-smi`` and ``xbutil`` need seconds on a full node."""

OUTPUT_FILE = "{output}"
"""Stands in a tool's arguments for a file to write its report to (``xbutil`` prints no JSON)."""

Parser = Callable[[str], list[resources_pb2.Device]]
"""Reads a tool's report into devices, their ``model`` the tool's own name for them; raises
``ValueError`` on a report it cannot read."""


class ToolError(Exception):
    """A vendor tool gave no report: it hung, failed, or could not start."""


@dataclass(frozen=True, slots=True)
class Tool:
    """One command line and the parser of its report."""

    argv: tuple[str, ...]
    parse: Parser


@dataclass(frozen=True, slots=True)
class VendorPlugin:
    """How to find one vendor's devices."""

    vendor: str
    """As ``Device.vendor`` spells it, e.g. "amd"."""
    tools: tuple[Tool, ...]
    """Alternatives, preferred first: only the first one installed runs."""


@dataclass(frozen=True, slots=True)
class Scan:
    """Devices one discovery found, and why some may be missing."""

    devices: tuple[resources_pb2.Device, ...] = ()
    problems: tuple[str, ...] = ()
    """For people: what failed, e.g. "npu-smi did not answer within 10 s"."""


def number(value: object) -> float:
    """A tool's reading as a non-negative finite number; 0 (unknown) for "N/A" and the like."""
    try:
        result = float(str(value).strip())
    except ValueError:
        return 0.0
    return result if math.isfinite(result) and result > 0 else 0.0


def lookup(doc: object, *path: str) -> object:
    """The value at ``path`` in nested JSON objects; None where a step is missing."""
    for key in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc


def table_rows(text: str) -> list[list[str]]:
    """The cells of each row of the ``| a | b |`` tables that smi tools draw, rules left out."""
    return [
        [cell.strip() for cell in line.strip().strip("|").split("|")]
        for line in text.splitlines()
        if line.startswith("|") and not set(line.strip()) <= set("|=+-")
    ]


def run_tool(argv: Sequence[str], timeout_s: float) -> str:
    """Runs a vendor tool to completion, killing it after ``timeout_s``.

    Returns:
        Its standard output, or the file it wrote where ``argv`` holds ``OUTPUT_FILE``.

    Raises:
        ToolError: It timed out, exited non-zero, could not start or wrote no report.
    """
    name = argv[0]
    with tempfile.TemporaryDirectory(prefix="fed-discovery-") as tmp:
        report = Path(tmp) / "report"
        args = [str(report) if arg == OUTPUT_FILE else arg for arg in argv]
        try:
            done = subprocess.run(
                args,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise ToolError(f"{name} did not answer within {timeout_s:g} s") from None
        except OSError as exc:
            raise ToolError(f"{name} could not start: {exc.strerror or exc}") from None
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip()).splitlines()
            detail = f": {said[-1][:200]}" if said else ""
            raise ToolError(f"{name} exited with status {done.returncode}{detail}")
        if OUTPUT_FILE not in argv:
            return done.stdout
        try:
            return report.read_text(errors="replace")
        except OSError:
            raise ToolError(f"{name} exited without writing its report") from None


def scan_vendor(plugin: VendorPlugin, timeout_s: float = DEFAULT_TIMEOUT_S) -> Scan:
    """The devices a plugin's first installed tool reports; nothing when none is installed."""
    tool = next((t for t in plugin.tools if shutil.which(t.argv[0])), None)
    if tool is None:
        return Scan()
    name = tool.argv[0]
    try:
        devices = tool.parse(run_tool(tool.argv, timeout_s))
    except ToolError as exc:
        problem = str(exc)
    except Exception as exc:  # a parser meeting output it cannot read must not stop discovery
        problem = f"{name} printed a report its parser cannot read: {exc}"
    else:
        log.info("vendor_devices_discovered", vendor=plugin.vendor, tool=name, count=len(devices))
        return Scan(devices=tuple(devices))
    log.warning("vendor_discovery_failed", vendor=plugin.vendor, tool=name, problem=problem)
    return Scan(problems=(problem,))
