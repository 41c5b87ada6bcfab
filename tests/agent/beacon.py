"""A local TCP listener that test children report to, so tests wait on events, not sleeps."""

from __future__ import annotations

import asyncio


class Beacon:
    """A local TCP listener children report to, so tests wait on events instead of sleeping."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._arrived = asyncio.Event()
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async for line in reader:
            self.lines.append(line.decode().strip())
            self._arrived.set()
        writer.close()

    async def expect(self, prefix: str, timeout_s: float = 10.0) -> str:
        async with asyncio.timeout(timeout_s):
            while True:
                for line in self.lines:
                    if line.startswith(prefix):
                        return line
                self._arrived.clear()
                await self._arrived.wait()

    def child(self, body: str) -> str:
        """Python source for a child: ``body`` with ``send(msg)`` reporting to this beacon."""
        return (
            "import socket\n"
            "def send(msg):\n"
            f"    with socket.create_connection(('127.0.0.1', {self.port})) as s:\n"
            "        s.sendall(msg.encode() + b'\\n')\n"
        ) + body
