"""What a site keeps for a service task's replicas: the restart policy with its backoff and
crash-loop state, the readiness checks, each replica's port, and the endpoints it reports.

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

DEFAULT_BACKOFF_S = 1.0
DEFAULT_MAX_BACKOFF_S = 300.0
DEFAULT_MIN_RUN_S = 10.0
DEFAULT_CRASH_LOOP_AFTER = 5
DEFAULT_PERIOD_S = 1.0
DEFAULT_CHECK_TIMEOUT_S = 1.0


def is_service(spec: jobs_pb2.TaskSpec) -> bool:
    return spec.kind == jobs_pb2.TASK_KIND_SERVICE


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """A service's restart policy with the defaults the API names filled in."""

    always: bool
    backoff_s: float
    max_backoff_s: float
    min_run_s: float
    crash_loop_after: int

    @classmethod
    def of(cls, policy: jobs_pb2.ServicePolicy) -> RestartPolicy:
        return cls(
            always=policy.restart != jobs_pb2.ServicePolicy.RESTART_ON_FAILURE,
            backoff_s=policy.backoff_s or DEFAULT_BACKOFF_S,
            max_backoff_s=policy.max_backoff_s or DEFAULT_MAX_BACKOFF_S,
            min_run_s=policy.min_run_s or DEFAULT_MIN_RUN_S,
            crash_loop_after=policy.crash_loop_after or DEFAULT_CRASH_LOOP_AFTER,
        )

    def restarts(self, returncode: int) -> bool:
        """Whether a replica that ended with ``returncode`` is started again."""
        return self.always or returncode != 0

    def crash_looping(self, short_runs: int) -> bool:
        return short_runs >= self.crash_loop_after

    def delay_s(self, short_runs: int) -> float:
        """The wait before a restart that follows ``short_runs`` short runs in a row: the
        backoff, doubled for each short run after the first, at most max_backoff_s; the
        longest once the replica is crash-looping."""
        if self.crash_looping(short_runs):
            return self.max_backoff_s
        return min(self.backoff_s * 2.0 ** max(0, short_runs - 1), self.max_backoff_s)


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
    down: bool = False
    """It exited 0 under restart on_failure: it stays down."""


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
    reader, writer = await asyncio.open_connection(address, port)
    try:
        host = f"[{address}]" if ":" in address else address
        writer.write(
            f"GET {path} HTTP/1.0\r\nHost: {host}:{port}\r\nConnection: close\r\n\r\n".encode()
        )
        await writer.drain()
        status = (await reader.readline()).split()
        return len(status) >= 2 and status[0].startswith(b"HTTP/") and status[1][:1] == b"2"
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


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
