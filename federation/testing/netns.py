"""Sites behind real links of a chosen rate: Linux network namespaces joined to one bridge on
the host by veth pairs, each shaped with ``tc tbf`` both ways.

``ShapedLinks(first_index=F)`` makes a bridge ``fedbF`` holding the host's address 10.213.F.1/24;
each site added gets a namespace ``fedN-<site>`` whose veth is a port of that bridge, the site at
10.213.F.(N-F+2). Programs run inside with ``ip netns exec`` (``Namespace.command``), so a site's
store and agent reach the host (and a coordinator listening on the bridge address) through their
shaped link alone, and reach another site's store across the bridge: through the sender's link
and then the receiver's, each at its own rate, with no routing on the host. ``down()`` and
``up()`` cut and restore a link mid-transfer. ``ShapedLinks`` is a context manager that removes
every namespace, veth, bridge and process it made, also when a test fails.

Needs root and iproute2 (``ip``, ``tc``); ``unavailable()`` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from federation.testing.etcd import stop_process

SUBNET = "10.213"
BURST = "256kb"
"""Enough for the rate to hold at 200 Mbit/s with the kernel's timer, small enough to shape."""


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "shaped links need root (network namespaces and tc)"
    for tool in ("ip", "tc", "ss"):
        if shutil.which(tool) is None:
            return f"shaped links need iproute2's {tool!r}, not found"
    return None


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=30)


@dataclass
class Namespace:
    """One site's namespace and its shaped link to the host."""

    name: str
    index: int
    mbit: float
    ip: str
    """The site's address, as the host and other sites reach it."""
    host_ip: str
    """The host's address on the bridge, as the site reaches the host."""
    bridge: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def host_end(self) -> str:
        return f"fedh{self.index}"

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def spawn(self, argv: list[str], **popen: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside; it is stopped when the links are removed."""
        process: subprocess.Popen[bytes] = subprocess.Popen(self.command(argv), **popen)  # type: ignore[call-overload]
        self.processes.append(process)
        return process

    def down(self) -> None:
        """Cut the link: packets either way are dropped until ``up``."""
        _run("ip", "link", "set", self.host_end, "down")

    def up(self) -> None:
        _run("ip", "link", "set", self.host_end, "up")

    def _make(self) -> None:
        inner = f"fedn{self.index}"
        _run("ip", "netns", "add", self.name)
        _run("ip", "link", "add", self.host_end, "type", "veth", "peer", "name", inner)
        _run("ip", "link", "set", inner, "netns", self.name)
        _run("ip", "link", "set", self.host_end, "master", self.bridge)
        _run("ip", "link", "set", self.host_end, "up")
        inside = ["ip", "netns", "exec", self.name]
        _run(*inside, "ip", "addr", "add", f"{self.ip}/24", "dev", inner)
        _run(*inside, "ip", "link", "set", inner, "up")
        _run(*inside, "ip", "link", "set", "lo", "up")
        _run(*inside, "ip", "route", "add", "default", "via", self.host_ip)
        shape = ["root", "tbf", "rate", f"{self.mbit}mbit", "burst", BURST, "latency", "100ms"]
        _run("tc", "qdisc", "add", "dev", self.host_end, *shape)
        _run(*inside, "tc", "qdisc", "add", "dev", inner, *shape)

    def _remove(self) -> None:
        for process in self.processes:
            stop_process(process)
        # The veth goes with the namespace that holds one end; the host end too, if left.
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("ip", "netns", "del", self.name)
        with contextlib.suppress(subprocess.CalledProcessError):
            _run("ip", "link", "del", self.host_end)


def tcp_bytes(port: int, peers: Iterable[str]) -> int:
    """Bytes sent and received so far on the host's established TCP connections from its local
    ``port`` to any of ``peers``, as the kernel counts them (``ss -ti``): a server's traffic
    with those sites, TLS and all, and none of other programs' nor of its other ports. A
    connection closed meanwhile is no longer counted: compare counts of long-lived ones."""
    out = subprocess.run(
        ["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    wanted, total, counting = set(peers), 0, False
    for line in out.splitlines():
        if not line[:1].isspace():  # a connection: its addresses; its counters follow
            peer = line.split()[-1].rsplit(":", 1)[0].strip("[]")
            counting = peer.removeprefix("::ffff:") in wanted  # a dual-stack socket's IPv4
        elif counting:
            for field_ in line.split():
                name, _, value = field_.partition(":")
                if name in ("bytes_acked", "bytes_received"):
                    total += int(value)
    return total


class ShapedLinks:
    """Namespaces made by ``add`` on one bridge; all removed on exit (or ``close``).

    ``first_index`` (1 to 254) names the bridge and its /24: links made at the same time need
    different ones, at least their number of sites apart.
    """

    def __init__(self, first_index: int = 1) -> None:
        self.sites: dict[str, Namespace] = {}
        self._first = self._next = first_index
        self.bridge = f"fedb{first_index}"
        self.host_ip = f"{SUBNET}.{first_index}.1"
        """The host's address on the bridge: where a coordinator listens for the sites."""
        self._bridged = False

    def _make_bridge(self) -> None:
        self._bridged = True
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    def add(self, site: str, mbit: float) -> Namespace:
        """A namespace for ``site`` whose link to the bridge runs at ``mbit`` Mbit/s each way."""
        index = self._next
        namespace = Namespace(
            f"fed{index}-{site}"[:15],
            index,
            mbit,
            ip=f"{SUBNET}.{self._first}.{index - self._first + 2}",
            host_ip=self.host_ip,
            bridge=self.bridge,
        )
        self._next += 1
        self.sites[site] = namespace
        try:
            if not self._bridged:
                self._make_bridge()
            namespace._make()
        except BaseException:
            self.close()
            raise
        return namespace

    def bridge_bytes(self) -> int:
        """Bytes the host itself sent and received on the bridge (not those bridged between
        sites): every site's traffic with a program on the host, such as a coordinator."""
        stats = Path("/sys/class/net", self.bridge, "statistics")
        return sum(int((stats / f"{way}_bytes").read_text()) for way in ("rx", "tx"))

    def close(self) -> None:
        for namespace in self.sites.values():
            namespace._remove()
        self.sites.clear()
        if self._bridged:
            self._bridged = False
            with contextlib.suppress(subprocess.CalledProcessError):
                _run("ip", "link", "del", self.bridge)

    def __enter__(self) -> ShapedLinks:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
