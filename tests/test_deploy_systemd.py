"""deploy/systemd/: the units pass `systemd-analyze verify` without a single warning, their
sandboxing stays where it was put (`systemd-analyze security --offline`), and the sysusers
file creates the coordinator's account. No systemd needs to run: verify and security read
the files alone."""

from __future__ import annotations

import configparser
import subprocess
from pathlib import Path

import pytest
from deploy_tools import DEPLOY, need_tool

UNITS = DEPLOY / "systemd"
BINARIES = ("fed-coordinator", "fed-edge-agent", "fed-datacenter-agent")
INSTALLED_AT = "/opt/federation/bin/"
# Exposure scores (0 safest .. 10): the coordinator needs nothing; agents run tasks as other
# accounts, so they keep the capabilities for that and spare what tasks inherit.
EXPOSURE_AT_MOST = {
    "federation-coordinator.service": 2.0,
    "federation-edge-agent.service": 6.5,
    "federation-datacenter-agent.service": 6.5,
}


def units_in(tmp_path: Path) -> list[Path]:
    """The units, their ExecStart pointed at stand-ins: verify wants the binaries to exist."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in BINARIES:
        stand_in = bin_dir / name
        stand_in.write_text("#!/bin/sh\n")
        stand_in.chmod(0o755)
    out = []
    for unit in sorted(UNITS.glob("*.service")):
        copy = tmp_path / unit.name
        copy.write_text(unit.read_text().replace(INSTALLED_AT, f"{bin_dir}/"))
        out.append(copy)
    return out


def service(unit: str) -> dict[str, str]:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read(UNITS / unit)
    return dict(parser["Service"])


def test_units_verify_without_warnings(tmp_path: Path) -> None:
    analyze = need_tool("systemd-analyze", "Debian package systemd")
    units = units_in(tmp_path)
    assert [u.name for u in units] == sorted(EXPOSURE_AT_MOST)
    run = subprocess.run(
        [analyze, "verify", "--man=no", *map(str, units)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # verify exits 0 on an unknown key or a misspelt section; only silence means clean.
    assert (run.returncode, run.stdout + run.stderr) == (0, "")


@pytest.mark.parametrize("unit", sorted(EXPOSURE_AT_MOST))
def test_sandboxing_stays_tight(tmp_path: Path, unit: str) -> None:
    analyze = need_tool("systemd-analyze", "Debian package systemd")
    (path,) = (u for u in units_in(tmp_path) if u.name == unit)
    run = subprocess.run(
        [analyze, "security", "--offline=yes", "--no-pager", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    last = run.stdout.strip().splitlines()[-1]
    assert "Overall exposure level" in last, run.stdout + run.stderr
    exposure = float(last.split(":")[1].split()[0])
    assert exposure <= EXPOSURE_AT_MOST[unit], last


def test_sysusers_creates_the_coordinators_account(tmp_path: Path) -> None:
    sysusers = need_tool("systemd-sysusers", "Debian package systemd")
    (tmp_path / "etc").mkdir()
    subprocess.run(
        [sysusers, f"--root={tmp_path}", str(UNITS / "federation.sysusers.conf")],
        capture_output=True,
        timeout=60,
        check=True,
    )
    passwd = (tmp_path / "etc/passwd").read_text().split(":")
    assert (passwd[0], passwd[5], passwd[6].strip()) == (
        "federation",
        "/var/lib/federation",
        "/usr/sbin/nologin",
    )
    assert service("federation-coordinator.service")["User"] == "federation"


def test_the_hardening_the_readme_promises() -> None:
    """What the text relies on: agents leave tasks running, everything restarts on failure,
    and the agents can write their state (renewed certificates) and work folders."""
    for unit in EXPOSURE_AT_MOST:
        settings = service(unit)
        assert settings["Restart"] == "on-failure"
        assert settings["NoNewPrivileges"] == "yes"
        assert settings["ProtectSystem"] == "strict"
        assert "RestartSec" in settings
    coordinator = service("federation-coordinator.service")
    assert coordinator["StateDirectory"] == "federation"  # data_dir in deploy/coordinator.toml
    assert coordinator["CapabilityBoundingSet"] == ""
    for unit in ("federation-edge-agent.service", "federation-datacenter-agent.service"):
        agent = service(unit)
        assert agent["KillMode"] == "process"
        assert agent["StateDirectory"] == "federation-agent"  # state_dir in the example configs
        assert "User" not in agent  # root: tasks run as their tenants' accounts
