"""Vendor discovery plugins: each parser against recorded tool output, and each tool run for
real as a small fake executable that prints a recording, hangs, fails or prints garbage."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from federation.agent.discovery import discover_host_node
from federation.agent.discovery.amd import parse_amd_smi, parse_rocm_smi
from federation.agent.discovery.ascend import parse_npu_smi
from federation.agent.discovery.cambricon import parse_cnmon
from federation.agent.discovery.intel import parse_xpu_smi_dump
from federation.agent.discovery.plugin import Parser
from federation.agent.discovery.vendors import PLUGINS, scan_vendors
from federation.agent.discovery.xilinx import parse_xbutil_examine
from federation.agent.main import load_config, parse_args, site_nodes
from federation.api.v1 import resources_pb2
from federation.config import ConfigError

FIXTURES = Path(__file__).parent / "fixtures"
HEALTHY = resources_pb2.DEVICE_HEALTH_HEALTHY
DEGRADED = resources_pb2.DEVICE_HEALTH_DEGRADED
UNHEALTHY = resources_pb2.DEVICE_HEALTH_UNHEALTHY


def recording(name: str) -> str:
    """A fixture as the tool printed it: without the comment lines that say where it is from."""
    lines = (FIXTURES / name).read_text().splitlines(keepends=True)
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "".join(lines)


FakeTool = Callable[..., None]


@pytest.fixture
def fake_tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeTool:
    """Installs fake vendor tools in a PATH that holds nothing else."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))

    def install(
        name: str, prints: str = "", *, sleep_s: float = 0, exit_code: int = 0, stderr: str = ""
    ) -> None:
        # Like xbutil, it writes its report to the file after --output when given one.
        script = bin_dir / name
        script.write_text(
            f"#!{sys.executable}\n"
            "import sys, time\n"
            f"time.sleep({sleep_s})\n"
            "if '--output' in sys.argv:\n"
            "    with open(sys.argv[sys.argv.index('--output') + 1], 'w') as f:\n"
            f"        f.write({prints!r})\n"
            "else:\n"
            f"    sys.stdout.write({prints!r})\n"
            f"sys.stderr.write({stderr!r})\n"
            f"sys.exit({exit_code})\n"
        )
        script.chmod(0o755)

    return install


# Parsers against recordings ---------------------------------------------------------------


def test_amd_smi_static() -> None:
    """amd-smi's GPUs carry market name, VRAM in MiB, serial as id, bus and gfx version."""
    gpus = parse_amd_smi(recording("amd/amd-smi-static.json"))
    assert [(g.index, g.id, g.model) for g in gpus] == [
        (0, "0x3F1C6A2B5D7E9011", "AMD Instinct MI300X"),
        (1, "0x3F1C6A2B5D7E9022", "AMD Instinct MI300X"),
    ]
    assert all(g.kind == resources_pb2.DEVICE_KIND_GPU for g in gpus)
    assert gpus[0].memory_total_mib == gpus[0].memory_free_mib == 196592
    assert dict(gpus[1].attributes) == {
        "bdf": "0000:15:00.0",
        "gfx_version": "gfx942",
        "driver": "6.10.5",
    }


def test_amd_smi_static_of_older_releases() -> None:
    """amd-smi 24.x printed a bare list and the size as text; a GPU without serial has its bus."""
    (gpu,) = parse_amd_smi(recording("amd/amd-smi-static-list.json"))
    assert (gpu.id, gpu.model, gpu.memory_total_mib) == (
        "0000:83:00.0",
        "AMD Instinct MI210",
        65520,
    )


def test_rocm_smi() -> None:
    """rocm-smi's cards in card order, VRAM bytes to MiB, keys matched ignoring case."""
    gpus = parse_rocm_smi(recording("amd/rocm-smi.json"))
    assert [(g.index, g.id) for g in gpus] == [
        (0, "0x8c3b5e7d1a2f4c60"),
        (1, "0x8c3b5e7d1a2f4c61"),
        (2, "card2"),  # no unique id
    ]
    assert gpus[0].model == "AMD Instinct MI250X"
    assert gpus[2].model == "Navi 32 [Radeon RX 7700 XT / 7800 XT]"
    assert (gpus[0].memory_total_mib, gpus[0].memory_free_mib) == (65520, 65520 - 11077)
    assert gpus[0].attributes["gfx_version"] == "gfx90a"


def test_npu_smi_910b() -> None:
    """Each 910B chip: HBM as memory, power and temperature, health from the Health column."""
    npus = parse_npu_smi(recording("ascend/npu-smi-910b.txt"))
    assert [(n.index, n.id) for n in npus] == [
        (0, "0000:C1:00.0"),
        (1, "0000:C2:00.0"),
        (2, "0000:81:00.0"),
        (3, "0000:82:00.0"),
    ]
    first = npus[0]
    assert first.kind == resources_pb2.DEVICE_KIND_NPU
    assert first.model == "Ascend 910B3"
    assert (first.memory_total_mib, first.memory_free_mib) == (65536, 65536 - 3161)
    assert (first.power_watts, first.temperature_c) == (95.7, 37)
    assert first.health == HEALTHY
    assert dict(first.attributes) == {"npu": "0", "chip": "0", "driver": "24.1.rc2"}
    assert npus[3].health == DEGRADED
    assert "Warning" in npus[3].health_reason
    assert npus[3].memory_free_mib == 65536 - 60213


def test_npu_smi_310_names_logical_devices() -> None:
    """On an older table the Device column is the chip's index; memory is Memory-Usage."""
    npus = parse_npu_smi(recording("ascend/npu-smi-310.txt"))
    assert [n.index for n in npus] == [3, 4, 5, 6]
    assert {n.model for n in npus} == {"Ascend 310"}
    assert (npus[0].memory_total_mib, npus[0].memory_free_mib) == (8192, 8192 - 2703)
    assert npus[0].attributes["driver"] == "21.0.4.B030"


def test_npu_smi_physical_ids_are_not_indices() -> None:
    """Where the second column names physical ids rather than devices, chips count up."""
    text = recording("ascend/npu-smi-910b.txt").replace("| Chip     ", "| Chip  Phy-ID")
    text = text.replace("| 0                         | 0000", "| 0     7                   | 0000")
    assert [n.index for n in parse_npu_smi(text)] == [0, 1, 2, 3]


def test_cnmon() -> None:
    """Each MLU: name, memory, power against its cap, temperature, bus id, driver, ECC count."""
    mlus = parse_cnmon(recording("cambricon/cnmon.txt"))
    assert [(m.index, m.id, m.model) for m in mlus] == [
        (0, "0000:13:00.0", "MLU370-X8"),
        (1, "0000:16:00.0", "MLU370-X8"),
    ]
    second = mlus[1]
    assert second.kind == resources_pb2.DEVICE_KIND_MLU
    assert (second.memory_total_mib, second.memory_free_mib) == (20638, 20638 - 4096)
    assert (second.power_watts, second.power_tdp_watts, second.temperature_c) == (107, 250, 32)
    assert dict(second.attributes) == {"firmware": "v1.1.6", "driver": "5.10.22", "ecc_errors": "0"}


def test_cnmon_before_v5() -> None:
    """Before v5 the driver stood in each card's row and there was no bus id."""
    mlus = parse_cnmon(recording("cambricon/cnmon-v4.txt"))
    assert [(m.id, m.memory_total_mib) for m in mlus] == [("mlu0", 23308), ("mlu1", 23308)]
    assert mlus[0].attributes["driver"] == "4.20.11"
    assert "ecc_errors" not in mlus[0].attributes  # N/A


def test_xpu_smi_dump() -> None:
    """Each Intel GPU from the dump; one xpu-smi cannot open is unhealthy, named by its bus."""
    gpus = parse_xpu_smi_dump(recording("intel/xpu-smi-dump.csv"))
    assert [(g.index, g.id) for g in gpus] == [
        (0, "00000000-0000-0029-0000-002f0bd58086"),
        (1, "00000000-0000-003a-0000-002f0bd58086"),
        (2, "0000:9a:00.0"),
    ]
    assert gpus[0].model == "Intel(R) Data Center GPU Max 1550"
    assert gpus[0].memory_total_mib == 131072
    assert gpus[0].health == resources_pb2.DEVICE_HEALTH_UNSPECIFIED  # xpu-smi says nothing
    assert gpus[2].health == UNHEALTHY
    assert "GPU in bad state" in gpus[2].health_reason


def test_xbutil_examine() -> None:
    """Alveo cards by bus id with the board as model; a card not ready is degraded."""
    cards = parse_xbutil_examine(recording("xilinx/xbutil-examine.json"))
    assert [(c.index, c.id, c.model, c.health) for c in cards] == [
        (0, "0000:17:00.1", "U250", HEALTHY),
        (1, "0000:65:00.1", "U55C", DEGRADED),  # the Ryzen NPU is left out
    ]
    assert cards[0].kind == resources_pb2.DEVICE_KIND_FPGA
    assert cards[0].attributes["shell"] == "xilinx_u250_gen3x16_xdma_shell_4_1"


@pytest.mark.parametrize(
    "parse",
    [
        parse_amd_smi,
        parse_rocm_smi,
        parse_npu_smi,
        parse_cnmon,
        parse_xpu_smi_dump,
        parse_xbutil_examine,
    ],
)
@pytest.mark.parametrize(
    "garbage",
    ["", "Segmentation fault (core dumped)\n", "[1, 2, 3]", '{"card0": 7, "gpu_data": 1}'],
)
def test_parsers_refuse_garbage(parse: Parser, garbage: str) -> None:
    """A report a parser cannot read is a ValueError, never a made-up device."""
    try:
        devices = parse(garbage)
    except ValueError:
        return
    assert devices == []  # or, for a well-formed report, no devices at all


def test_malformed_row_is_refused() -> None:
    """A table row that is not what the tool prints is an error, not a device."""
    text = recording("ascend/npu-smi-910b.txt").replace("| 1     910B3", "| one   910B3")
    with pytest.raises(ValueError, match="unexpected row"):
        parse_npu_smi(text)


# Tools run for real ------------------------------------------------------------------------


def test_absent_tools_find_nothing(fake_tool: FakeTool) -> None:
    """With no vendor tool installed, discovery finds no devices and has nothing to report."""
    scan = scan_vendors()
    assert scan.devices == ()
    assert scan.problems == ()


def test_tool_devices_get_vendor_and_canonical_model(fake_tool: FakeTool) -> None:
    """A tool's devices carry the plugin's vendor, the canonical model and the tool's name."""
    fake_tool("npu-smi", recording("ascend/npu-smi-910b.txt"))
    scan = scan_vendors()
    assert scan.problems == ()
    assert len(scan.devices) == 4
    npu = scan.devices[0]
    assert (npu.vendor, npu.model) == ("huawei", "Ascend-910B")
    assert npu.attributes["product_name"] == "Ascend 910B3"
    assert npu.provenance == resources_pb2.PROVENANCE_DISCOVERED


def test_site_names_reach_vendor_devices(fake_tool: FakeTool) -> None:
    """The site's model names apply to every vendor's devices."""
    fake_tool("cnmon", recording("cambricon/cnmon.txt"))
    scan = scan_vendors({"MLU370-X8": "MLU370-X8-48GB"})
    assert {d.model for d in scan.devices} == {"MLU370-X8-48GB"}


def test_preferred_tool_runs_alone(fake_tool: FakeTool) -> None:
    """With amd-smi and rocm-smi both installed, only amd-smi runs: no GPU is listed twice."""
    fake_tool("amd-smi", recording("amd/amd-smi-static.json"))
    fake_tool("rocm-smi", "not to be run", exit_code=3)
    scan = scan_vendors()
    assert [d.model for d in scan.devices] == ["MI300X", "MI300X"]
    assert scan.problems == ()


def test_older_tool_runs_when_preferred_is_absent(fake_tool: FakeTool) -> None:
    """Without amd-smi, rocm-smi answers."""
    fake_tool("rocm-smi", recording("amd/rocm-smi.json"))
    scan = scan_vendors()
    assert [d.model for d in scan.devices][:2] == ["MI250X", "MI250X"]


def test_report_written_to_a_file(fake_tool: FakeTool) -> None:
    """xbutil's JSON comes from the file it is told to write."""
    fake_tool("xbutil", recording("xilinx/xbutil-examine.json"))
    scan = scan_vendors()
    assert [(d.vendor, d.model) for d in scan.devices] == [("xilinx", "U250"), ("xilinx", "U55C")]


def test_hung_tool_is_a_problem_not_a_stuck_agent(fake_tool: FakeTool) -> None:
    """A tool that does not answer in time is killed and reported; the others still answer."""
    fake_tool("npu-smi", sleep_s=60)
    fake_tool("cnmon", recording("cambricon/cnmon.txt"))
    scan = scan_vendors(timeout_s=0.5)
    assert scan.problems == ("npu-smi did not answer within 0.5 s",)
    assert [d.vendor for d in scan.devices] == ["cambricon", "cambricon"]


def test_failing_tool_is_a_problem(fake_tool: FakeTool) -> None:
    """A tool exiting non-zero finds nothing and its last words are the reason."""
    fake_tool("xpu-smi", exit_code=1, stderr="Error: Level Zero Initialization Error\n")
    with capture_logs() as logs:
        scan = scan_vendors()
    assert scan.devices == ()
    assert scan.problems == (
        "xpu-smi exited with status 1: Error: Level Zero Initialization Error",
    )
    warning = next(e for e in logs if e["event"] == "vendor_discovery_failed")
    assert (warning["log_level"], warning["vendor"], warning["tool"]) == (
        "warning",
        "intel",
        "xpu-smi",
    )


def test_garbage_printing_tool_is_a_problem(fake_tool: FakeTool) -> None:
    """A tool whose report its parser cannot read finds nothing, and says so."""
    fake_tool("amd-smi", "ERROR: amdgpu driver not loaded\n")
    scan = scan_vendors()
    assert scan.devices == ()
    (problem,) = scan.problems
    assert problem.startswith("amd-smi printed a report its parser cannot read")


def test_missing_report_file_is_a_problem(fake_tool: FakeTool, tmp_path: Path) -> None:
    """A tool that exits cleanly without writing the report it was asked for is reported."""
    script = tmp_path / "bin" / "xbutil"
    script.write_text(f"#!{sys.executable}\n")
    script.chmod(0o755)
    assert scan_vendors().problems == ("xbutil exited without writing its report",)


def test_host_node_shows_every_vendor(fake_tool: FakeTool) -> None:
    """A host with several vendors' accelerators publishes all of them."""
    fake_tool("amd-smi", recording("amd/amd-smi-static.json"))
    fake_tool("npu-smi", recording("ascend/npu-smi-310.txt"))
    fake_tool("xbutil", recording("xilinx/xbutil-examine.json"))
    node = discover_host_node("box")
    vendors = [d.vendor for d in node.devices if d.vendor != "nvidia"]
    assert vendors == ["amd"] * 2 + ["huawei"] * 4 + ["xilinx"] * 2
    assert "health" not in node.labels


def test_host_node_notes_failed_discovery(fake_tool: FakeTool) -> None:
    """A tool that fails leaves the host node schedulable but labelled degraded, with why."""
    fake_tool("cnmon", sleep_s=60)
    fake_tool("npu-smi", recording("ascend/npu-smi-310.txt"))
    node = discover_host_node("box", tool_timeout_s=0.5)
    assert node.schedulable
    assert node.labels["health"] == "degraded"
    assert node.labels["health_reason"] == "cnmon did not answer within 0.5 s"
    assert sum(d.vendor == "huawei" for d in node.devices) == 4


def test_every_plugin_has_a_distinct_vendor() -> None:
    """One plugin per vendor, so no vendor's devices are found twice."""
    vendors = [plugin.vendor for plugin in PLUGINS]
    assert len(vendors) == len(set(vendors)) == 5


def test_site_config_names_reach_the_host_node(fake_tool: FakeTool, tmp_path: Path) -> None:
    """An agent config's [model_names] table renames the devices of the node it publishes."""
    path = tmp_path / "agent.toml"
    path.write_text(
        'site = "s"\ncoordinator = "c:1"\nca = "ca.pem"\nstate_dir = "st"\n'
        '[model_names]\n"Ascend 310" = "Ascend-310-8GB"\n'
    )
    fake_tool("npu-smi", recording("ascend/npu-smi-310.txt"))
    config = load_config(parse_args(["--config", str(path)], "p", "edge"), "edge")
    (node,) = site_nodes(config)
    assert {d.model for d in node.devices if d.vendor == "huawei"} == {"Ascend-310-8GB"}


def test_site_config_names_must_be_strings(tmp_path: Path) -> None:
    """A model name that is not a string is refused when the config loads, naming the key."""
    path = tmp_path / "agent.toml"
    path.write_text(
        'site = "s"\ncoordinator = "c:1"\nca = "ca.pem"\nstate_dir = "st"\n'
        '[model_names]\n"Tesla T4" = 4\n'
    )
    with pytest.raises(ConfigError, match="model_names"):
        load_config(parse_args(["--config", str(path)], "p", "edge"), "edge")
