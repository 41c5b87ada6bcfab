"""The README's "Deploying on three hosts", followed on one machine: the shipped deploy/ files
with only the substitutions it names (paths under a temporary root, loopback addresses and
free ports for the hosts'), a three-member etcd from deploy/etcd, a coordinator started as its
unit starts it, before etcd is up and kept under the unit's restart policy, and two agents from
the shipped agent configs and units; then a tenant's job runs.

Three hosts' daemons share one machine here, so etcd's extra local listener (127.0.0.1:2379 on
every member) is dropped, as in ``test_deploy_etcd``.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_tools import DEPLOY, need_tool
from test_deploy_etcd import MEMBERS, local_config, wait_for

from federation.testing.etcd import free_ports

pytestmark = [pytest.mark.xdist_group("deploy-federation"), pytest.mark.timeout(240)]

BIN = Path(sys.executable).parent
"""Where this install's commands are: the units' /opt/federation/bin."""
RESTART_S = 0.5
"""The unit's RestartSec (5 s), shortened."""


class Unit:
    """A systemd unit's ExecStart, run under its Restart=on-failure policy (simulated): a
    process that exits is started again after ``RESTART_S``, unless it exited with a status
    in RestartPreventExitStatus, which keeps it down (and fails the test)."""

    def __init__(self, unit: str, root: Path, log: Path) -> None:
        parsed = configparser.ConfigParser(strict=False, interpolation=None)
        parsed.read_string((DEPLOY / "systemd" / unit).read_text())
        service = parsed["Service"]
        assert service["Restart"] == "on-failure"
        self.prevent = {int(s) for s in service.get("RestartPreventExitStatus", "").split()}
        argv = shlex.split(service["ExecStart"])
        argv[0] = str(BIN / Path(argv[0]).name)
        self.argv = [relocated(arg, root) for arg in argv]
        self.log = log
        self.starts = 0
        self.process: subprocess.Popen[bytes] | None = None

    def keep_running(self) -> None:
        """Start it, or again if it exited (after RestartSec)."""
        if self.process is not None:
            status = self.process.poll()
            if status is None:
                return
            assert status not in self.prevent, f"{self.argv[0]} exited {status}: stays down"
            time.sleep(RESTART_S)
        with self.log.open("a") as out:
            self.process = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        self.starts += 1

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def relocated(text: str, root: Path) -> str:
    """The README's paths moved under ``root``: /etc/federation, /var/lib/federation*."""
    return re.sub(r"(/etc/federation|/var/lib/federation[-\w]*)", lambda m: f"{root}{m[0]}", text)


def fedctl(*args: str, root: Path, coordinator: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200"}
    argv = [str(BIN / "fedctl"), *args]
    if coordinator:
        argv += ["--coordinator", coordinator, "--pki-dir", str(root / "etc/federation/pki")]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, cwd=root)


def coordinator_config(root: Path, etcd: list[str], ports: dict[str, int]) -> str:
    """deploy/coordinator.toml as step 4 says: the HA block uncommented, metrics on."""
    text = (DEPLOY / "coordinator.toml").read_text()
    for key in ("store", "etcd_endpoints", "etcd_ca", "etcd_cert", "etcd_key", "advertise"):
        text = re.sub(rf"^# ({key} = )", r"\1", text, flags=re.M)
    text = text.replace("\n[", '\nmetrics_listen = "0.0.0.0:9464"\n\n[', 1)  # before any table
    # This host's addresses and ports: the hosts' own become free loopback ones.
    text = text.replace(
        '"10.0.0.11:2379", "10.0.0.12:2379", "10.0.0.13:2379"',
        ", ".join(f'"{endpoint}"' for endpoint in etcd),
    )
    text = text.replace("0.0.0.0:7070", f"127.0.0.1:{ports['listen']}")
    text = text.replace("0.0.0.0:7071", f"127.0.0.1:{ports['join']}")
    text = text.replace("0.0.0.0:9464", f"127.0.0.1:{ports['metrics']}")
    text = text.replace("coord-1.example.org:7070", f"127.0.0.1:{ports['listen']}")
    return relocated(text, root)


def agent_config(name: str, root: Path, ports: dict[str, int], metrics: int) -> tuple[str, str]:
    """deploy/NAME.toml as step 5 says: ``coordinator`` and ``join_address`` naming the
    coordinator; returns (config, site)."""
    text = (DEPLOY / f"{name}.toml").read_text()
    text = re.sub(r"coord(\.example\.org)?:7070", f"127.0.0.1:{ports['listen']}", text)
    text = re.sub(r"coord(\.example\.org)?:7071", f"127.0.0.1:{ports['join']}", text)
    text = text.replace('":9465"', f'"127.0.0.1:{metrics}"')
    site = re.search(r'^site = "([^"]+)"', text, re.M)
    assert site is not None
    return relocated(text, root), site[1]


@pytest.fixture
def etcd_members(tmp_path: Path) -> Iterator[tuple[list[str], Path, list[subprocess.Popen[bytes]]]]:
    """Step 3's certificates and member configs; the members are started by the test."""
    need_tool("etcd", "Debian package etcd-server")
    pki = tmp_path / "etc/etcd/pki"
    subprocess.run(
        [
            "bash",
            str(DEPLOY / "etcd/make-certs.sh"),
            str(pki),
            "127.0.0.1",
            "127.0.0.1",
            "127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    numbers = free_ports(6)
    ports = {f"10.0.0.1{m}:{p}": numbers.pop() for m in MEMBERS for p in (2379, 2380)}
    for member in MEMBERS:
        (tmp_path / f"etcd-{member}.yaml").write_text(local_config(member, ports, pki, tmp_path))
    procs: list[subprocess.Popen[bytes]] = []
    endpoints = [f"https://127.0.0.1:{ports[f'10.0.0.1{m}:2379']}" for m in MEMBERS]
    yield endpoints, pki, procs
    for proc in procs:
        proc.kill()
        proc.wait(timeout=30)


def test_the_deployment_section_as_written(
    tmp_path: Path, etcd_members: tuple[list[str], Path, list[subprocess.Popen[bytes]]]
) -> None:
    etcd_bin = need_tool("etcd", "Debian package etcd-server")
    endpoints, etcd_pki, members = etcd_members
    root = tmp_path / "host"
    etc = root / "etc/federation"
    etc.mkdir(parents=True)
    # Step 2: the PKI, naming every address agents dial; etcd's client certificate beside.
    done = fedctl("pki", "init", "--dir", str(etc / "pki"), "--san", "127.0.0.1", root=root)
    assert done.returncode == 0, done.stderr
    (etc / "etcd").mkdir()
    for name in ("ca.pem", "client.pem", "client-key.pem"):
        shutil.copy(etcd_pki / name, etc / "etcd" / name)
    numbers = free_ports(5)
    ports = {"listen": numbers[0], "join": numbers[1], "metrics": numbers[2]}
    (etc / "coordinator.toml").write_text(coordinator_config(root, endpoints, ports))
    address = f"127.0.0.1:{ports['listen']}"

    # Step 4, before etcd is up: the unit keeps the coordinator going until etcd comes.
    coordinator = Unit("federation-coordinator.service", root, tmp_path / "coordinator.log")
    agents: list[Unit] = []
    try:
        coordinator.keep_running()
        _until(lambda: "store_unreachable" in _read(coordinator.log), 30, coordinator)
        for member in MEMBERS:
            log = (tmp_path / f"etcd-{member}.log").open("w")
            config = tmp_path / f"etcd-{member}.yaml"
            members.append(
                subprocess.Popen([etcd_bin, "--config-file", str(config)], stdout=log, stderr=log)
            )
        for endpoint in endpoints:
            wait_for(int(endpoint.rsplit(":", 1)[1]), members, tmp_path)

        def leads() -> bool:
            coordinator.keep_running()
            status = fedctl("status", "-o", "json", root=root, coordinator=address)
            return status.returncode == 0 and json.loads(status.stdout)["leader"] == address

        _until(leads, 60, coordinator)

        # Step 5: two sites from the shipped agent configs and units.
        for name, unit, metrics in (
            ("edge-agent", "federation-edge-agent.service", numbers[3]),
            ("datacenter-agent", "federation-datacenter-agent.service", numbers[4]),
        ):
            config, site = agent_config(name, root, ports, metrics)
            domain = "edge" if name == "edge-agent" else "datacenter"
            token = etc / f"{site}.token"
            made = fedctl(
                "token",
                "create",
                "--site",
                site,
                "--domain",
                domain,
                "--out",
                str(token),
                root=root,
                coordinator=address,
            )
            assert made.returncode == 0, made.stderr
            shutil.copy(etc / "pki/ca.pem", etc / "ca.pem")
            shutil.copy(DEPLOY / "inventory.example.yaml", etc / "inventory.yaml")
            site_etc = root / site / "etc/federation"
            site_etc.mkdir(parents=True)
            for name_ in ("ca.pem", "inventory.yaml", f"{site}.token"):
                shutil.copy(etc / name_, site_etc / name_)
            (site_etc / "agent.toml").write_text(agent_config(name, root / site, ports, metrics)[0])
            agent = Unit(unit, root / site, tmp_path / f"{site}.log")
            agents.append(agent)
            agent.keep_running()

        def both_connected() -> bool:
            for agent in agents:
                agent.keep_running()
            listed = fedctl("sites", "-o", "json", root=root, coordinator=address)
            if listed.returncode != 0:
                return False
            sites = json.loads(listed.stdout)
            connected = [s for s in sites if s["state"] == "SITE_STATE_CONNECTED"]
            return len(connected) == 2

        _until(both_connected, 60, coordinator)

        # A tenant's job, with the tenant's own certificate.
        issued = fedctl("pki", "issue", "--dir", str(etc / "pki"), "--tenant", "team-a", root=root)
        assert issued.returncode == 0, issued.stderr
        job = root / "job.yaml"
        job.write_text(
            "name: hello\ntasks:\n  - name: main\n    command: [echo, deployed]\n"
            "    resources: {cpu: 1, memory_mib: 64}\n"
        )
        tenant = [
            "--cert",
            str(etc / "pki/tenant-team-a.pem"),
            "--key",
            str(etc / "pki/tenant-team-a-key.pem"),
            "--ca",
            str(etc / "pki/ca.pem"),
        ]
        ran = subprocess.run(
            [
                str(BIN / "fedctl"),
                "jobs",
                "submit",
                str(job),
                "--wait",
                "--coordinator",
                address,
                *tenant,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ran.returncode == 0, ran.stdout + ran.stderr
    finally:
        for agent in agents:
            agent.stop()
        coordinator.stop()


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _until(check: object, timeout_s: float, unit: Unit) -> None:
    assert callable(check)
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out; coordinator log:\n{_read(unit.log)[-3000:]}")
        time.sleep(0.2)
