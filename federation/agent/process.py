"""One replica of a task, run as a real child process in its own process group."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog

from federation.agent.accounts import Account

log = structlog.get_logger()

TAIL_BYTES = 4096
_READ_CHUNK = 64 * 1024
# After the leader exits, how long to let the reader drain what is left in the pipe.
_DRAIN_S = 1.0


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


# Runs in the child before the task's program: take the task's account (no supplementary
# groups: the agent's would let the task read what they may), make new files private, ask Linux
# for SIGKILL when the agent dies (PR_SET_PDEATHSIG survives exec but not a change of user, so
# it comes after), then become the program. A crashed agent must leave no task behind: the
# coordinator places a restarted agent's tasks again, and a leftover copy would run them twice.
# The agent never forks with user=/preexec_fn: forking a process that runs gRPC threads aborts,
# and CPython uses vfork only when the child switches no user.
_LAUNCHER = """
import ctypes, os, signal, sys
agent, uid, gid = (int(arg) for arg in sys.argv[1:4])
try:
    if uid >= 0:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
except OSError as err:
    print(f"cannot run as uid {uid}: {err.strerror}", file=sys.stderr)
    os._exit(126)
os.umask(0o077)
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
if os.getppid() != agent:
    os._exit(137)
try:
    os.execv(sys.argv[4], sys.argv[5:])
except OSError as err:
    print(f"cannot start {sys.argv[5]}: {err.strerror}", file=sys.stderr)
    os._exit(126)
"""


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


def _launch_argv(
    argv: Sequence[str], cwd: Path, env: Mapping[str, str], account: Account | None
) -> list[str]:
    if not cwd.is_dir():
        raise ReplicaStartError(f"working directory not found: {cwd}", 126)
    if sys.platform != "linux":
        if account is not None:
            raise ReplicaStartError("task accounts need Linux", 126)
        return list(argv)
    program = _resolve(argv[0], cwd, env)
    uid, gid = (account.uid, account.gid) if account is not None else (-1, -1)
    ids = [str(os.getpid()), str(uid), str(gid)]
    return [sys.executable, "-I", "-S", "-c", _LAUNCHER, *ids, program, *argv]


class ReplicaProcess:
    """A running replica: its exit code, the tail of its output, and a way to stop it.

    The replica is the leader of a new session, so signals reach everything it started. Its
    lifetime is its process group's: when the leader exits, stragglers it left behind are killed
    (as a batch scheduler does), which also closes the output pipe they would hold open.
    """

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        """Watches an already started process; use ``start`` to create one."""
        self._proc = proc
        self._tail = bytearray()
        self._reader = asyncio.create_task(self._read_output())
        self._pidfd: int | None = None
        self._leader_gone = False
        """The leader exited (seen on its pidfd): its output may still be draining."""
        self._watch_leader()
        self._done = asyncio.create_task(self._run())

    @classmethod
    async def start(
        cls,
        argv: Sequence[str],
        *,
        cwd: Path,
        env: Mapping[str, str],
        account: Account | None = None,
    ) -> ReplicaProcess:
        """Starts ``argv`` in ``cwd`` with exactly ``env``, as ``account`` when given.

        Raises:
            ReplicaStartError: The program is missing, not executable, or cannot be started.
        """
        if not argv or not argv[0]:
            raise ReplicaStartError("empty command", 127)
        if account is not None:
            home = account.home or str(cwd)  # an allocated uid has no home of its own
            env = {**env, "HOME": home, "USER": account.name, "LOGNAME": account.name}
        launch = _launch_argv(argv, cwd, env, account)
        try:
            proc = await asyncio.create_subprocess_exec(
                *launch,
                cwd=cwd,
                env=dict(env),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        except FileNotFoundError as exc:
            if exc.filename is not None and Path(exc.filename) == cwd:
                raise ReplicaStartError(f"working directory not found: {cwd}", 126) from exc
            raise ReplicaStartError(f"command not found: {argv[0]}", 127) from exc
        except PermissionError as exc:
            raise ReplicaStartError(f"permission denied: {argv[0]}", 126) from exc
        except (OSError, ValueError) as exc:  # ValueError: a NUL byte or '=' in a name
            message = getattr(exc, "strerror", None) or exc
            raise ReplicaStartError(f"cannot start {argv[0]}: {message}", 126) from exc
        log.debug("replica_started", pid=proc.pid, argv=list(argv), cwd=str(cwd))
        return cls(proc)

    @property
    def pid(self) -> int:
        """Process id of the leader, which is also its process group id."""
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        """Exit code once the leader has exited (negative: killed by that signal)."""
        return self._proc.returncode

    @property
    def exited(self) -> bool:
        """Whether the leader has exited (its output may still be draining)."""
        return self._leader_gone or self._proc.returncode is not None

    @property
    def output_tail(self) -> str:
        """The last 4 KiB of stdout and stderr together, decoded leniently."""
        return self._tail.decode("utf-8", errors="replace")

    async def wait(self) -> int:
        """Waits for the replica to exit; returns its exit code (negative: killed by signal)."""
        return await asyncio.shield(self._done)

    async def terminate(self, grace_s: float) -> bool:
        """Sends SIGTERM to the process group, then SIGKILL if it outlives ``grace_s``.
        Returns whether it had to: False when the leader had already exited by itself."""
        if self._done.done():
            return False
        if self.exited:
            await asyncio.shield(self._done)  # its stragglers are killed; output drains
            return False
        self._signal_group(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(self._done), timeout=grace_s)
        except TimeoutError:
            log.info("replica_killed", pid=self.pid, grace_s=grace_s)
            self._signal_group(signal.SIGKILL)
            await asyncio.shield(self._done)
        return True

    def _signal_group(self, sig: signal.Signals) -> None:
        # The group may already be gone; that is the outcome we wanted.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    def _watch_leader(self) -> None:
        """Kills stragglers as soon as the leader exits.

        ``Process.wait()`` also waits for the output pipe to close, which a straggler keeps open,
        so the leader's exit is watched on a pidfd (Linux). Elsewhere stragglers are killed only
        when the pipe closes or the replica is terminated.
        """
        try:
            self._pidfd = os.pidfd_open(self._proc.pid)
        except ProcessLookupError:  # already exited
            self._signal_group(signal.SIGKILL)
            return
        except (AttributeError, OSError):
            return
        asyncio.get_running_loop().add_reader(self._pidfd, self._leader_exited)

    def _leader_exited(self) -> None:
        self._leader_gone = True
        self._unwatch_leader()
        self._signal_group(signal.SIGKILL)

    def _unwatch_leader(self) -> None:
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    async def _read_output(self) -> None:
        stream = self._proc.stdout
        assert stream is not None  # stdout=PIPE
        while chunk := await stream.read(_READ_CHUNK):
            self._tail += chunk
            del self._tail[:-TAIL_BYTES]

    async def _run(self) -> int:
        returncode = await self._proc.wait()
        self._unwatch_leader()
        self._signal_group(signal.SIGKILL)
        try:
            await asyncio.wait_for(asyncio.shield(self._reader), timeout=_DRAIN_S)
        except TimeoutError:
            # A straggler in another session still holds the pipe; stop reading from it.
            self._reader.cancel()
        log.debug("replica_exited", pid=self.pid, returncode=returncode)
        return returncode
