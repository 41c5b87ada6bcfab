"""The agent's spawner: one small process (``supervisor.serve``) that forks a supervisor per
replica, which shares the spawner's interpreter instead of starting one of its own.

Started at the agent's first replica and again whenever it has ended; it ends with the agent
(its stdin closes). Starts take turns only for the fork: the agent takes the supervisor's
pidfd before it lets it go, and each supervisor answers on its own line as soon as its replica
runs, so a slow start (an exec on a hung filesystem) holds up no other.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from federation.agent import supervisor
from federation.agent.supervisor import process_start

ANSWER_TIMEOUT_S = 30.0
"""How long the spawner may take to fork a supervisor, and a supervisor to start its replica
and say so."""
_BOOT = "import sys; sys.path.insert(0, sys.argv.pop(1)); import supervisor; supervisor.serve()"
"""Runs the spawner from the supervisor's compiled module: as a script it would be compiled at
its start, and every supervisor it forks would hold that."""
_SUPERVISOR_DIR = os.path.dirname(supervisor.__file__)


class SpawnError(Exception):
    """No supervisor was forked, or none can be let go: nothing runs."""


@dataclass(frozen=True, slots=True)
class Forked:
    """A supervisor forked and let go: the agent holds it by ``pidfd``."""

    pid: int
    start_ticks: int
    pidfd: int
    answer: concurrent.futures.Future[str | None]
    """Its answer (``ok PID`` or ``error CODE WHY``); None if it ended without one."""

    def kill(self) -> None:
        """SIGKILLs the supervisor: its replica dies with it (parent-death signal)."""
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)


class _Unstarted(Exception):
    """The spawner ended before the supervisor was let go: nothing started, try again."""


class _Channel:
    """One spawner process, and a thread that reads what it and its supervisors say."""

    def __init__(self) -> None:
        # Its own session, so that a terminal's signals to the agent miss it, and a clean
        # environment, as it runs as the agent's user: the task's goes to the replica only.
        # Started by vfork, never a fork of the gRPC-threaded agent.
        self.process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _BOOT, _SUPERVISOR_DIR],
            cwd="/",
            env={},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        assert self.process.stdin is not None
        self._requests = self.process.stdin.fileno()
        os.set_blocking(self._requests, False)  # a frozen spawner holds no start for ever
        self._forked: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._answers: dict[int, concurrent.futures.Future[str | None]] = {}
        """The supervisors let go, by pid, until they answer."""
        self._ended = False
        threading.Thread(target=self._read, name="spawner-reader", daemon=True).start()

    def alive(self) -> bool:
        return self.process.poll() is None

    def spawn(self, spec: bytes) -> Forked:
        """Has a supervisor forked for ``spec`` and lets it go. Raises _Unstarted if the
        spawner had ended, SpawnError if it failed otherwise (nothing runs either way)."""
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        try:
            self._send(b"%d\n%s" % (len(spec), spec), deadline)
        except BrokenPipeError:
            raise _Unstarted from None
        except TimeoutError as err:
            self.stop()
            raise SpawnError(str(err)) from None
        try:
            said = self._forked.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            self.stop()  # the supervisor it may have forked meanwhile is never let go
            raise SpawnError(
                f"the replica spawner did not fork in {ANSWER_TIMEOUT_S:.0f} s"
            ) from None
        if said is None:
            raise _Unstarted
        pid_text, ticks_text, why = [*said.split(" ", 2), "", ""][:3]
        pid, start_ticks = int(pid_text), int(ticks_text)
        if pid == 0:
            raise SpawnError(f"cannot fork a supervisor: {why}")
        try:
            pidfd = pidfd_of(pid, start_ticks)
        except OSError as err:
            self._let_go(False, deadline)
            raise SpawnError(f"cannot watch the supervisor: {err}") from None
        if pidfd is None:
            self._let_go(False, deadline)
            raise SpawnError("the supervisor ended as soon as it was forked")
        answer = self._expect(pid)
        try:
            self._let_go(True, deadline)
        except BaseException:
            os.close(pidfd)
            raise
        return Forked(pid, start_ticks, pidfd, answer)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()

    def _let_go(self, go: bool, deadline: float) -> None:
        try:
            self._send(b"g" if go else b"n", deadline)
        except (BrokenPipeError, TimeoutError):
            self.stop()  # it forgets what it forked: the supervisor gets no go, and ends
            if go:
                raise _Unstarted from None

    def _send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        poll = select.poll()
        poll.register(self._requests, select.POLLOUT)
        while view:
            left = deadline - time.monotonic()
            if left <= 0 or not poll.poll(left * 1000):
                raise TimeoutError("the replica spawner takes no request")
            view = view[os.write(self._requests, view) :]

    def _expect(self, pid: int) -> concurrent.futures.Future[str | None]:
        answer: concurrent.futures.Future[str | None] = concurrent.futures.Future()
        with self._lock:
            if self._ended:
                answer.set_result(None)
            else:
                self._answers[pid] = answer
        return answer

    def _read(self) -> None:
        """Until the spawner and every supervisor it let go have closed its output."""
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            head, _, rest = raw.decode(errors="replace").rstrip("\n").partition(" ")
            if head == "forked":
                self._forked.put(rest)
            elif head.isdigit():
                with self._lock:
                    answer = self._answers.pop(int(head), None)
                if answer is not None and answer.set_running_or_notify_cancel():
                    answer.set_result(rest)  # unless the start was given up
        with self._lock:
            self._ended = True
            unanswered, self._answers = self._answers, {}
        self._forked.put(None)
        for answer in unanswered.values():
            if answer.set_running_or_notify_cancel():
                answer.set_result(None)


class Spawner:
    """Forks supervisors through the agent's spawner, started when first needed."""

    def __init__(self) -> None:
        self._channel: _Channel | None = None
        # Forks take turns; a thread of its own, so none waits behind the agent's other work,
        # and one that ends before the interpreter does (a start given up at the agent's exit
        # still has its supervisor killed).
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spawner")

    def submit(self, spec: bytes) -> concurrent.futures.Future[Forked]:
        """Forks a supervisor for the launch ``spec`` and lets it go, in the spawner's thread.
        The future raises SpawnError if none could be."""
        return self._thread.submit(self._spawn, spec)

    def _spawn(self, spec: bytes) -> Forked:
        for _ in range(2):  # in the spawner's one thread
            if self._channel is None or not self._channel.alive():
                self._channel = _Channel()
            try:
                return self._channel.spawn(spec)
            except _Unstarted:
                continue  # it had ended: start another, once
        raise SpawnError("the replica spawner ended as soon as it started")


def pidfd_of(pid: int, start_ticks: int) -> int | None:
    """A pidfd of process ``pid`` if it is the one started at ``start_ticks``; else None."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return None
    try:
        started = process_start(pid)  # read once the pidfd holds whatever has the pid
    except OSError:
        os.close(pidfd)
        raise
    if started != start_ticks:
        os.close(pidfd)
        return None
    return pidfd


SPAWNER = Spawner()
