"""Sites behind real links of a chosen rate: Linux network namespaces joined to the host by
veth pairs, each shaped with ``tc tbf`` both ways.

Each site gets a namespace ``fedN-<site>`` and a /30 of 10.213.N.0: the host side is
``.1``, the site ``.2``. Programs run inside with ``ip netns exec`` (``Namespace.command``), so
a site's store and agent reach the host (and a coordinator listening there) through the shaped
link alone. ``down()`` and ``up()`` cut and restore the link mid-transfer. ``ShapedLinks`` is a
context manager that removes every namespace, veth and process it made, also when a test fails.

Needs root and iproute2 (``ip``, ``tc``); ``unavailable()`` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from types import TracebackType

from federation.testing.etcd import stop_process

SUBNET = "10.213"
BURST = "256kb"
"""Enough for the rate to hold at 200 Mbit/s with the kernel's timer, small enough to shape."""


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "shaped links need root (network namespaces and tc)"
    for tool in ("ip", "tc"):
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
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def ip(self) -> str:
        """The site's address, as the host and other sites reach it."""
        return f"{SUBNET}.{self.index}.2"

    @property
    def host_ip(self) -> str:
        """The host's address on this link, as the site reaches the host."""
        return f"{SUBNET}.{self.index}.1"

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
        _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_end)
        _run("ip", "link", "set", self.host_end, "up")
        inside = ["ip", "netns", "exec", self.name]
        _run(*inside, "ip", "addr", "add", f"{self.ip}/30", "dev", inner)
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


class ShapedLinks:
    """Namespaces made by ``add``; all removed on exit (or ``close``)."""

    def __init__(self, first_index: int = 1) -> None:
        self.sites: dict[str, Namespace] = {}
        self._next = first_index

    def add(self, site: str, mbit: float) -> Namespace:
        """A namespace for ``site`` whose link to the host runs at ``mbit`` Mbit/s each way."""
        namespace = Namespace(f"fed{self._next}-{site}"[:15], self._next, mbit)
        self._next += 1
        self.sites[site] = namespace
        try:
            namespace._make()
        except BaseException:
            namespace._remove()
            raise
        return namespace

    def close(self) -> None:
        for namespace in self.sites.values():
            namespace._remove()
        self.sites.clear()

    def __enter__(self) -> ShapedLinks:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
