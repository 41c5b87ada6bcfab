"""The agent's spawner: one small process (``supervisor.serve``) that forks a supervisor per
replica, which shares the spawner's interpreter instead of starting one of its own.

Started at the agent's first replica and again whenever it has ended; it ends with the agent
(its stdin closes). Starts take turns only for the fork: the agent takes the supervisor's
pidfd before it lets it go, and each supervisor answers on its own line as soon as its replica
runs, so a slow start (an exec on a hung filesystem) holds up no other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import select
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from federation.agent import supervisor
from federation.agent.supervisor import process_start

ANSWER_TIMEOUT_S = 30.0
"""How long the spawner may take to fork a supervisor, and a supervisor to start its replica
and say so."""
_ANSWER_AFTER_EXIT_S = 5.0
"""How long an answer may trail its supervisor's exit (the reader thread may be behind)."""
_STOP_GRACE_S = 2.0
"""How long a supervisor told to stop a given-up start has before it is killed."""
_BOOT = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); import supervisor; "
    "supervisor.serve(int(sys.argv[1]))"
)
"""Runs the spawner from the supervisor's compiled module: as a script it would be compiled at
its start, and every supervisor it forks would hold that."""
_SUPERVISOR_DIR = os.path.dirname(supervisor.__file__)


class SpawnError(Exception):
    """No supervisor was forked, or none can be let go: nothing runs."""


@dataclass(frozen=True, slots=True)
class Forked:
    """A supervisor forked and let go: the agent holds it by ``pidfd`` (closed by ``abandon``,
    or by whoever takes it on)."""

    pid: int
    start_ticks: int
    pidfd: int
    answer: concurrent.futures.Future[str | None]
    """Its answer (``ok PID`` or ``error CODE WHY``); None if it ended without one."""

    def abandon(self) -> None:
        """Its start is given up: the supervisor is told to kill its replica's whole group
        (SIGUSR1: one that has not started it yet starts nothing), and is killed if it has
        not ended ``_STOP_GRACE_S`` later (its replica with it: parent-death signal)."""
        self.answer.cancel()  # no answer is waited for any more
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self.pidfd, signal.SIGUSR1)
        overdue = threading.Timer(_STOP_GRACE_S, self._kill)
        overdue.daemon = True
        overdue.start()

    def _kill(self) -> None:
        if not has_exited(self.pidfd):
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
        os.close(self.pidfd)


async def answer_of(forked: Forked) -> str | None:
    """The supervisor's answer; None if it ended without one. Raises TimeoutError after
    ``ANSWER_TIMEOUT_S``."""
    loop = asyncio.get_running_loop()
    answer = asyncio.wrap_future(forked.answer)
    exited: asyncio.Future[None] = loop.create_future()

    def ended() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(forked.pidfd, ended)
    try:
        async with asyncio.timeout(ANSWER_TIMEOUT_S):
            either: list[asyncio.Future[Any]] = [answer, exited]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not answer.done():  # it has ended: an answer it gave is on its way
            await asyncio.wait([answer], timeout=_ANSWER_AFTER_EXIT_S)
    finally:
        loop.remove_reader(forked.pidfd)
        if not answer.done():
            answer.cancel()
    return answer.result() if not answer.cancelled() else None


class _Unstarted(Exception):
    """The spawner ended before the supervisor was let go: nothing started, try again."""


class _Channel:
    """One spawner process: its requests and what it says of its forks are its alone (it is
    gone once they close); the supervisors' answers come on a pipe they share, read by a
    thread."""

    def __init__(self) -> None:
        answers_r, answers_w = os.pipe2(os.O_CLOEXEC)
        try:
            # Its own session, so that a terminal's signals to the agent miss it, and a clean
            # environment, as it runs as the agent's user: the task's goes to the replica
            # only. Started by vfork, never a fork of the gRPC-threaded agent.
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _BOOT, _SUPERVISOR_DIR, str(answers_w)],
                cwd="/",
                env={},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=(answers_w,),
            )
        except BaseException:
            os.close(answers_r)
            raise
        finally:
            os.close(answers_w)
        try:
            self._watch(answers_r)
        except BaseException:
            self.stop()
            os.close(answers_r)
            raise

    def _watch(self, answers_r: int) -> None:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self._requests = self.process.stdin.fileno()
        self._said = self.process.stdout.fileno()
        for fd in (self._requests, self._said):
            os.set_blocking(fd, False)  # a frozen spawner holds no start for ever
        self._read = b""
        self._gone = False
        self._lock = threading.Lock()
        self._answers: dict[int, concurrent.futures.Future[str | None]] = {}
        """The supervisors let go, by pid, until they answer."""
        self._ended = False
        reader = threading.Thread(
            target=self._read_answers, args=(answers_r,), name="spawner-answers", daemon=True
        )
        reader.start()

    def alive(self) -> bool:
        return not self._gone and self.process.poll() is None

    def spawn(self, spec: bytes, given_up: threading.Event) -> Forked:
        """Has a supervisor forked for ``spec`` and lets it go, unless ``given_up`` is set by
        then. Raises _Unstarted if the spawner had ended, SpawnError if it failed otherwise
        (nothing runs either way)."""
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        try:
            self._send(b"%d\n%s" % (len(spec), spec), deadline)
            said = self._line(deadline)
        except BrokenPipeError:
            self._gone = True
            raise _Unstarted from None
        except TimeoutError:
            self.stop()  # the supervisor it may have forked meanwhile is never let go
            raise SpawnError(
                f"the replica spawner did not fork in {ANSWER_TIMEOUT_S:.0f} s"
            ) from None
        try:
            return self._let_go(said, deadline, given_up)
        except (_Unstarted, SpawnError):
            raise
        except Exception as err:  # unforeseen: nothing is let go, and the spawner is not reused
            self.stop()
            raise SpawnError(f"the replica spawner failed: {err!r}") from None

    def _let_go(self, said: str, deadline: float, given_up: threading.Event) -> Forked:
        pid_text, ticks_text, why = [*said.split(" ", 2), "", ""][:3]
        pid, start_ticks = int(pid_text), int(ticks_text)
        if pid == 0:
            raise SpawnError(f"cannot fork a supervisor: {why}")
        pidfd = answer = None
        try:
            pidfd = pidfd_of(pid, start_ticks)
            if pidfd is None:
                raise (
                    BrokenPipeError
                    if self._ended_now()
                    else SpawnError("the supervisor ended as soon as it was forked")
                )
            if given_up.is_set():
                self._send(b"n", deadline)
                raise SpawnError("given up")
            answer = self._expect(pid)
            self._send(b"g", deadline)
        except BaseException as err:
            if pidfd is not None:
                os.close(pidfd)
            if answer is not None:
                answer.cancel()
            if not isinstance(err, SpawnError):
                self.stop()  # the supervisor is never let go
            if isinstance(err, BrokenPipeError):
                raise _Unstarted from None  # it had ended
            raise
        return Forked(pid, start_ticks, pidfd, answer)

    def _ended_now(self) -> bool:
        """Whether the spawner has ended (its child, never let go, ended with it)."""
        try:
            self._line(time.monotonic() + 0.5)
        except BrokenPipeError:
            return True
        except TimeoutError:
            pass
        return False

    def stop(self) -> None:
        self._gone = True
        self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)  # one that cannot die (stuck in the kernel) is left behind

    def _send(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            self._wait(self._requests, select.POLLOUT, deadline)
            view = view[os.write(self._requests, view) :]

    def _line(self, deadline: float) -> str:
        """The spawner's next line. Raises BrokenPipeError if it has ended."""
        while b"\n" not in self._read:
            self._wait(self._said, select.POLLIN, deadline)
            chunk = os.read(self._said, 4096)
            if not chunk:
                self._gone = True
                raise BrokenPipeError("the replica spawner ended")
            self._read += chunk
        line, self._read = self._read.split(b"\n", 1)
        return line.decode(errors="replace")

    @staticmethod
    def _wait(fd: int, event: int, deadline: float) -> None:
        poll = select.poll()
        poll.register(fd, event)
        left = deadline - time.monotonic()
        if left <= 0 or not poll.poll(left * 1000):
            raise TimeoutError("the replica spawner did not answer")

    def _expect(self, pid: int) -> concurrent.futures.Future[str | None]:
        answer: concurrent.futures.Future[str | None] = concurrent.futures.Future()
        with self._lock:
            if self._ended:
                answer.set_result(None)
                return answer
            self._answers[pid] = answer

        def forget(done: concurrent.futures.Future[str | None]) -> None:
            with self._lock:  # given up before it answered
                if self._answers.get(pid) is done:
                    del self._answers[pid]

        answer.add_done_callback(forget)
        return answer

    def _read_answers(self, fd: int) -> None:
        """Until the spawner and every supervisor it let go have closed the answers pipe."""
        with open(fd, "rb") as answers:
            for raw in answers:
                pid, _, text = raw.decode(errors="replace").rstrip("\n").partition(" ")
                with self._lock:
                    answer = self._answers.pop(int(pid), None) if pid.isdigit() else None
                if answer is not None and answer.set_running_or_notify_cancel():
                    answer.set_result(text)
        with self._lock:
            self._ended = True
            unanswered, self._answers = self._answers, {}
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

    def submit(self, spec: bytes) -> Forking:
        """Forks a supervisor for the launch ``spec`` and lets it go, in the spawner's thread."""
        forking = Forking()
        forking.future = self._thread.submit(self._spawn, spec, forking.given_up)
        return forking

    def _spawn(self, spec: bytes, given_up: threading.Event) -> Forked:
        for _ in range(2):  # in the spawner's one thread
            if given_up.is_set():
                raise SpawnError("given up")
            if self._channel is None or not self._channel.alive():
                if self._channel is not None:
                    self._channel.stop()
                self._channel = None
                try:
                    self._channel = _Channel()
                except Exception as err:
                    raise SpawnError(f"cannot start the replica spawner: {err}") from None
            try:
                return self._channel.spawn(spec, given_up)
            except _Unstarted:
                continue  # it had ended: start another, once
        raise SpawnError("the replica spawner ended as soon as it started")


class Forking:
    """A fork under way in the spawner's thread: ``future`` gives the supervisor let go, or
    raises SpawnError."""

    future: concurrent.futures.Future[Forked]

    def __init__(self) -> None:
        self.given_up = threading.Event()

    def give_up(self) -> None:
        """Nothing is let go from now; one let go meanwhile is abandoned."""
        self.given_up.set()
        self.future.add_done_callback(_abandon_forked)


def _abandon_forked(future: concurrent.futures.Future[Forked]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().abandon()


def has_exited(pidfd: int) -> bool:
    """Whether the process ``pidfd`` holds has exited (its pidfd is readable)."""
    poll = select.poll()
    poll.register(pidfd, select.POLLIN)
    return bool(poll.poll(0))


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
