"""ReplicaProcess against real child processes."""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from federation.agent.process import TAIL_BYTES, ReplicaProcess, ReplicaStartError, describe_exit

from .beacon import Beacon


def _exited(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def gone(pid: int, timeout_s: float = 5.0) -> bool:
    """Whether ``pid`` exits within ``timeout_s`` (a zombie awaiting its reaper has exited).

    Polls: a process that is not our child gives no exit event, and it closes its files (which
    is what the code under test waits for) just before it turns into a zombie.
    """
    deadline = time.monotonic() + timeout_s
    while not _exited(pid):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.01)
    return True


async def start(code: str, tmp_path: Path, grace_s: float = 5.0, **env: str) -> ReplicaProcess:
    return await ReplicaProcess.start(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={**os.environ, **env},
        run_dir=run_dir(tmp_path),
        grace_s=grace_s,
    )


def run_dir(tmp_path: Path) -> Path:
    """A fresh folder for one supervisor's files."""
    return Path(tempfile.mkdtemp(dir=tmp_path, prefix="run-"))


async def test_exit_code_output_cwd_and_env(tmp_path: Path) -> None:
    """The exit code, combined output, working directory and environment are the child's."""
    code = (
        "import os, sys\n"
        "print('out', os.getcwd(), os.environ['GREETING'])\n"
        "print('err', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    proc = await start(code, tmp_path, GREETING="hi")
    assert await asyncio.wait_for(proc.wait(), 10) == 3
    assert proc.returncode == 3
    assert f"out {tmp_path} hi" in proc.output_tail
    assert "err" in proc.output_tail


async def test_output_tail_keeps_last_4_kib(tmp_path: Path) -> None:
    """Only the last 4 KiB of output is kept, undecodable bytes replaced."""
    code = (
        "import sys\n"
        "sys.stdout.buffer.write(b'\\xff' + b'x' * 100000 + b'\\xc3')\n"
        "sys.stdout.buffer.write(b'END')\n"
    )
    proc = await start(code, tmp_path)
    assert await asyncio.wait_for(proc.wait(), 10) == 0
    tail = proc.output_tail
    assert tail.endswith("\ufffdEND")
    assert len(tail) == TAIL_BYTES  # each invalid byte decodes to one replacement char
    assert tail.startswith("x")


async def test_terminate_signals_the_whole_group(tmp_path: Path, beacon: Beacon) -> None:
    """SIGTERM reaches the replica and the processes it started."""
    code = beacon.child(
        "import signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "def on_term(*_):\n"
        "    send('term')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "send(f'ready {child.pid}')\n"
        "time.sleep(60)\n"
    )
    # A loaded machine may take seconds to run the handler: the supervisor's own grace (which
    # caps terminate's) must not end it first.
    proc = await start(code, tmp_path, grace_s=60)
    grandchild = int((await beacon.expect("ready")).split()[1])
    await asyncio.wait_for(proc.terminate(grace_s=60), 90)
    assert proc.returncode == 0
    assert "term" in beacon.lines
    assert await gone(grandchild)


async def test_terminate_escalates_to_sigkill(tmp_path: Path, beacon: Beacon) -> None:
    """A replica that ignores SIGTERM is SIGKILLed once the grace period is over."""
    code = beacon.child(
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "send('ready')\n"
        "time.sleep(60)\n"
    )
    proc = await start(code, tmp_path)
    await beacon.expect("ready")
    started = time.monotonic()
    await asyncio.wait_for(proc.terminate(grace_s=0.3), 20)
    assert time.monotonic() - started >= 0.3
    assert await proc.wait() == -9


async def test_terminate_after_exit_is_a_noop(tmp_path: Path) -> None:
    """Terminating a replica that already exited keeps its exit code."""
    proc = await start("pass", tmp_path)
    assert await asyncio.wait_for(proc.wait(), 10) == 0
    assert not await proc.terminate(grace_s=0.1)  # nothing to stop
    assert proc.returncode == 0


async def test_terminate_says_whether_it_stopped_the_replica(tmp_path: Path) -> None:
    """A replica whose leader exited by itself is not counted as stopped, even while its
    output still drains; a running one is."""
    running = await start("import time; time.sleep(60)", tmp_path)
    assert await asyncio.wait_for(running.terminate(grace_s=5), 20)
    ended = await start("pass", tmp_path)
    for _ in range(200):  # the leader's exit seen, whether or not wait() has returned
        if ended.exited:
            break
        await asyncio.sleep(0.01)
    assert not await ended.terminate(grace_s=5)
    assert ended.returncode == 0


async def test_stragglers_die_with_the_leader(tmp_path: Path) -> None:
    """A background process left behind is killed when the replica exits, so wait() returns."""
    code = (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
    )
    proc = await start(code, tmp_path)
    assert await asyncio.wait_for(proc.wait(), 10) == 0
    assert await gone(int(proc.output_tail.split()[0]))


@pytest.mark.parametrize(
    ("argv", "message", "exit_code"),
    [
        (
            ["definitely-not-a-program-xyz", "-v"],
            "command not found: definitely-not-a-program-xyz",
            127,
        ),
        ([], "empty command", 127),
    ],
)
async def test_unstartable_program_raises_start_error(
    tmp_path: Path, argv: list[str], message: str, exit_code: int
) -> None:
    """A missing program is a ReplicaStartError with a shell-style exit code, not an OSError."""
    with pytest.raises(ReplicaStartError, match=message) as caught:
        await ReplicaProcess.start(
            argv, cwd=tmp_path, env=dict(os.environ), run_dir=run_dir(tmp_path)
        )
    assert caught.value.exit_code == exit_code


async def test_not_executable_raises_start_error(tmp_path: Path) -> None:
    """A file without execute permission is reported as permission denied."""
    script = tmp_path / "script.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    with pytest.raises(ReplicaStartError, match="permission denied") as caught:
        await ReplicaProcess.start(
            [str(script)], cwd=tmp_path, env=dict(os.environ), run_dir=run_dir(tmp_path)
        )
    assert caught.value.exit_code == 126


async def test_bad_environment_or_directory_raises_start_error(tmp_path: Path) -> None:
    """An invalid variable name or a missing working directory is a ReplicaStartError."""
    argv = [sys.executable, "-c", "pass"]
    with pytest.raises(ReplicaStartError, match=r"cannot start .*: exec: illegal environment"):
        await ReplicaProcess.start(
            argv, cwd=tmp_path, env={"BAD=NAME": "x"}, run_dir=run_dir(tmp_path)
        )
    missing = tmp_path / "missing"
    with pytest.raises(ReplicaStartError, match=f"working directory not found: {missing}"):
        await ReplicaProcess.start(
            argv, cwd=missing, env=dict(os.environ), run_dir=run_dir(tmp_path)
        )


@pytest.mark.parametrize(
    ("returncode", "text"),
    [(0, "exited with 0"), (3, "exited with 3"), (-9, "was killed by SIGKILL"), (-99, "signal 99")],
)
def test_describe_exit(returncode: int, text: str) -> None:
    """Exit codes read as exits, negative ones as the signal that killed the process."""
    assert text in describe_exit(returncode)
