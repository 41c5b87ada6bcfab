"""deploy/etcd/: the three-member example, started for real on loopback (its configs with
the addresses, ports and paths replaced, certificates from its make-certs.sh), forms one
cluster that the coordinator's store writes to through one member and reads through another,
over mutual TLS."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_tools import DEPLOY, need_tool

from federation.security.tls import TlsFiles
from federation.store import Put
from federation.store.etcd import EtcdStore
from federation.testing.etcd import free_ports

EXAMPLE = DEPLOY / "etcd"
MEMBERS = (1, 2, 3)


def local_config(member: int, ports: dict[str, int], pki: Path, data: Path) -> str:
    """The example's member config, moved onto loopback and into ``tmp_path``."""
    text = (EXAMPLE / f"etcd-{member}.yaml").read_text()
    text = text.replace(",https://127.0.0.1:2379", "")  # the local listener: one port each
    text = re.sub(r"10\.0\.0\.1(\d):(2379|2380)", lambda m: f"127.0.0.1:{ports[m[0]]}", text)
    text = text.replace("/etc/etcd/pki", str(pki))
    return text.replace("/var/lib/etcd", str(data / f"etcd-{member}"))


def wait_for(port: int, procs: list[subprocess.Popen[bytes]], logs: Path) -> None:
    """Until a member listens on ``port``; its logs if one exits meanwhile."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in procs):
            break
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    pytest.fail("\n".join(log.read_text()[-2000:] for log in sorted(logs.glob("*.log"))))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[list[str], Path]]:
    etcd = need_tool("etcd", "Debian package etcd-server")
    pki = tmp_path / "pki"
    subprocess.run(
        ["bash", str(EXAMPLE / "make-certs.sh"), str(pki), "127.0.0.1", "127.0.0.1", "127.0.0.1"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    numbers = free_ports(6)
    ports = {f"10.0.0.1{m}:{p}": numbers.pop() for m in MEMBERS for p in (2379, 2380)}
    procs = []
    try:
        for member in MEMBERS:
            config = tmp_path / f"etcd-{member}.yaml"
            config.write_text(local_config(member, ports, pki, tmp_path))
            log = (tmp_path / f"etcd-{member}.log").open("w")
            procs.append(
                subprocess.Popen([etcd, "--config-file", str(config)], stdout=log, stderr=log)
            )
        client_ports = [ports[f"10.0.0.1{m}:2379"] for m in MEMBERS]
        for port in client_ports:
            wait_for(port, procs, tmp_path)
        yield [f"https://127.0.0.1:{port}" for port in client_ports], pki
    finally:
        for proc in procs:
            proc.kill()  # a graceful stop waits on its peers' leaving; nothing here is kept
        for proc in procs:
            proc.wait(timeout=30)


def test_three_members_over_mutual_tls(cluster: tuple[list[str], Path]) -> None:
    endpoints, pki = cluster
    tls = TlsFiles(ca=pki / "ca.pem", cert=pki / "client.pem", key=pki / "client-key.pem")

    async def check() -> None:
        first = await EtcdStore.open(endpoints[:1], prefix="/example", tls=tls, timeout_s=30)
        last = await EtcdStore.open(endpoints[2:], prefix="/example", tls=tls, timeout_s=30)
        try:
            await first.commit([Put("k", b"through member 1")])
            kv = await last.get("k")
            assert kv is not None
            assert kv.value == b"through member 1"
        finally:
            await first.close()
            await last.close()

    asyncio.run(check())
