"""Long loops on the event loop give it back now and then.

One large request (a batch of thousands of jobs, a page of a thousand records) or a long
scheduling cycle must not stall every other call the process serves: each such loop holds the
event loop for at most a slice at a time.
"""

from __future__ import annotations

import asyncio
import time

SLICE_S = 0.001
"""How long a loop may hold the event loop before it lets other work in."""


class TimeSlice:
    """Call ``await share()`` once per item of a long loop.

    A call in progress needs several turns of the event loop (each step of it waits on gRPC's
    own thread), so a loop that only yields between slices still holds a call back for as long
    as the loop runs. Background work therefore rests between its slices (``rest_s``): the
    loop is idle then, and calls go through in the gaps.
    """

    __slots__ = ("_rest_s", "_slice_s", "_start")

    def __init__(self, slice_s: float = SLICE_S, rest_s: float = 0.0) -> None:
        self._slice_s = slice_s
        self._rest_s = rest_s
        self._start = time.monotonic()

    async def share(self) -> None:
        """Let other work run if this loop has held the event loop longer than its slice."""
        if time.monotonic() - self._start > self._slice_s:
            await asyncio.sleep(self._rest_s)
            self._start = time.monotonic()
