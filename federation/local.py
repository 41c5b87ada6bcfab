"""A federation of real processes on loopback: the demo and the end-to-end tests use it.

It makes a PKI, starts the coordinator (or several, each under its own name, sharing an etcd
given in their arguments), mints a join token per site, starts each agent as its own process
with every coordinator's address, and stops everything it started.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import yaml

from federation.api.v1 import admin_service_pb2, admin_service_pb2_grpc
from federation.connection import LEADER_PATIENCE_S, Connection, on_leader
from federation.jobspec import parse_domain
from federation.listing import list_sites
from federation.security.pki import PkiLayout, init_pki, write_private_file
from federation.security.tls import TlsFiles

READY_TIMEOUT_S = 30.0


class LocalFederationError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class SiteSpec:
    """One site of a local federation."""

    name: str
    domain: str
    nodes: list[dict[str, Any]] = field(default_factory=list)
    """Inventory nodes (declared hardware), in the inventory file's format."""
    node_types: list[dict[str, Any]] = field(default_factory=list)
    """Inventory node types an elastic site launches (with ``settings["elastic"]``)."""
    discover_host: bool = False
    region: str = ""
    price_per_device_hour: float = 0.0
    settings: dict[str, Any] = field(default_factory=dict)
    """More agent settings (datasets, declared links, ...), written into its config file."""
    prefix: tuple[str, ...] = ()
    """What the agent's command runs under: ``ip netns exec NAME`` starts the site (and the
    tasks it runs) in a network namespace, which reaches the coordinator at ``host``."""


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, dict):
        return (
            "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"
        )
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


@dataclass
class LocalFederation:
    root: Path
    sites: list[SiteSpec]
    coordinator_args: list[str] = field(default_factory=list)
    """Arguments for every coordinator."""
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    port: int = 0
    """The first coordinator's mTLS port."""
    join_port: int = 0
    metrics_port: int = 0
    coordinators: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Every coordinator started, by name: its (port, join port), in start order."""
    agent_python: str = ""
    """The interpreter agents run with (an agent-only install's, say); empty: this one."""
    host: str = "127.0.0.1"
    """The address coordinators listen on and agents reach them at (in their certificates too):
    a bridge's address where sites run in network namespaces."""

    @property
    def pki(self) -> PkiLayout:
        return PkiLayout(self.root / "pki")

    @property
    def address(self) -> str:
        """The coordinator's address; with several, all of them, comma-separated."""
        if len(self.coordinators) <= 1:
            return f"{self.host}:{self.port}"
        return ",".join(self.address_of(name) for name in self.coordinators)

    @property
    def join_address(self) -> str:
        """The coordinator's join address; with several, all of them, comma-separated."""
        if len(self.coordinators) <= 1:
            return f"{self.host}:{self.join_port}"
        return ",".join(f"{self.host}:{join}" for _, join in self.coordinators.values())

    def address_of(self, name: str) -> str:
        """The mTLS address of the coordinator started as ``name``."""
        return f"{self.host}:{self.coordinators[name][0]}"

    def operator(self) -> Connection:
        tls = TlsFiles(
            ca=self.pki.ca_cert,
            cert=self.pki.client_cert("operator-admin"),
            key=self.pki.client_key("operator-admin"),
        )
        return Connection(self.address, tls)

    def log_path(self, name: str) -> Path:
        return self.root / "logs" / f"{name}.log"

    def _spawn(
        self, name: str, argv: list[str], prefix: Sequence[str] = (), python: str = ""
    ) -> subprocess.Popen[bytes]:
        self.log_path(name).parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path(name).open("ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if python:  # an install of its own: not the sources this one may import from
            env.pop("PYTHONPATH", None)
        proc = subprocess.Popen(
            [*prefix, python or sys.executable, "-m", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop them in order
        )
        self.processes[name] = proc
        return proc

    def _fail(self, name: str, what: str) -> LocalFederationError:
        tail = self.log_path(name).read_text(errors="replace")[-2000:]
        return LocalFederationError(f"{name} {what}; its log ends:\n{tail}")

    async def start_coordinator(
        self,
        *,
        port: int = 0,
        join_port: int = 0,
        name: str = "coordinator",
        args: Sequence[str] = (),
    ) -> None:
        """Start (or restart) a coordinator; waits until it has bound its ports.

        Args:
            port: mTLS port; 0 picks a free one.
            join_port: Join port; 0 picks a free one.
            name: Names its process, log and data folder; several coordinators need several.
            args: More arguments for this coordinator, after ``coordinator_args``.
        """
        if not self.pki.ca_cert.exists():
            sans = ["localhost", "127.0.0.1"]
            init_pki(self.pki.dir, server_sans=[*sans, *{self.host} - set(sans)])
        ready = self.root / f"{name}.ready"
        ready.unlink(missing_ok=True)
        proc = self._spawn(
            name,
            [
                "federation.coordinator",
                "--pki-dir",
                str(self.pki.dir),
                "--data-dir",
                str(self.root / name),
                "--listen",
                f"{self.host}:{port}",
                "--join-listen",
                f"{self.host}:{join_port}",
                "--ready-file",
                str(ready),
                "--log-json",
                *self.coordinator_args,
                *args,
            ],
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not ready.exists():
            if proc.poll() is not None:
                raise self._fail(name, f"exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise self._fail(name, "did not become ready")
            await asyncio.sleep(0.05)
        ports = json.loads(ready.read_text())
        self.coordinators[name] = (ports["port"], ports["join_port"])
        if next(iter(self.coordinators)) == name:
            self.port, self.join_port = ports["port"], ports["join_port"]
            self.metrics_port = ports.get("metrics_port", 0)

    async def create_token(self, site: str, domain: str) -> str:
        """A join token for ``site``, minted by the leader."""
        request = admin_service_pb2.CreateJoinTokenRequest(
            site=site, domain=parse_domain(domain), ttl_s=600
        )

        async def create(conn: Connection) -> str:
            async with conn.channel() as channel:
                admin = admin_service_pb2_grpc.AdminServiceStub(channel)
                return (await admin.CreateJoinToken(request)).token

        # Even a lone coordinator on etcd must first elect itself: wait for it to lead.
        return await on_leader(self.operator(), create, patience_s=LEADER_PATIENCE_S)

    async def start_site(self, site: SiteSpec) -> None:
        """Write the site's inventory and config, join it with a fresh token, start it."""
        home = self.root / "sites" / site.name
        home.mkdir(parents=True, exist_ok=True)
        token_file = home / "join-token"
        if not (home / "state" / "site.pem").exists():
            write_private_file(
                token_file, (await self.create_token(site.name, site.domain)).encode()
            )
        settings: dict[str, object] = {
            "site": site.name,
            "domain": site.domain,
            "region": site.region,
            "coordinator": self.address,
            "join_address": self.join_address,
            "ca": self.pki.ca_cert,
            "state_dir": home / "state",
            "token_file": token_file,
            "discover_host": site.discover_host,
            "kill_grace_s": 2.0,
            # Stopping a local federation stops its work too; a site may say otherwise
            "stop_tasks_on_exit": True,
            # On loopback, one user: tasks run as the agent (with the site key in reach)
            "run_tasks_as_agent": True,
            # Its services are reached on loopback too
            "service_address": "127.0.0.1",
            "price_per_device_hour": site.price_per_device_hour,
            **site.settings,
        }
        if site.nodes or site.node_types:
            inventory = home / "inventory.yaml"
            declared = {"nodes": site.nodes, "node_types": site.node_types}
            inventory.write_text(yaml.safe_dump(declared, sort_keys=False))
            settings["inventory"] = inventory
        config = home / "agent.toml"
        config.write_text("".join(f"{k} = {_toml_value(v)}\n" for k, v in settings.items()))
        module = "edge_agent" if site.domain == "edge" else "datacenter_agent"
        argv = [module, "--config", str(config), "--log-json"]
        self._spawn(site.name, argv, site.prefix, self.agent_python)

    async def wait_connected(self, names: list[str] | None = None, timeout_s: float = 30.0) -> None:
        """Wait until every named site (default: all) has a live session."""
        wanted = set(names if names is not None else [s.name for s in self.sites])
        deadline = time.monotonic() + timeout_s

        async def connected(conn: Connection) -> set[str]:
            async with conn.channel() as channel:
                admin = admin_service_pb2_grpc.AdminServiceStub(channel)
                sites = await list_sites(admin)
            return {s.name for s in sites if s.state == admin_service_pb2.SITE_STATE_CONNECTED}

        while True:
            try:
                up = await on_leader(self.operator(), connected)
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                up = set()  # a coordinator with a low request rate: ask again later
            if wanted <= up:
                return
            for name in wanted:
                proc = self.processes.get(name)
                if proc is not None and proc.poll() is not None:
                    raise self._fail(name, f"exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise LocalFederationError(f"sites not connected: {sorted(wanted - up)}")
            await asyncio.sleep(0.25)

    async def start(self) -> None:
        await self.start_coordinator()
        for site in self.sites:
            await self.start_site(site)
        await self.wait_connected()

    def kill(self, name: str) -> None:
        """SIGKILL one process (a crash, as tests need)."""
        proc = self.processes.pop(name)
        proc.kill()
        proc.wait()

    def terminate(self, name: str, timeout_s: float = 10.0) -> bool:
        """SIGTERM one process; True if it exited in time (else it is SIGKILLed)."""
        proc = self.processes.pop(name)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every process (agents first), then SIGKILL what is left."""
        coordinators = [n for n in self.processes if n in self.coordinators or n == "coordinator"]
        order = [n for n in self.processes if n not in coordinators] + coordinators
        for name in order:
            proc = self.processes.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for name in order:
            proc = self.processes.pop(name, None)
            if proc is None:
                continue
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
