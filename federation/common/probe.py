"""Link probes: a tiny TCP server every agent runs, and the client that measures a link.

The wire protocol is tiny and unauthenticated (it carries no data, only zeros):

- ``P`` is echoed back as ``P`` (a ping);
- ``T`` + 8-byte big-endian length + that many bytes is answered with ``K`` once every byte
  has arrived (a throughput probe).

Anything else closes the connection, as does a probe over ``MAX_PROBE_BYTES``.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Protocol

import structlog

log = structlog.get_logger()

PING = b"P"
THROUGHPUT = b"T"
ACK = b"K"
MAX_PROBE_BYTES = 256 * 1024 * 1024
"""The largest throughput probe a server accepts; bigger ones are refused."""
CHUNK_BYTES = 64 * 1024


class LinkProbeError(RuntimeError):
    """A link could not be measured: the peer refused, went silent or is unreachable."""


@dataclass(frozen=True, slots=True)
class Measurement:
    """One measurement of the link to a peer."""

    rtt_ms: float
    """Median round trip of the pings, in milliseconds."""
    bandwidth_mbps: float
    """Throughput of one probe, in megabits per second."""
    measured_at: float
    """Unix time when the measurement finished."""


class MeasureFn(Protocol):
    """The shape of ``measure_link``, so tests can stand in a fake."""

    def __call__(
        self, endpoint: str, *, payload_bytes: int, timeout_s: float
    ) -> Awaitable[Measurement]: ...


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``host:port`` (or ``[v6]:port``) into host and port.

    Raises:
        ValueError: when there is no valid port.
    """
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{endpoint!r} is not host:port")
    return host.removeprefix("[").removesuffix("]"), int(port)


def join_endpoint(host: str, port: int) -> str:
    """The inverse of ``split_endpoint``: brackets an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# The server ------------------------------------------------------------------------------


class ProbeServer:
    """Answers pings and throughput probes from peer agents on one TCP port."""

    def __init__(
        self,
        listen: str,
        *,
        io_timeout_s: float = 30.0,
        max_connections: int = 32,
        max_probe_bytes: int = MAX_PROBE_BYTES,
    ) -> None:
        """Prepare a server; nothing listens until ``start``.

        Args:
            listen: ``host:port`` to bind; port 0 picks a free one.
            io_timeout_s: How long one read may wait before the connection is dropped.
            max_connections: Connections served at once; more are closed at once.
            max_probe_bytes: The largest throughput probe accepted.
        """
        self._listen = listen
        self._io_timeout_s = io_timeout_s
        self._max_connections = max_connections
        self._max_probe_bytes = max_probe_bytes
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        """Bind and serve; return the bound address as ``host:port``."""
        host, port = split_endpoint(self._listen)
        self._server = await asyncio.start_server(self._handle, host or None, port)
        bound_host, bound_port = self._server.sockets[0].getsockname()[:2]
        return join_endpoint(str(bound_host), int(bound_port))

    async def close(self) -> None:
        """Stop listening and drop every open connection."""
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._writers):
            writer.close()
        await self._server.wait_closed()
        self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._writers) >= self._max_connections:
            log.warning("probe_connection_refused", reason="too many connections")
            writer.close()
            return
        self._writers.add(writer)
        try:
            await self._serve(reader, writer)
        except (TimeoutError, OSError, asyncio.IncompleteReadError):
            pass  # a peer that goes silent or away simply loses its connection
        finally:
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            async with asyncio.timeout(self._io_timeout_s):
                op = await reader.read(1)
            if op == PING:
                writer.write(PING)
            elif op == THROUGHPUT:
                async with asyncio.timeout(self._io_timeout_s):
                    length = int.from_bytes(await reader.readexactly(8), "big")
                if length > self._max_probe_bytes:
                    log.warning("probe_refused", reason="too large", length=length)
                    return
                await self._discard(reader, length)
                writer.write(ACK)
            else:
                if op:  # empty means the peer closed: nothing to report
                    log.warning("probe_refused", reason="unknown request", byte=op.hex())
                return
            async with asyncio.timeout(self._io_timeout_s):
                await writer.drain()

    async def _discard(self, reader: asyncio.StreamReader, length: int) -> None:
        remaining = length
        while remaining:
            async with asyncio.timeout(self._io_timeout_s):
                chunk = await reader.read(min(remaining, CHUNK_BYTES))
            if not chunk:
                raise asyncio.IncompleteReadError(b"", remaining)
            remaining -= len(chunk)


# The client ------------------------------------------------------------------------------


async def measure_link(
    endpoint: str, *, payload_bytes: int, pings: int = 5, timeout_s: float
) -> Measurement:
    """Measure the link to the probe server at ``endpoint`` over one connection.

    Args:
        endpoint: The peer's probe endpoint, ``host:port``.
        payload_bytes: Size of the throughput probe; larger is more accurate and slower.
        pings: How many pings to take the median of.
        timeout_s: Deadline for the whole measurement.

    Returns:
        The median ping round trip and the throughput of one probe.

    Raises:
        LinkProbeError: when the peer is unreachable, refuses, answers wrongly or is too slow.
        ValueError: when ``payload_bytes`` or ``pings`` is out of range.
    """
    if not 0 < payload_bytes <= MAX_PROBE_BYTES:
        raise ValueError(f"payload_bytes must be in 1..{MAX_PROBE_BYTES}, not {payload_bytes}")
    if pings < 1:
        raise ValueError(f"pings must be at least 1, not {pings}")
    try:
        host, port = split_endpoint(endpoint)
    except ValueError as err:
        raise LinkProbeError(str(err)) from None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                rtt_s = await _pings(reader, writer, pings)
                elapsed_s = await _throughput(reader, writer, payload_bytes)
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except TimeoutError:
        raise LinkProbeError(f"{endpoint}: no answer within {timeout_s:g}s") from None
    except asyncio.IncompleteReadError:
        raise LinkProbeError(f"{endpoint}: the peer closed the connection") from None
    except OSError as err:
        raise LinkProbeError(f"{endpoint}: {err.strerror or err}") from None
    return Measurement(
        rtt_ms=rtt_s * 1e3,
        bandwidth_mbps=payload_bytes * 8 / elapsed_s / 1e6,
        measured_at=time.time(),
    )


async def _pings(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, count: int) -> float:
    rtts: list[float] = []
    for _ in range(count):
        start = time.perf_counter()
        writer.write(PING)
        await writer.drain()
        if await reader.readexactly(1) != PING:
            raise LinkProbeError("the peer answered a ping wrongly")
        rtts.append(time.perf_counter() - start)
    return statistics.median(rtts)


async def _throughput(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload_bytes: int
) -> float:
    zeros = memoryview(bytes(CHUNK_BYTES))
    start = time.perf_counter()
    writer.write(THROUGHPUT + payload_bytes.to_bytes(8, "big"))
    remaining = payload_bytes
    while remaining:
        n = min(remaining, CHUNK_BYTES)
        writer.write(zeros[:n])
        await writer.drain()
        remaining -= n
    if await reader.readexactly(1) != ACK:
        raise LinkProbeError("the peer answered a throughput probe wrongly")
    # perf_counter always advances over a network round trip; the floor only guards a zero.
    return max(time.perf_counter() - start, 1e-9)
