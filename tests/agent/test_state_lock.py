"""One process at a time holds a state folder; a dead holder, and the tasks it left running,
hold nothing."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from federation.agent.state_lock import LOCK_FILE, StateDirLockedError, hold_state_dir

# Holds the folder, starts a "task" that outlives it (fds passed on as far as Popen allows),
# says the task's pid once it holds, and waits.
HOLDER = """
import subprocess, sys, time
from pathlib import Path
from federation.agent.state_lock import hold_state_dir
with hold_state_dir(Path(sys.argv[1])):
    task = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], close_fds=False
    )
    print(task.pid, flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int]]:
    """Another process holding ``tmp_path / "state"``, and the pid of its task."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "state")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    task = int(proc.stdout.readline())  # written once it holds the folder
    try:
        yield proc, task
    finally:
        proc.kill()
        proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(task, signal.SIGKILL)


def test_a_second_holder_is_refused_naming_the_first(
    holder: tuple[subprocess.Popen[str], int], tmp_path: Path
) -> None:
    proc, _ = holder
    state = tmp_path / "state"
    with pytest.raises(StateDirLockedError) as caught, hold_state_dir(state):
        pass
    assert str(caught.value).startswith(
        f"another agent (pid {proc.pid}) is already running on state folder {state}. "
    )
    assert (state / LOCK_FILE).read_text() == f"{proc.pid}\n"
    assert proc.poll() is None


def test_a_killed_holder_leaves_the_folder_free_though_its_task_lives(
    holder: tuple[subprocess.Popen[str], int], tmp_path: Path
) -> None:
    proc, task = holder
    proc.kill()
    proc.wait()
    assert psutil.pid_exists(task)
    state = tmp_path / "state"
    with hold_state_dir(state):
        assert (state / LOCK_FILE).read_text() == f"{os.getpid()}\n"


def test_the_folder_is_made_private_and_let_go_after_the_block(tmp_path: Path) -> None:
    state = tmp_path / "new" / "state"
    with hold_state_dir(state):
        assert state.stat().st_mode & 0o777 == 0o700
    with hold_state_dir(state):  # not still held by this process's first hold
        pass
