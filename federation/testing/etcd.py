"""A real single-member etcd on loopback, for the etcd store tests, HA tests and benchmarks.

It serves plaintext and mutual TLS on two client ports of one process, with certificates minted
by ``federation.security.pki``, and keeps its data in a temporary folder.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from federation.security.identity import Identity, Role
from federation.security.pki import CertificateAuthority
from federation.security.tls import TlsFiles

ETCD = "etcd"
START_TIMEOUT_S = 30.0
POLL_S = 0.05
START_ATTEMPTS = 3  # a free port can be taken between choosing it and etcd binding it
# A single member needs no slack for peers; short ticks make it elect itself in ~0.1 s and make
# its smallest lease ttl (1.5 election timeouts, rounded up) 1 s instead of 2 s.
TICK_FLAGS = ("--heartbeat-interval", "10", "--election-timeout", "100")


def etcd_binary() -> str | None:
    """The etcd server program on PATH, if any."""
    return shutil.which(ETCD)


def stop_process(process: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 10 s; nothing if it is not running."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports that were free a moment ago."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def write_pki(directory: Path) -> tuple[TlsFiles, TlsFiles]:
    """A CA, etcd's server certificate for 127.0.0.1 and a client certificate.

    Returns:
        ``(server, client)`` files, both trusting the same CA.
    """
    ca = CertificateAuthority.create("etcd test CA")
    (directory / "ca.pem").write_bytes(ca.cert_pem)
    files = []
    for name, (cert, key) in (
        ("server", ca.issue_server(["127.0.0.1"])),
        ("client", ca.issue_client(Identity(Role.OPERATOR, "coordinator"))),
    ):
        (directory / f"{name}.pem").write_bytes(cert)
        (directory / f"{name}-key.pem").write_bytes(key)
        (directory / f"{name}-key.pem").chmod(0o600)
        files.append(
            TlsFiles(directory / "ca.pem", directory / f"{name}.pem", directory / f"{name}-key.pem")
        )
    return files[0], files[1]


@dataclass
class LocalEtcd:
    """A running etcd member; ``start`` it, and ``stop`` it when done."""

    directory: Path
    """Holds the data dir, the certificates and the log."""
    client_tls: TlsFiles
    """Client certificate, key and CA for ``tls_endpoint``."""
    command: list[str]
    log_path: Path
    client_port: int
    tls_port: int
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """The plaintext client URL."""
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def tls_endpoint(self) -> str:
        """The mutual-TLS client URL."""
        return f"https://127.0.0.1:{self.tls_port}"

    @classmethod
    def start(cls, directory: Path) -> LocalEtcd:
        """Start etcd in ``directory`` and wait until it reports itself healthy.

        Raises:
            RuntimeError: etcd exited or did not become healthy in time; the message holds
                the end of its log.
        """
        server_tls, client_tls = write_pki(directory)
        for attempt in range(1, START_ATTEMPTS + 1):
            client_port, tls_port, peer_port = free_ports(3)
            peer = f"http://127.0.0.1:{peer_port}"
            command = [
                ETCD,
                "--name=test",
                f"--data-dir={directory / f'data-{attempt}'}",
                f"--listen-client-urls=http://127.0.0.1:{client_port},https://127.0.0.1:{tls_port}",
                f"--advertise-client-urls=http://127.0.0.1:{client_port}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}",
                f"--cert-file={server_tls.cert}",
                f"--key-file={server_tls.key}",
                f"--trusted-ca-file={server_tls.ca}",
                "--client-cert-auth",
                "--logger=zap",
                *TICK_FLAGS,
            ]
            log_path = directory / f"etcd-{attempt}.log"
            server = cls(directory, client_tls, command, log_path, client_port, tls_port)
            try:
                server.restart()
            except RuntimeError:
                log = log_path.read_text(errors="replace")
                if "address already in use" in log and attempt < START_ATTEMPTS:
                    continue
                raise
            return server
        raise AssertionError("unreachable")

    def restart(self) -> None:
        """(Re)start etcd on the same ports and data, and wait until it is healthy.

        Raises:
            RuntimeError: etcd exited or did not become healthy in time (it is stopped then).
        """
        self.stop()
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(self.command, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy(self.process)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, process: subprocess.Popen[bytes]) -> None:
        """Poll etcd's /health until it answers healthy, it exits, or time runs out."""
        url = f"http://127.0.0.1:{self.client_port}/health"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"etcd exited with {process.returncode}:\n{self._tail()}")
            # OSError: not listening yet; ValueError: an answer that is not JSON yet.
            with (
                contextlib.suppress(OSError, ValueError),
                urllib.request.urlopen(url, timeout=1) as response,
            ):
                if json.loads(response.read()).get("health") == "true":
                    return
            time.sleep(POLL_S)
        raise RuntimeError(f"etcd not healthy after {START_TIMEOUT_S} s:\n{self._tail()}")

    def stop(self) -> None:
        """Stop etcd if it runs (``stop_process``)."""
        process, self.process = self.process, None
        stop_process(process)

    def _tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
