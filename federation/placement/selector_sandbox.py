"""CEL selectors evaluated in a child process, under a time budget enforced while they run.

The CEL library has no cost limit and its native code cannot be interrupted from Python, and a
static estimate (``selector_cost``) can be wrong: a selector it accepted once took 9 s. So every
evaluation of a user's selector runs in a child process (``selector_worker``) that answers per
device as it goes. An evaluation whose thread CPU time passes ``budget_s``, or that has not
answered within ``budget_s`` plus ``grace_s`` of wall time, makes the selector over budget: the
child is killed if it is still running, and the next evaluation starts a fresh one. The caller
sees ``SelectorBudgetError``; nothing it evaluated blocks anything but the calling thread.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

EVALUATION_BUDGET_S = 0.010
"""CPU time one selector may take on one device. The static limit (``MAX_SELECTOR_COST``)
corresponds to about 5 ms; real selectors take microseconds."""
KILL_GRACE_S = 0.5
"""Wall time beyond the budget before an evaluation that has not answered is stopped: room for
a busy machine to schedule the child, never room for a runaway (its CPU time is checked too)."""
START_TIMEOUT_S = 30.0
"""How long the child may take to start (import the CEL library) on a loaded machine."""


class SelectorBudgetError(ValueError):
    """A selector whose evaluation on one device ran over the budget."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """One evaluation, as the child reports it (see ``selector_worker``)."""

    kind: str
    """``value``, ``missing``, ``error`` or ``panic``."""
    detail: str
    cpu_s: float

    @property
    def is_true(self) -> bool:
        return self.kind == "value" and self.detail == "true"


class SelectorSandbox:
    """One child process that evaluates selectors; calls from several threads take turns."""

    def __init__(
        self, budget_s: float = EVALUATION_BUDGET_S, grace_s: float = KILL_GRACE_S
    ) -> None:
        self.budget_s = budget_s
        self._grace_s = grace_s
        self._lock = threading.Lock()
        self._child: subprocess.Popen[bytes] | None = None
        self._pending = b""

    def evaluate(self, source: str, attribute_sets: Sequence[dict[str, Any]]) -> list[Outcome]:
        """Evaluate ``source`` on each device's attributes, in order.

        Raises:
            SelectorBudgetError: One evaluation ran over the budget (the rest are not run).
        """
        if not attribute_sets:
            return []
        with self._lock:
            child = self._started()
            assert child.stdin is not None
            request = json.dumps([source, list(attribute_sets)]).encode() + b"\n"
            try:
                child.stdin.write(request)
                child.stdin.flush()
            except OSError:
                self._stop()
                raise
            outcomes = []
            for _ in attribute_sets:
                line = self._read_line(child, self.budget_s + self._grace_s)
                if line is None:
                    self._stop()
                    raise SelectorBudgetError(self._over(f"was stopped after {self._waited()}"))
                kind, detail, cpu_s = json.loads(line)
                if cpu_s > self.budget_s:
                    self._stop()  # the child may be deep in the next device already
                    raise SelectorBudgetError(self._over(f"took {cpu_s * 1e3:.0f} ms"))
                outcomes.append(Outcome(kind, detail, cpu_s))
            return outcomes

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _over(self, what: str) -> str:
        return (
            f"takes more than {self.budget_s * 1e3:g} ms to evaluate on one device ({what}). "
            "To fix: iterate over fewer or smaller lists, and build no lists of lists"
        )

    def _waited(self) -> str:
        return f"{(self.budget_s + self._grace_s) * 1e3:.0f} ms"

    def _started(self) -> subprocess.Popen[bytes]:
        if self._child is not None and self._child.poll() is None:
            return self._child
        self._stop()
        child = subprocess.Popen(
            [sys.executable, "-m", "federation.placement.selector_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._child = child
        if self._read_line(child, START_TIMEOUT_S) is None:
            self._stop()
            raise OSError("the selector evaluator did not start")
        return child

    def _read_line(self, child: subprocess.Popen[bytes], timeout_s: float) -> bytes | None:
        """The child's next line, or None if none came within ``timeout_s`` or it died."""
        assert child.stdout is not None
        fd = child.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line

    def _stop(self) -> None:
        child, self._child, self._pending = self._child, None, b""
        if child is None:
            return
        if child.poll() is None:
            child.kill()
        child.wait()
        for stream in (child.stdin, child.stdout):
            if stream is not None:
                stream.close()
