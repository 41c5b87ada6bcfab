"""The supervisor of a replica, against real processes: its files, its signals, and what it does
when its agent goes away (on purpose, or not)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import psutil
import pytest

from federation.agent import process, supervisor
from federation.agent import spawner as spawning
from federation.agent.process import TAIL_BYTES, ReplicaProcess, ReplicaStartError
from federation.agent.task_logs import LOG_FILE
from federation.agent.task_records import TaskRecords

from .test_process import gone


async def start(code: str, tmp_path: Path, grace_s: float = 5.0) -> ReplicaProcess:
    return await ReplicaProcess.start(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=dict(os.environ),
        run_dir=tmp_path / "run",
        grace_s=grace_s,
    )


def exit_status(tmp_path: Path) -> dict[str, object]:
    status: dict[str, object] = json.loads((tmp_path / "run" / "exit").read_text())
    return status


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def pidfds(pid: int) -> int:
    """How many pidfds process ``pid`` holds: a supervisor watches its replica and its agent
    by one each."""
    held = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed since it was listed
            held += os.readlink(fd) == "anon_inode:[pidfd]"
    return held


async def first_line(path: Path, timeout_s: float = 10.0) -> str:
    """The first line written to ``path`` (the supervisor writes its output file at most once a
    second, whole)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            if text := await asyncio.to_thread(path.read_text):
                return text.split("\n")[0]
        await asyncio.sleep(0.05)
    raise AssertionError(f"nothing written to {path}")


async def test_exit_status_and_output_are_files(tmp_path: Path) -> None:
    """The replica's exit code is written to a file once it ended, its output tail to another,
    and the supervisor is a session leader of its own, apart from the replica's session."""
    proc = await start(
        "import os; print('pid', os.getpid(), os.getsid(0)); raise SystemExit(3)", tmp_path
    )
    assert os.getsid(proc.pid) == proc.pid
    assert await asyncio.wait_for(proc.wait(), 10) == 3
    assert exit_status(tmp_path) == {"returncode": 3, "stopped": False, "why": ""}
    _, pid, sid = (tmp_path / "run" / "output").read_text().split()
    assert pid == sid != str(proc.pid)
    assert proc.output_tail.startswith("pid ")


async def test_output_file_is_bounded_and_written_while_it_runs(tmp_path: Path) -> None:
    """While the replica runs its output file holds its newest output, never more than 4 KiB."""
    code = (
        "import sys, time\n"
        "sys.stdout.write('x' * 100000 + 'END\\n'); sys.stdout.flush()\n"
        "time.sleep(60)\n"
    )
    proc = await start(code, tmp_path)
    output = tmp_path / "run" / "output"
    for _ in range(100):  # written at most once a second
        if proc.output_tail.endswith("END\n"):
            break
        await asyncio.sleep(0.05)
    assert proc.output_tail.endswith("END\n")
    assert output.stat().st_size == TAIL_BYTES
    assert await asyncio.wait_for(proc.terminate(grace_s=5), 10)


async def test_sigterm_to_the_supervisor_stops_the_replica_with_its_grace(
    tmp_path: Path,
) -> None:
    """SIGTERM sent to the supervisor (as an operator would) reaches the replica; one that
    ignores it is SIGKILLed after the grace the supervisor was given."""
    code = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: print('term', flush=True))\n"
        "print(os.getpid(), flush=True)\n"
        "time.sleep(60); time.sleep(60)\n"
    )
    proc = await start(code, tmp_path, grace_s=0.5)
    replica = int(await first_line(tmp_path / "run" / "output"))
    started = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    assert await asyncio.wait_for(proc.wait(), 10) == -signal.SIGKILL
    assert time.monotonic() - started >= 0.5
    assert exit_status(tmp_path) == {"returncode": -9, "stopped": True, "why": ""}
    assert "term" in proc.output_tail
    assert not alive(replica)


# An agent in a process of its own: starts a replica that sleeps, says which, then leaves
# on purpose ("leave": its core closed) or crashes.
AGENT = """
import asyncio, os, sys
from pathlib import Path
from federation.agent.process import ReplicaProcess
from federation.agent.task_records import TaskRecords

async def main():
    records, work, how = TaskRecords(Path(sys.argv[1])), Path(sys.argv[2]), sys.argv[3]
    records.claim()
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(60)"
    proc = await ReplicaProcess.start(
        [sys.executable, "-c", code], cwd=work, env=dict(os.environ), run_dir=work / "run",
        owner=records.owner,
    )
    print(proc.pid, proc.start_ticks, flush=True)
    while not proc.output_tail:  # the replica runs
        await asyncio.sleep(0.05)
    if how == "leave":
        records.leave()
        sys.exit(0)
    os._exit(1)

asyncio.run(main())
"""


async def run_agent(tmp_path: Path, how: str) -> tuple[int, int, int]:
    """Runs ``AGENT`` to its end; its supervisor's pid and start, and the replica's pid."""
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", AGENT, str(tmp_path / "state"), str(tmp_path), how],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.stdout, done.stderr
    supervisor, start = (int(word) for word in done.stdout.splitlines()[-1].split())
    return supervisor, start, int(await first_line(tmp_path / "run" / "output"))


async def test_an_agent_that_leaves_leaves_its_replica_running_for_the_next(
    tmp_path: Path,
) -> None:
    """Its agent gone on purpose, the replica runs on; the next agent adopts its supervisor
    (same pid and start) and can still stop it."""
    supervisor, start, replica = await run_agent(tmp_path, "leave")
    # The supervisor has seen its agent exit: it let go of the pidfd it watched it by, and
    # holds only its replica's.
    deadline = time.monotonic() + 10
    while pidfds(supervisor) != 1:
        assert time.monotonic() < deadline, "the supervisor still watches the agent that left"
        await asyncio.sleep(0.05)
    assert alive(supervisor)
    assert alive(replica)
    TaskRecords(tmp_path / "state").claim()
    adopted = ReplicaProcess.adopt(supervisor, start, tmp_path / "run")
    adopted.claim()
    assert not adopted.exited
    assert await asyncio.wait_for(adopted.terminate(grace_s=5), 10)
    assert adopted.returncode == -signal.SIGTERM
    assert await gone(replica)


async def test_an_agent_that_crashes_takes_its_replica(tmp_path: Path) -> None:
    """Its agent gone without leaving, the supervisor kills the replica and records why."""
    supervisor, start, replica = await run_agent(tmp_path, "crash")
    assert await gone(replica)
    assert await gone(supervisor)
    assert exit_status(tmp_path) == {"returncode": -9, "stopped": True, "why": "agent_died"}
    ended = ReplicaProcess.adopt(supervisor, start, tmp_path / "run")
    assert await asyncio.wait_for(ended.wait(), 10) == -signal.SIGKILL
    assert ended.ended is not None
    assert ended.ended.why == "agent_died"


async def test_a_supervisor_caught_exiting_is_adopted_as_ended(tmp_path: Path) -> None:
    """Between writing its exit file (its last act) and exiting, a supervisor is still alive:
    an agent adopting it then takes the replica as ended, as the file says, not as running."""
    proc = await start("import time; time.sleep(60)", tmp_path)
    status = {"returncode": 0, "stopped": False, "why": ""}
    (tmp_path / "run" / "exit").write_text(json.dumps(status))  # the window, held open
    caught = ReplicaProcess.adopt(proc.pid, proc.start_ticks, tmp_path / "run")
    assert alive(proc.pid)
    assert caught.ended is not None
    assert (caught.returncode, caught.ended.why) == (0, "")
    assert await asyncio.wait_for(proc.terminate(grace_s=5), 10)


async def test_a_recycled_pid_is_not_adopted(tmp_path: Path) -> None:
    """A pid whose start time is not the one recorded is someone else: not signalled, and the
    replica is known to have ended with its supervisor, which left no exit status."""
    proc = await start("import time; time.sleep(60)", tmp_path)
    other = ReplicaProcess.adopt(proc.pid, proc.start_ticks + 1, tmp_path / "other")
    assert other.exited
    assert other.returncode == -signal.SIGKILL
    assert other.ended is not None
    assert "ended without recording" in other.ended.why
    await other.terminate(grace_s=0.1)  # signals nothing
    assert alive(proc.pid)
    assert await asyncio.wait_for(proc.terminate(grace_s=5), 10)


async def test_a_replica_starts_with_no_signal_ignored_nor_a_descriptor_of_its_supervisor(
    tmp_path: Path,
) -> None:
    """Python ignores SIGPIPE and SIGXFSZ, the spawner SIGCHLD, and an exec keeps what is
    ignored: the supervisor sets them back; and the replica holds its output and /dev/null
    only."""
    script = "grep SigIgn /proc/self/status; ls /proc/self/fd"  # a shell ignores nothing itself
    proc = await ReplicaProcess.start(
        ["/bin/sh", "-c", script],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"]},
        run_dir=tmp_path / "run",
        grace_s=5.0,
    )
    assert await asyncio.wait_for(proc.wait(), 10) == 0
    ignored, fds = proc.output_tail.split("\n", 1)
    mask = int(ignored.split()[1], 16)  # bit N-1: signal N (others the agent's parent ignored)
    reset = (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD)  # SIGCHLD: the spawner ignores it
    assert [sig for sig in reset if mask >> (sig - 1) & 1] == []
    assert fds.split() == ["0", "1", "2", "3"]  # the last: ls's listing of the folder


async def test_supervisors_are_forked_by_one_spawner_and_work_in_their_replicas_folder(
    tmp_path: Path,
) -> None:
    """Each supervisor is a fork of the agent's one spawner (no interpreter of its own), in
    the replica's folder (which ``pwdx`` shows operators)."""
    first, second = (tmp_path / "a", tmp_path / "b")
    procs = []
    for folder in (first, second):
        folder.mkdir()
        procs.append(await start("import time; time.sleep(60)", folder))
    spawners = {psutil.Process(proc.pid).ppid() for proc in procs}
    assert len(spawners) == 1
    spawner = psutil.Process(spawners.pop())
    assert spawner.ppid() == os.getpid()
    assert "supervisor.serve(" in " ".join(spawner.cmdline())
    assert [psutil.Process(proc.pid).cwd() for proc in procs] == [str(first), str(second)]
    for proc in procs:
        assert await asyncio.wait_for(proc.terminate(grace_s=5), 10)


async def test_a_spawner_that_died_is_started_again_and_its_supervisors_run_on(
    tmp_path: Path,
) -> None:
    """The spawner killed, the replicas it started run on under their supervisors, and the
    next replica is started by a new spawner."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    before = await start("import time; time.sleep(60)", tmp_path / "a")
    spawner = psutil.Process(before.pid).ppid()
    os.kill(spawner, signal.SIGKILL)
    assert await gone(spawner)
    after = await start("print('started'); import time; time.sleep(60)", tmp_path / "b")
    assert psutil.Process(after.pid).ppid() not in (spawner, 1)
    assert await first_line(tmp_path / "b" / "run" / "output") == "started"
    assert alive(before.pid)
    assert not before.exited
    for proc in (before, after):
        assert await asyncio.wait_for(proc.terminate(grace_s=5), 10)


# An agent that leaves on purpose while a start is under way: ``asyncio.run`` cancels it as
# the loop closes, after the owner file says "leaving" (as a closing core does).
LEAVING_MIDSTART = """
import asyncio, os, sys
from pathlib import Path
from federation.agent.process import ReplicaProcess
from federation.agent.task_records import TaskRecords

async def main():
    records, work, delay = TaskRecords(Path(sys.argv[1])), Path(sys.argv[2]), float(sys.argv[3])
    records.claim()
    code = "import os, time; open('pid', 'w').write(str(os.getpid())); time.sleep(60)"
    starting = asyncio.ensure_future(ReplicaProcess.start(
        [sys.executable, "-c", code], cwd=work, env=dict(os.environ), run_dir=work / "run",
        owner=records.owner,
    ))
    started = lambda task: not task.cancelled() and task.exception() is None
    starting.add_done_callback(lambda task: print("started" if started(task) else "given up"))
    await asyncio.sleep(delay)
    records.leave()

asyncio.run(main())
"""


async def test_a_start_given_up_as_its_agent_leaves_leaves_no_replica(tmp_path: Path) -> None:
    """A start the agent's loop cancels as it closes, its agent leaving on purpose: no
    supervisor it let go runs on unrecorded (no next agent would know of it). A start that
    finished first is its caller's to record, and runs on."""
    given_up = 0
    for attempt in range(8):
        work = tmp_path / str(attempt)
        work.mkdir()
        args = [str(tmp_path / f"state{attempt}"), str(work), str(attempt * 0.004)]
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", LEAVING_MIDSTART, *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        await asyncio.sleep(0.5)  # a replica started before the kill has written its pid
        pid = (work / "pid").read_text() if (work / "pid").exists() else ""
        outcome = done.stdout.splitlines()[-1] if done.stdout else ""  # after its log lines
        if outcome == "started":
            os.kill(int(pid), signal.SIGKILL)  # its supervisor ends with it
            continue
        assert outcome == "given up", done.stdout
        given_up += 1
        if pid:
            assert await gone(int(pid)), f"attempt {attempt}: replica {pid} runs on"
    assert given_up >= 2, "too few starts were given up midway to tell"


async def test_a_frozen_spawner_fails_the_start_in_time_and_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spawner that forks nothing (stopped here) fails the start once the answer is due,
    starts nothing, and the next start gets a new spawner."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "c").mkdir()
    first = await start("import time; time.sleep(60)", tmp_path / "a")
    spawner = psutil.Process(first.pid).ppid()
    os.kill(spawner, signal.SIGSTOP)
    monkeypatch.setattr(spawning, "ANSWER_TIMEOUT_S", 1.0)
    code = "import os; open('pid', 'w').write(str(os.getpid()))"
    with pytest.raises(ReplicaStartError, match="did not fork"):
        await start(code, tmp_path / "b")
    assert await gone(spawner)
    assert not (tmp_path / "b" / "pid").exists()
    after = await start("import time; time.sleep(60)", tmp_path / "c")
    assert psutil.Process(after.pid).ppid() != spawner
    for proc in (first, after):
        assert await asyncio.wait_for(proc.terminate(grace_s=5), 10)


async def the_spawner(tmp_path: Path) -> psutil.Process:
    """This process's spawner, started by a replica that runs and ends if need be."""
    for child in psutil.Process().children():
        if "supervisor.serve(" in " ".join(child.cmdline()):
            return child
    (tmp_path / "first").mkdir()
    proc = await start("pass", tmp_path / "first")
    await asyncio.wait_for(proc.wait(), 10)
    return await the_spawner(tmp_path)


async def request_waiting() -> None:
    """Waits until a request is written to the (stopped) spawner and waits in its pipe."""
    deadline = time.monotonic() + 10
    while True:
        channel = spawning.SPAWNER._channel
        if channel is not None:
            waiting = fcntl.ioctl(channel._requests, termios.FIONREAD, b"\0\0\0\0")
            if int.from_bytes(waiting, sys.byteorder):
                return
        assert time.monotonic() < deadline, "no request was written to the spawner"
        await asyncio.sleep(0.02)


async def held_start(
    folder: Path, spawner: psutil.Process, code: str = "import time; time.sleep(60)"
) -> tuple[asyncio.Task[ReplicaProcess], psutil.Process]:
    """A start whose supervisor is held before it answers: its log is a FIFO nobody reads, so
    opening it blocks. The start, and the supervisor."""
    await asyncio.to_thread((folder / "run").mkdir, parents=True)
    os.mkfifo(folder / "run" / LOG_FILE)
    before = {child.pid for child in spawner.children()}
    starting = asyncio.ensure_future(start(code, folder))
    deadline = time.monotonic() + 10
    while not (new := [c for c in spawner.children() if c.pid not in before]):
        assert time.monotonic() < deadline, "no supervisor was forked"
        await asyncio.sleep(0.02)
    # Let go (the agent holds its pidfd by then): a supervisor leads its session only then.
    while os.getsid(new[0].pid) != new[0].pid:
        assert time.monotonic() < deadline, "the supervisor was not let go"
        await asyncio.sleep(0.02)
    return starting, new[0]


async def test_a_supervisor_that_dies_before_it_answers_fails_its_start_at_once(
    tmp_path: Path,
) -> None:
    """Killed before it answers (the OOM killer, say), a supervisor fails its start at once
    with a start error, not after the answer's timeout."""
    starting, held = await held_start(tmp_path / "a", await the_spawner(tmp_path))
    held.kill()
    killed = time.monotonic()
    with pytest.raises(ReplicaStartError, match="ended without answering"):
        await asyncio.wait_for(starting, 20)
    assert time.monotonic() - killed < 15  # not the answer's 30 s
    assert (await the_spawner(tmp_path)).is_running()


async def test_a_start_given_up_before_its_answer_kills_its_supervisor(tmp_path: Path) -> None:
    """Cancelled while its supervisor has not answered, the start kills the supervisor."""
    starting, held = await held_start(tmp_path / "a", await the_spawner(tmp_path))
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    assert await gone(held.pid)
    assert spawning.SPAWNER._channel is not None
    assert spawning.SPAWNER._channel._answers == {}  # its answer is not waited for


async def test_a_start_given_up_while_its_supervisor_is_forked_lets_nothing_run(
    tmp_path: Path,
) -> None:
    """Cancelled while the spawner has not yet forked (stopped here), the start kills the
    supervisor forked afterwards, before its replica runs; and the spawner goes on."""
    spawner = await the_spawner(tmp_path)
    (tmp_path / "a").mkdir()
    before = {child.pid for child in spawner.children()}
    spawner.suspend()
    try:
        code = "import os; open('pid', 'w').write(str(os.getpid()))"
        starting = asyncio.ensure_future(start(code, tmp_path / "a"))
        await request_waiting()
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
    finally:
        spawner.resume()
    deadline = time.monotonic() + 10
    while forked := [c for c in spawner.children() if c.pid not in before and c.is_running()]:
        assert time.monotonic() < deadline, f"supervisor {forked} runs on"
        await asyncio.sleep(0.05)
    assert not (tmp_path / "a" / "pid").exists()
    (tmp_path / "b").mkdir()
    proc = await start("print('after')", tmp_path / "b")
    assert await asyncio.wait_for(proc.wait(), 10) == 0
    assert psutil.Process(spawner.pid).is_running()


async def test_a_started_replica_given_up_has_its_whole_group_stopped(tmp_path: Path) -> None:
    """A start given up after its replica ran (and forked a child): the supervisor kills the
    replica's whole group and records the stop, not just the replica's leader."""
    (tmp_path / "a").mkdir()
    code = (
        "import os, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "open('child', 'w').write(str(child.pid)); time.sleep(60)\n"
    )
    run = tmp_path / "a" / "run"
    spec = process._spec(
        [sys.executable, "-c", code], tmp_path / "a", dict(os.environ), run, None, 5.0, None
    )
    forked = await asyncio.wrap_future(spawning.SPAWNER.submit(spec).future)
    answer = await spawning.answer_of(forked)
    assert answer is not None
    assert answer.startswith("ok ")
    deadline = time.monotonic() + 10
    while not (tmp_path / "a" / "child").exists() or not (tmp_path / "a" / "child").read_text():
        assert time.monotonic() < deadline, "the replica did not start its child"
        await asyncio.sleep(0.05)
    child = int((tmp_path / "a" / "child").read_text())
    forked.abandon()
    assert await gone(child)
    assert await gone(forked.pid)
    assert exit_status(tmp_path / "a")["stopped"] is True


async def test_a_spawner_killed_with_a_request_in_hand_is_replaced_and_the_start_goes_on(
    tmp_path: Path,
) -> None:
    """The spawner dies holding a request it never forked for: the start is sent again, once,
    to a new spawner, and its replica runs once."""
    spawner = await the_spawner(tmp_path)
    (tmp_path / "a").mkdir()
    spawner.suspend()
    code = "import os; open(f'ran-{os.getpid()}', 'w').close(); import time; time.sleep(60)"
    starting = asyncio.ensure_future(start(code, tmp_path / "a"))
    await request_waiting()
    spawner.kill()
    proc = await asyncio.wait_for(starting, 10)
    assert psutil.Process(proc.pid).ppid() != spawner.pid
    deadline = time.monotonic() + 10
    while not list((tmp_path / "a").glob("ran-*")):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    assert len(list((tmp_path / "a").glob("ran-*"))) == 1
    assert await asyncio.wait_for(proc.terminate(grace_s=5), 10)


async def test_a_command_name_cannot_speak_for_another_start(tmp_path: Path) -> None:
    """A command whose name holds newlines and the words of another start's answer (of a
    supervisor still starting) fails alone, with its name shown escaped; the other start is
    still told its own supervisor's answer."""
    spawner = await the_spawner(tmp_path)
    starting, held = await held_start(
        tmp_path / "a", spawner, "print('mine'); import time; time.sleep(60)"
    )
    forged = tmp_path / f"x\n{held.pid} ok 1\n"
    forged.write_bytes(b"\x7fELF not really\n")
    forged.chmod(0o755)
    with pytest.raises(ReplicaStartError) as failed:
        await ReplicaProcess.start(
            [str(forged)], cwd=tmp_path, env={}, run_dir=tmp_path / "run-forged", grace_s=1
        )
    assert f"x\\x0a{held.pid} ok 1\\x0a" in str(failed.value)
    await asyncio.sleep(0.5)  # a forged answer, had it been read as one, would be taken by now
    assert not starting.done()
    log = os.open(tmp_path / "a" / "run" / LOG_FILE, os.O_RDONLY | os.O_NONBLOCK)  # lets it go
    try:
        proc = await asyncio.wait_for(starting, 10)
        assert proc.pid == held.pid
        assert await first_line(tmp_path / "a" / "run" / "output") == "mine"
        assert await asyncio.wait_for(proc.terminate(grace_s=5), 10)
    finally:
        os.close(log)


def test_the_exit_record_is_json_whatever_the_reason_holds() -> None:
    """The supervisor writes its exit record without the json module: any text reads back."""
    for why in ["", "agent_died", 'supervisor failed: OSError(5, "I/O\\error")\n\t\x00', "é ü 💥"]:
        assert json.loads(supervisor._json_text(why)) == why
