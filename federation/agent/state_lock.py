"""One agent per state folder: a lock on a file in it, held for the life of the process.

Two agents on one state folder (a second start by mistake) would take the session from each
other over and over, and adopt, stop and report the same tasks. The first agent holds an
exclusive ``flock`` on ``agent.lock`` and writes its pid there; a second finds it held and
stops before it touches anything. The kernel lets go of the lock when the process ends, however
it ends, so a crashed agent never blocks the next start; the descriptor is not inherited, so
task processes that outlive their agent do not hold it either.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = "agent.lock"


class StateDirLockedError(RuntimeError):
    """Another process holds the state folder."""


@contextlib.contextmanager
def hold_state_dir(state_dir: Path) -> Iterator[None]:
    """Hold ``state_dir`` for this process until the block ends (or the process does),
    creating the folder (private) if it is not there yet.

    Raises:
        StateDirLockedError: Another agent holds it; the message names its pid.
    """
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = state_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise StateDirLockedError(
                f"another agent (pid {holder}) is already running on state folder "
                f"{state_dir}. To fix: stop it first, or give this agent a state_dir of its own"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # lets go of the lock (the pid stays, for nobody to trust)
