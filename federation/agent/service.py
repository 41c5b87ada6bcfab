"""What a site keeps for a service task's replicas: their backoff and crash-loop state (by
``federation.service_policy.RestartPolicy``), the readiness checks, each replica's port, and
the endpoints it reports.

Restarts are the agent's: while no agent runs (stopped on purpose, its replicas left to the
next one), a replica that exits stays down; the next agent that adopts the task restarts it at
once, as a replica that ended meanwhile, and counts the restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from federation.agent.accounts import Account
from federation.api.v1 import jobs_pb2

DEFAULT_PERIOD_S = 1.0
DEFAULT_CHECK_TIMEOUT_S = 1.0


def is_service(spec: jobs_pb2.TaskSpec) -> bool:
    return spec.kind == jobs_pb2.TASK_KIND_SERVICE


@dataclass(slots=True)
class ReplicaService:
    """One replica of a service as its agent keeps it."""

    port: int
    restarts: int = 0
    revision: int = 0
    """The revision of the task's spec it was last started with."""
    short_runs: int = 0
    """Runs in a row shorter than min_run_s."""
    ready: bool = False
    checked: bool = False
    """Its readiness is known since it last started (a check answered, or it exited): an
    adopted replica is not taken for one that is down until then."""
    down: bool = False
    """It exited 0 under restart on_failure: it stays down."""
    load: float = 0.0
    """Its last load reading (autoscaled services)."""
    draining: bool = False
    """Being taken away: shown not ready, stopped once its load reads 0."""

    @classmethod
    def new(cls, spec: jobs_pb2.TaskSpec, revision: int) -> ReplicaService:
        """A replica of ``spec`` not started yet: on the service's fixed port, or on a free
        one."""
        return cls(spec.service.port or free_port(), revision=revision)


def free_port() -> int:
    """A TCP port no one listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


async def is_ready(
    check: jobs_pb2.ReadinessCheck,
    *,
    address: str,
    port: int,
    env: Mapping[str, str],
    cwd: Path,
    account: Account | None,
) -> bool:
    """Runs one readiness check of a replica; a check that takes over its timeout fails."""
    timeout_s = check.timeout_s or DEFAULT_CHECK_TIMEOUT_S
    kind = check.WhichOneof("check")
    try:
        if kind == "tcp_port":
            return await asyncio.wait_for(_connects(address, check.tcp_port), timeout_s)
        if kind == "http_path":
            return await asyncio.wait_for(_http_ok(address, port, check.http_path), timeout_s)
        if kind == "command":
            return await _command_ok(list(check.command.argv), env, cwd, account, timeout_s)
    except (OSError, TimeoutError, ValueError):
        return False
    return True  # no check: ready once it runs


async def _connects(address: str, port: int) -> bool:
    _, writer = await asyncio.open_connection(address, port)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def _http_ok(address: str, port: int, path: str) -> bool:
    return (await _http_get(address, port, path, read_body=False)) is not None


MAX_LOAD_ANSWER_BYTES = 64 * 1024


async def _http_get(address: str, port: int, path: str, *, read_body: bool) -> bytes | None:
    """The body of a 2xx answer to GET ``path`` (empty unless ``read_body``; at most
    MAX_LOAD_ANSWER_BYTES), or None for any other status."""
    reader, writer = await asyncio.open_connection(address, port)
    try:
        host = f"[{address}]" if ":" in address else address
        writer.write(
            f"GET {path} HTTP/1.0\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode()
        )
        await writer.drain()
        status = (await reader.readline()).split()
        if not (len(status) >= 2 and status[0].startswith(b"HTTP/") and status[1][:1] == b"2"):
            return None
        if not read_body:
            return b""
        while (await reader.readline()).strip():
            pass  # the headers
        return await reader.read(MAX_LOAD_ANSWER_BYTES)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def read_load(
    scale: jobs_pb2.Autoscale, *, address: str, port: int, timeout_s: float
) -> float | None:
    """A replica's load from its load path, or None where it did not answer one."""
    try:
        body = await asyncio.wait_for(
            _http_get(address, port, scale.load_path, read_body=True), timeout_s
        )
    except (OSError, TimeoutError, ValueError):
        return None
    if body is None:
        return None
    return parse_load(body.decode(errors="replace"), scale.load_metric)


def parse_load(text: str, metric: str) -> float | None:
    """A number alone (``metric`` empty), or the sum of ``metric``'s samples in Prometheus
    text; None where there is no such number."""
    try:
        if not metric:
            value = float(text.strip())
        else:
            samples = [_sample(line, metric) for line in text.splitlines()]
            found = [v for v in samples if v is not None]
            if not found:
                return None
            value = sum(found)
    except ValueError:
        return None
    return value if value >= 0 and value != float("inf") else None


def _sample(line: str, metric: str) -> float | None:
    """The value of a Prometheus sample line of ``metric`` (any labels), else None."""
    if not line.startswith(metric) or line.startswith("#"):
        return None
    rest = line[len(metric) :]
    if rest.startswith("{"):
        rest = rest[rest.index("}") + 1 :]  # labels; a "}" inside a label value is not met here
    elif not rest[:1].isspace():
        return None  # another metric whose name starts with this one
    value = rest.split()[:1]
    return float(value[0]) if value else None


async def _command_ok(
    argv: list[str],
    env: Mapping[str, str],
    cwd: Path,
    account: Account | None,
    timeout_s: float,
) -> bool:
    """The check's command, beside the replica: its environment and folder, as its account."""
    owner: dict[str, object] = (
        {"user": account.uid, "group": account.gid, "extra_groups": []}
        if account is not None
        else {}
    )
    process = await asyncio.create_subprocess_exec(
        *argv,
        cwd=cwd,
        env=dict(env),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,
        **owner,  # type: ignore[arg-type]
    )
    try:
        return await asyncio.wait_for(process.wait(), timeout_s) == 0
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        raise
