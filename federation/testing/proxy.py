"""A TCP proxy that can be paused: a silent partition between one agent and its coordinator.

Paused, it stops forwarding on open connections (only missed heartbeats reveal the cut) and
closes new ones at once; healed, it forwards again. Its target can change while it runs, so one
agent can follow a new leader through it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class PausableProxy:
    """Forwards TCP connections to ``target_port``; ``pause`` cuts them off without closing them."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        """Where new connections go; set it to follow another server."""
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def pause(self) -> None:
        """Stop forwarding on open connections and refuse new ones."""
        self._flowing.clear()

    def heal(self) -> None:
        """Forward again, what was held back included."""
        self._flowing.set()

    def cut(self) -> None:
        """End every open connection at once, with whatever it holds back: a partition that
        ends in broken connections, so what was sent into it never arrives."""
        for pump in list(self._pumps):
            pump.cancel()

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._flowing.is_set():
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            pump = asyncio.create_task(self._pump(source, sink))
            self._pumps.add(pump)
            pump.add_done_callback(self._pumps.discard)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._flowing.wait()
                data = await source.read(65536)
                if not data:
                    break
                await self._flowing.wait()  # data read as the pause began is held, not lost
                sink.write(data)
                await sink.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            sink.transport.abort()


@contextlib.asynccontextmanager
async def proxy_to(port: int) -> AsyncIterator[PausableProxy]:
    """A started proxy to ``port`` on loopback, closed on exit."""
    proxy = PausableProxy(port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.close()
