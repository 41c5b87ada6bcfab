"""The supervisor of one replica: it runs the replica and outlives the agent that started it.

The agent starts one spawner (``serve``) with ``python -I -S`` (standard library only, no
``PYTHON*`` variables: it runs as the agent's user with tenants' specs in hand) in a session of
its own, and writes it a launch spec per replica (``marshal``: it runs the agent's own
interpreter). The spawner forks a supervisor for each: forked, a supervisor shares the spawner's
interpreter, its code and most of its memory, rather than starting an interpreter of its own.
The supervisor works in the replica's folder (which ``pwdx`` shows), starts the replica as the
leader of another new session, as the tenant's account, answers ``ok PID`` (or ``error CODE
MESSAGE``), then keeps the last ``TAIL_BYTES`` of the replica's output in a file and every line
of it in a log (``LogWriter``: stamped, rotated at a size), and, once the replica has exited and
the stragglers it left are killed, writes its exit status to another, atomically. A restarted
agent reads both, or adopts the supervisor while it runs. The replica dies with its supervisor
(parent-death signal). The spawner ends with its agent; the supervisors do not.

Signals from the agent:

- SIGTERM: stop the replica: SIGTERM to its process group, SIGKILL after ``grace_s``.
- SIGUSR1: SIGKILL the replica's process group now.
- SIGUSR2: another agent owns the replica now: read the owner file and watch that agent.

When the agent it watches dies, the replica is killed at once (a crashed agent leaves no task
behind: the coordinator places its tasks again) unless the owner file says that very agent left
on purpose (``PID START leaving``): then it runs on until the next agent claims it.
"""

from __future__ import annotations

# Every supervisor holds what the spawner imported. No subprocess, json, selectors or signal
# (the last imports enum): together they took a supervisor from 8.5 to 12 MiB of memory.
# ``_signal`` is the signal module's C half.
import gc
import marshal
import os
import select
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is a module the supervisor, one per replica, does without at run time
    import signal
    from typing import Any
else:
    import _signal as signal

TAIL_BYTES = 4096
LOG_LINE_BYTES = 16 * 1024
"""A line longer than this (a progress bar redrawn with \r, say) is logged in pieces."""
_READ_CHUNK = 64 * 1024
_FLUSH_S = 1.0
"""At most this often the output file is rewritten while the replica runs."""
_DRAIN_S = 1.0
"""After the replica exits, how long to read what is left in its output pipe."""
_PR_SET_PDEATHSIG = 1
_LINE_BYTES = 2048
"""At most this long, a line to the agent (less than ``PIPE_BUF``: written whole)."""

LEAVING = "leaving"
RUNNING = "running"


def process_start(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/PID/stat``); None if gone.

    With the pid it names one process for good: a recycled pid starts later.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read()
    except (FileNotFoundError, ProcessLookupError):  # others (out of descriptors) are errors
        return None
    # The name (field 2) may hold spaces and parentheses: count fields after its last ')'.
    return int(fields[fields.rindex(b")") + 2 :].split()[19])


def read_owner(path: str) -> tuple[int, int, str] | None:
    """``(pid, start, state)`` of the agent the owner file names, None if unreadable."""
    try:
        with open(path, encoding="ascii") as owner:
            pid, start, state = owner.read().split()
        return int(pid), int(start), state
    except (OSError, ValueError):
        return None


def write_atomically(path: str, data: bytes, *, sync: bool = False) -> None:
    """Readers see the old content or the new one, never a part."""
    temporary = f"{path}.tmp"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)


class LogWriter:
    """Appends a replica's output to ``path`` a line at a time, each line as ``STAMP TEXT``
    with STAMP its arrival in nanoseconds since the epoch, strictly increasing, so a reader
    can ask for what came after the last line it read. Past ``limit`` bytes the file is
    renamed ``path.1`` (replacing the one before) and a new one begun: a replica keeps at
    most twice ``limit``."""

    def __init__(self, path: str, limit: int) -> None:
        self._path = path
        self._limit = limit
        self._partial = bytearray()
        self._stamp = 0
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        self._size = os.fstat(self._fd).st_size

    def write(self, chunk: bytes) -> None:
        self._partial += chunk
        lines = []
        while (end := self._partial.find(b"\n")) >= 0 or len(self._partial) > LOG_LINE_BYTES:
            cut = end + 1 if 0 <= end < LOG_LINE_BYTES else LOG_LINE_BYTES
            lines.append(bytes(self._partial[:cut]).rstrip(b"\n"))
            del self._partial[:cut]
        self._append(lines)

    def close(self) -> None:
        """Log what is left of an unfinished last line."""
        if self._partial:
            self._append([bytes(self._partial)])
            self._partial.clear()
        os.close(self._fd)

    def _append(self, lines: list[bytes]) -> None:
        if not lines:
            return
        records = []
        for line in lines:
            self._stamp = max(time.time_ns(), self._stamp + 1)
            records.append(b"%d %s\n" % (self._stamp, line))
        data = b"".join(records)
        if self._size and self._size + len(data) > self._limit:
            os.close(self._fd)
            os.replace(self._path, self._path + ".1")
            self._fd = os.open(
                self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600
            )
            self._size = 0
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]
        self._size += len(data)


def _as_replica(spec: dict[str, Any], stdout: int, errors: int, supervisor: int) -> None:
    """In the forked child: becomes the replica (never returns); a failed step is written to
    ``errors`` (closed by the exec) as ``ERRNO STEP``, or ``0 STEP: WHY`` for an error that
    is not the system's."""
    step = "parent-death signal"
    try:
        # In the child only, so the supervisor never pays for it; before the account is taken,
        # which may not read the interpreter's library, and before the umask, which would
        # leave any bytecode it writes unreadable to others.
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        step = "setsid"
        os.dup2(stdout, 1)
        os.dup2(stdout, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for ignored in (signal.SIGPIPE, signal.SIGXFSZ):  # exec keeps what Python ignores
            signal.signal(ignored, signal.SIG_DFL)
        os.umask(0o077)
        os.setsid()
        if spec["uid"] >= 0:
            step = "account"
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
        step = "parent-death signal"
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after: a change of user clears it
        if os.getppid() != supervisor:
            os._exit(137)
        step = "exec"
        os.execve(spec["program"], spec["argv"], spec["env"])
    except OSError as err:
        os.write(errors, b"%d %s" % (err.errno or 0, step.encode()))
    except BaseException as err:  # a NUL in the command or its environment, say
        os.write(errors, b"0 %s: %s" % (step.encode(), str(err).encode(errors="replace")))
    os._exit(127)


def _start(spec: dict[str, Any], stdout: int) -> int:
    """Starts the replica as the leader of a new session, as the spec's account; its pid.
    Raises OSError (with the failed step in its filename) if it could not."""
    errors_r, errors_w = os.pipe2(os.O_CLOEXEC)
    supervisor = os.getpid()
    try:
        pid = os.fork()
    except OSError as err:
        os.close(errors_r)
        os.close(errors_w)
        raise OSError(err.errno, err.strerror, "fork") from err
    if pid == 0:  # every fd of the supervisor's own is close-on-exec: none reaches the replica
        _as_replica(spec, stdout, errors_w, supervisor)
    os.close(errors_w)
    failed = b""
    while chunk := os.read(errors_r, 512):
        failed += chunk
    os.close(errors_r)
    if not failed:
        return pid
    os.waitpid(pid, 0)
    number, _, step = failed.decode(errors="replace").partition(" ")
    code = int(number) if number.isdigit() else 0
    raise OSError(code, os.strerror(code) if code else "", step)


def _json_text(text: str) -> str:
    """``text`` as a JSON string."""
    escaped = (c if c >= " " and c not in '"\\' else f"\\u{ord(c):04x}" for c in text)
    return f'"{"".join(escaped)}"'


class Supervisor:
    """Starts one replica and watches it until it exits, then records how it ended."""

    _replica: int
    """The replica's pid."""
    _leader: int
    """A pidfd of the replica's leader."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self._spec = spec
        self._signals: list[int] = []
        # Before anything else: a stop sent as soon as the agent has its answer is not lost.
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, lambda number, _: self._signals.append(number))
        self._poll = select.epoll()
        self._watched: dict[int, str] = {}
        """What each fd polled is: "signal", "output", "agent" or "leader"."""
        self._wake = wake_r
        self._register(wake_r, "signal")
        self._agent: tuple[int, int] | None = None
        self._agent_fd: int | None = None
        self._output, self._output_w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self._output, False)
        self._register(self._output, "output")
        self._tail = bytearray()
        self._log = LogWriter(spec["log"], spec["log_bytes"]) if spec.get("log") else None
        self._flushed_at = 0.0
        self._dirty = False
        self._stopped = False
        """The replica was signalled to stop while it ran."""
        self._why = ""
        """Why the replica was killed for a reason of the supervisor's own, or ""."""
        self._kill_at: float | None = None

    def start(self) -> str:
        """Starts the replica; the answer for the agent (``ok PID`` or ``error CODE WHY``)."""
        program = self._spec["argv"][0]
        if not self._watch_agent(self._spec["agent_pid"], self._spec["agent_start"]):
            return "error 126 the agent is gone"
        try:
            if self._signals:  # told to stop already (its start was given up)
                return "error 126 stopped before it started"
            try:
                os.chdir(self._spec["cwd"])
            except OSError as err:
                return f"error 126 working directory {self._spec['cwd']}: {err.strerror}"
            self._replica = _start(self._spec, self._output_w)
        except FileNotFoundError as err:
            if err.filename == "exec":
                return f"error 127 command not found: {program}"
            return f"error 126 cannot start {program}: {err.filename}: {err.strerror}"
        except PermissionError as err:
            if err.filename == "exec":
                return f"error 126 permission denied: {program}"
            return f"error 126 cannot start {program}: {err.filename}: {err.strerror}"
        except OSError as err:
            why = f"{err.filename}: {err.strerror}" if err.strerror else err.filename
            return f"error 126 cannot start {program}: {why}"
        finally:
            os.close(self._output_w)
        self._leader = os.pidfd_open(self._replica)
        self._register(self._leader, "leader")
        return f"ok {self._replica}"

    def run(self) -> None:
        """Until the leader exits: output, signals, the agent's death; then the end."""
        try:
            while not self._leader_exited():
                self._step()
        except Exception as err:  # a bug here must not leave the replica unwatched
            self._why = f"supervisor failed: {err!r}"
            self._signal_group(signal.SIGKILL)
        self._finish()

    def _step(self) -> None:
        for fd, _ in self._poll.poll(self._timeout()):
            what = self._watched.get(fd)  # unregistered meanwhile by an earlier event: None
            if what == "output":
                self._read_output()
            elif what == "agent":
                self._agent_gone()
            elif what == "signal":
                try:  # noqa: SIM105 (contextlib: 0.9 MiB more per replica)
                    os.read(self._wake, 512)
                except BlockingIOError:
                    pass
        self._handle_signals()
        if self._kill_at is not None and time.monotonic() >= self._kill_at:
            self._signal_group(signal.SIGKILL)
            self._kill_at = None
        self._flush(force=False)

    def _timeout(self) -> float:
        """Seconds to the next thing due; -1: nothing is."""
        due = [self._kill_at] if self._kill_at is not None else []
        if self._dirty:
            due.append(self._flushed_at + _FLUSH_S)
        return max(0.0, min(due) - time.monotonic()) if due else -1

    def _register(self, fd: int, what: str) -> None:
        self._poll.register(fd, select.EPOLLIN)
        self._watched[fd] = what

    def _unregister(self, fd: int) -> None:
        self._poll.unregister(fd)
        del self._watched[fd]

    def _leader_exited(self) -> bool:
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT  # seen, not reaped: its group id stays ours
        return os.waitid(os.P_PID, self._replica, flags) is not None

    def _signal_group(self, sig: int) -> None:
        # The leader is not reaped before its group is killed, so the group id is still ours.
        try:  # noqa: SIM105 (contextlib: 0.9 MiB more per replica)
            os.killpg(self._replica, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _stop(self, sig: int) -> None:
        if not self._leader_exited():
            self._stopped = True
            self._signal_group(sig)

    def _handle_signals(self) -> None:
        while self._signals:
            number = self._signals.pop(0)
            if number == signal.SIGTERM:
                self._stop(signal.SIGTERM)
                if self._kill_at is None:
                    self._kill_at = time.monotonic() + self._spec["grace_s"]
            elif number == signal.SIGUSR1:
                self._stop(signal.SIGKILL)
            elif number == signal.SIGUSR2:
                self._claimed()

    def _agent_pid(self) -> int:
        return self._agent[0] if self._agent is not None else 0

    def _watch_agent(self, pid: int, start: int | None = None) -> bool:
        """Watch agent ``pid`` (started at ``start``, when given) from now; False if it is
        gone already."""
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        started = process_start(pid)  # read once the pidfd holds the process
        if started is None or start not in (None, started):
            os.close(fd)
            return False
        self._unwatch_agent()
        self._agent, self._agent_fd = (pid, started), fd
        self._register(fd, "agent")
        return True

    def _unwatch_agent(self) -> None:
        if self._agent_fd is not None:
            self._unregister(self._agent_fd)
            os.close(self._agent_fd)
            self._agent_fd = None

    def _claimed(self) -> None:
        """SIGUSR2: the agent the owner file names, if it is running, is ours now."""
        owner = read_owner(self._spec["owner"]) if self._spec["owner"] else None
        if owner is None or owner[2] != RUNNING or owner[:2] == self._agent:
            return
        pid, start, _ = owner
        if not self._watch_agent(pid, start) and self._agent_fd is None:
            self._agent_died()  # orphaned, and the agent that claimed it died already

    def _agent_gone(self) -> None:
        """The agent watched exited: run on if it left on purpose, or another took over."""
        gone = self._agent
        self._unwatch_agent()
        owner = read_owner(self._spec["owner"]) if self._spec["owner"] else None
        if owner is not None and (owner[:2] != gone or owner[2] == LEAVING):
            return  # a next agent adopts it (SIGUSR2), or stops it (SIGUSR1)
        self._agent_died()

    def _agent_died(self) -> None:
        self._why = "agent_died"
        self._stop(signal.SIGKILL)

    def _read_output(self) -> bool:
        """Reads what is there; False at end of file."""
        try:
            chunk = os.read(self._output, _READ_CHUNK)
        except BlockingIOError:
            return True
        if not chunk:
            self._unregister(self._output)
            return False
        self._tail += chunk
        del self._tail[:-TAIL_BYTES]
        if self._log is not None:
            self._log.write(chunk)
        self._dirty = True
        return True

    def _flush(self, *, force: bool) -> None:
        now = time.monotonic()
        if self._dirty and (force or now - self._flushed_at >= _FLUSH_S):
            write_atomically(self._spec["output"], bytes(self._tail))
            self._flushed_at, self._dirty = now, False

    def _finish(self) -> None:
        self._signal_group(signal.SIGKILL)  # stragglers: the replica's lifetime is its leader's
        returncode = os.waitstatus_to_exitcode(os.waitpid(self._replica, 0)[1])
        self._unregister(self._leader)
        self._unregister(self._wake)
        self._unwatch_agent()
        deadline = time.monotonic() + _DRAIN_S
        draining = self._output in self._watched
        while draining and (left := deadline - time.monotonic()) > 0:
            # A straggler in another session may hold the pipe open: read for a while only.
            if not self._poll.poll(left):
                break
            draining = self._read_output()
        self._flush(force=True)
        if self._log is not None:
            self._log.close()
        stopped, why = "true" if self._stopped else "false", _json_text(self._why)
        status = f'{{"returncode": {returncode}, "stopped": {stopped}, "why": {why}}}'
        write_atomically(self._spec["exit"], status.encode(), sync=True)


def serve(answers: int) -> None:
    """The spawner: reads launch specs from stdin, each as ``LENGTH\\n`` and that many bytes of
    ``marshal``, until it closes (the agent has ended), and forks a supervisor for each.

    For each it says ``PID START`` on stdout, which it alone holds (``0 0 WHY`` if it could not
    fork), then reads one byte from the agent: ``g`` lets the supervisor go;
    anything else, or nothing, ends it before it starts anything. The agent holds the
    supervisor by a pidfd before it lets it go, so it can stop whatever it asked for. Each
    supervisor then answers the agent itself, on the ``answers`` pipe all of them share, in one
    line of its own (``PID ok REPLICA`` or ``PID error CODE WHY``): a slow start holds up no
    other.
    """
    os.chdir("/")  # pins no folder; each supervisor works in its replica's
    os.set_inheritable(answers, False)  # the supervisors' replicas never hold it
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the supervisors
    # Objects a supervisor's collections need not visit: their pages stay shared with it.
    gc.freeze()
    requests = sys.stdin.buffer
    while header := requests.readline():
        spec = marshal.loads(requests.read(int(header)))
        if not _fork_supervisor(spec, requests, answers):
            return  # the agent is gone


def _say(fd: int, line: bytes) -> None:
    """One line to the agent, in one write: under ``PIPE_BUF``, it never mixes with another
    process's line (it raises BrokenPipeError once the agent is gone)."""
    os.write(fd, line[: _LINE_BYTES - 1] + b"\n")


def _one_line(text: str) -> bytes:
    """``text`` with no control character (a tenant's command name may hold a newline)."""
    return "".join(c if c >= " " else f"\\x{ord(c):02x}" for c in text).encode()


def _fork_supervisor(spec: dict[str, Any], requests: Any, answers: int) -> bool:
    """Forks a supervisor for ``spec`` and lets it go if the agent says so; False once the
    agent is gone."""
    try:
        go_r, go_w = os.pipe2(os.O_CLOEXEC)
    except OSError as err:
        _say(1, b"0 0 " + _one_line(f"pipe: {err.strerror}"))
        return True
    try:
        pid = os.fork()
    except OSError as err:
        os.close(go_r)
        os.close(go_w)
        _say(1, b"0 0 " + _one_line(f"fork: {err.strerror}"))
        return True
    if pid == 0:  # never returns into the spawner's loop
        code = 1
        try:
            # The spawner's pipes are its own: its death shows in them at once.
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(devnull, 1)
            os.close(devnull)
            os.close(go_w)
            if os.read(go_r, 1):  # nothing: the agent let it go no further
                os.close(go_r)
                _supervise(spec, answers)
                code = 0
        finally:
            os._exit(code)
    os.close(go_r)
    try:
        _say(1, b"%d %d" % (pid, process_start(pid) or 0))
        verdict = requests.read(1)
        if verdict == b"g":
            try:  # noqa: SIM105 (contextlib: more memory in every supervisor)
                os.write(go_w, b"g")
            except BrokenPipeError:  # it died meanwhile: the agent's pidfd shows it
                pass
    finally:
        os.close(go_w)
    return bool(verdict)


def _supervise(spec: dict[str, Any], answers: int) -> None:
    """In the forked supervisor: starts the replica, answers, and watches it."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # its replica is its own to wait for
    os.setsid()  # outlives the spawner and the agent
    try:
        supervisor = Supervisor(spec)
        said = supervisor.start()
    except Exception as err:  # its log cannot be opened, say: the agent hears why at once
        said = f"error 126 the supervisor failed: {err}"
    try:  # noqa: SIM105 (contextlib: more memory in every supervisor)
        _say(answers, b"%d %s" % (os.getpid(), _one_line(said)))
    except OSError:  # the agent is gone: the watch on it decides what becomes of the replica
        pass
    os.close(answers)  # the agent's reader ends once the spawner and all answers are gone
    if said.startswith("ok"):
        supervisor.run()


if __name__ == "__main__":
    serve(int(sys.argv[1]))
