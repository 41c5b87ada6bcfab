"""One replica of a task, run by a supervisor process that outlives the agent.

The supervisor (``federation.agent.supervisor``), forked by the agent's spawner, starts the
replica as the leader of a new session, as the task's account, keeps its output tail and exit
status in files of the replica's run folder, and goes on when the agent stops: a restarted agent
adopts it by its pid and start time (``ReplicaProcess.adopt``), or reads how the replica ended
from those files.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import marshal
import os
import shutil
import signal
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from federation.agent.accounts import Account
from federation.agent.spawner import (
    ANSWER_TIMEOUT_S,
    SPAWNER,
    SpawnError,
    answer_of,
    has_exited,
    pidfd_of,
)
from federation.agent.supervisor import TAIL_BYTES as TAIL_BYTES
from federation.agent.supervisor import process_start
from federation.agent.task_logs import LOG_BYTES, LOG_FILE

log = structlog.get_logger()

OUTPUT_FILE = "output"
EXIT_FILE = "exit"


def describe_exit(returncode: int) -> str:
    """E.g. ``"exited with 3"`` or ``"was killed by SIGKILL"``."""
    if returncode >= 0:
        return f"exited with {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"was killed by {name}"


class ReplicaStartError(Exception):
    """The replica's program could not be started; ``exit_code`` follows shell conventions."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True, slots=True)
class ReplicaExit:
    """How a replica ended, as its supervisor recorded it."""

    returncode: int
    """Its exit code (negative: killed by that signal)."""
    stopped: bool = False
    """It was signalled to stop while it ran."""
    why: str = ""
    """Why the supervisor ended it on its own ("agent_died": its agent crashed), or why its
    end is not known; "" when it ended by itself or on the agent's stop."""


def _resolve(program: str, cwd: Path, env: Mapping[str, str]) -> str:
    """The file ``program`` names, as exec would find it; ReplicaStartError when it cannot."""
    if "/" in program:
        path = cwd / program
        if not path.is_file():
            raise ReplicaStartError(f"command not found: {program}", 127)
    else:
        found = shutil.which(program, mode=os.F_OK, path=env.get("PATH", os.defpath))
        if found is None:
            raise ReplicaStartError(f"command not found: {program}", 127)
        path = Path(found)
    if not os.access(path, os.X_OK):
        raise ReplicaStartError(f"permission denied: {program}", 126)
    return str(path)


class ReplicaProcess:
    """A replica under its supervisor: its exit code, the tail of its output, a way to stop it.

    The replica leads its own session, so signals reach everything it started; when it exits,
    stragglers it left behind are killed (as a batch scheduler does). ``pid`` and
    ``start_ticks`` name the supervisor for good: recorded, they let a later agent adopt it.
    """

    def __init__(
        self,
        pid: int,
        start_ticks: int,
        pidfd: int | None,
        run_dir: Path,
    ) -> None:
        """Watches a supervisor through ``pidfd`` (None: it is gone); use ``start`` or
        ``adopt``."""
        self.pid = pid
        self.start_ticks = start_ticks
        self.run_dir = run_dir
        self._pidfd = pidfd
        self._ended: ReplicaExit | None = None
        self._tail = ""
        self._done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.after_exit: Callable[[], Awaitable[None]] | None = None
        """Run once the supervisor has exited, before ``wait`` returns (set it before the
        next await after ``start`` or ``adopt``): what the replica leaves outside its
        supervisor's reach, a container, is cleaned up before its end is known."""
        self._cleanup: asyncio.Future[None] | None = None
        if pidfd is None:
            self._supervisor_exited()
        else:
            asyncio.get_running_loop().add_reader(pidfd, self._supervisor_exited)

    @classmethod
    async def start(
        cls,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str],
        run_dir: Path,
        account: Account | None = None,
        grace_s: float = 5.0,
        owner: Path | None = None,
    ) -> ReplicaProcess:
        """Starts ``argv`` in ``cwd`` with exactly ``env``, as ``account`` when given.

        Args:
            run_dir: The agent's folder for the supervisor's files (created if missing).
            grace_s: Between SIGTERM and SIGKILL when the supervisor is told to stop it.
            owner: The file naming the agent that owns the replica (see ``supervisor``); None:
                the replica dies with this process.

        Raises:
            ReplicaStartError: The program is missing, not executable, or cannot be started.
        """
        if not argv or not argv[0]:
            raise ReplicaStartError("empty command", 127)
        if account is not None:
            home = account.home or str(cwd)  # an allocated uid has no home of its own
            env = {**env, "HOME": home, "USER": account.name, "LOGNAME": account.name}
        spec = _spec(argv, cwd, env, run_dir, account, grace_s, owner)
        forking = SPAWNER.submit(spec)
        try:
            forked = await asyncio.wrap_future(forking.future)
        except SpawnError as err:
            raise ReplicaStartError(str(err), 126) from None
        except BaseException:  # given up (the agent is going, say): nothing is let go, and
            forking.give_up()  # what was meanwhile is stopped, in the spawner's thread
            raise
        try:
            answer = await answer_of(forked)
        except TimeoutError:
            forked.abandon()
            raise ReplicaStartError(
                f"the supervisor did not answer in {ANSWER_TIMEOUT_S:.0f} s", 126
            ) from None
        except BaseException:
            forked.abandon()
            raise
        if answer is None or not answer.startswith("ok "):
            os.close(forked.pidfd)  # it has ended, or ends now, having started nothing
            _, code, message = [*(answer or "").split(" ", 2), "", ""][:3]
            why = message or "the supervisor ended without answering"
            raise ReplicaStartError(why, int(code) if code.isdigit() else 126)
        log.debug("replica_started", supervisor=forked.pid, pid=answer[3:], argv=list(argv))
        return cls(forked.pid, forked.start_ticks, forked.pidfd, run_dir)

    @classmethod
    def adopt(cls, pid: int, start_ticks: int, run_dir: Path) -> ReplicaProcess:
        """The replica a supervisor started by an earlier agent runs, if that supervisor
        (``pid``, started at ``start_ticks``) still runs; else how it ended, from its files.
        A pid now held by another process is never taken for it."""
        pidfd = pidfd_of(pid, start_ticks)
        if pidfd is not None and (has_exited(pidfd) or (run_dir / EXIT_FILE).exists()):
            # It has exited already (a zombie its new parent has not reaped), or it is exiting:
            # the exit file is the last thing it writes, and a fresh start removes it. How the
            # replica ended is known now, for the adopting agent to decide on.
            os.close(pidfd)
            pidfd = None
        return cls(pid, start_ticks, pidfd, run_dir)

    @property
    def returncode(self) -> int | None:
        """Exit code once the replica has ended (negative: killed by that signal)."""
        return self._ended.returncode if self._ended is not None else None

    @property
    def ended(self) -> ReplicaExit | None:
        """How it ended, once it has."""
        return self._ended

    @property
    def exited(self) -> bool:
        """Whether the replica has ended and its supervisor has recorded it."""
        return self._ended is not None

    @property
    def output_tail(self) -> str:
        """The last 4 KiB of stdout and stderr together, decoded leniently."""
        return self._tail if self._ended is not None else _read_tail(self.run_dir)

    async def wait(self) -> int:
        """Waits for the replica to end; returns its exit code (negative: killed by signal)."""
        return await asyncio.shield(self._done)

    async def terminate(self, grace_s: float) -> bool:
        """Has the supervisor send SIGTERM to the process group, then SIGKILL if it outlives
        ``grace_s``. Returns whether it had to: False when the replica had ended by itself.
        The supervisor also kills on its own after the ``grace_s`` it was started with, so the
        shorter of the two applies."""
        if self._ended is None:
            self._signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(self._done), timeout=grace_s)
            except TimeoutError:
                log.info("replica_killed", supervisor=self.pid, grace_s=grace_s)
                self._signal(signal.SIGUSR1)
        await asyncio.shield(self._done)  # and its ``after_exit``
        assert self._ended is not None
        return self._ended.stopped

    def kill(self) -> None:
        """Has the supervisor SIGKILL the replica's process group now; ``wait`` for the end."""
        self._signal(signal.SIGUSR1)

    def claim(self) -> None:
        """Tells an adopted supervisor that the agent the owner file names now owns it."""
        self._signal(signal.SIGUSR2)

    def _signal(self, sig: signal.Signals) -> None:
        # Through the pidfd: a supervisor that has exited meanwhile is never mistaken for
        # whatever process took its pid.
        if self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def _supervisor_exited(self) -> None:
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        self._ended = _read_exit(self.run_dir, self.pid)
        self._tail = _read_tail(self.run_dir)
        log.debug("replica_exited", supervisor=self.pid, returncode=self._ended.returncode)
        if self.after_exit is None:
            self._done.set_result(self._ended.returncode)
        else:
            self._cleanup = asyncio.ensure_future(self._clean_up(self.after_exit))

    async def _clean_up(self, after_exit: Callable[[], Awaitable[None]]) -> None:
        assert self._ended is not None
        try:
            await after_exit()
        except Exception:
            log.exception("replica_cleanup_failed", supervisor=self.pid)
        self._done.set_result(self._ended.returncode)


def _spec(
    argv: Sequence[str],
    cwd: Path,
    env: Mapping[str, str],
    run_dir: Path,
    account: Account | None,
    grace_s: float,
    owner: Path | None,
) -> bytes:
    """The launch spec of a supervisor for ``argv``, for the spawner."""
    if sys.platform != "linux":
        raise ReplicaStartError("tasks run only on Linux (pidfds, /proc)", 126)
    if not cwd.is_dir():
        raise ReplicaStartError(f"working directory not found: {cwd}", 126)
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    for name in (OUTPUT_FILE, EXIT_FILE):  # a supervisor that dies unheard leaves neither
        (run_dir / name).unlink(missing_ok=True)
    spec = {
        "argv": list(argv),
        "program": _resolve(argv[0], cwd, env),
        "cwd": str(cwd),
        "env": dict(env),
        "uid": account.uid if account is not None else -1,
        "gid": account.gid if account is not None else -1,
        "grace_s": grace_s,
        "agent_pid": os.getpid(),
        "agent_start": process_start(os.getpid()),
        "owner": str(owner) if owner is not None else "",
        "output": str(run_dir / OUTPUT_FILE),
        "exit": str(run_dir / EXIT_FILE),
        "log": str(run_dir / LOG_FILE),
        "log_bytes": LOG_BYTES,
    }
    return marshal.dumps(spec)


def _read_tail(run_dir: Path) -> str:
    try:
        return (run_dir / OUTPUT_FILE).read_bytes()[-TAIL_BYTES:].decode(errors="replace")
    except OSError:
        return ""


def _read_exit(run_dir: Path, pid: int) -> ReplicaExit:
    """What the supervisor recorded; a replica whose supervisor left no record was killed
    with it (the replica's parent-death signal)."""
    try:
        status = json.loads((run_dir / EXIT_FILE).read_bytes())
        return ReplicaExit(int(status["returncode"]), bool(status["stopped"]), str(status["why"]))
    except (OSError, ValueError, KeyError, TypeError):
        why = f"its supervisor (pid {pid}) ended without recording how the replica ended"
        return ReplicaExit(-signal.SIGKILL, False, why)
