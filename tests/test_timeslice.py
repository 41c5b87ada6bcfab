"""A long loop that shares the event loop lets other work in before it ends."""

from __future__ import annotations

import asyncio
import time

from federation.timeslice import TimeSlice


async def busy(seconds: float, timeslice: TimeSlice | None, done: list[str]) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if timeslice is not None:
            await timeslice.share()
    done.append("busy")


async def order_of(timeslice: TimeSlice | None) -> list[str]:
    done: list[str] = []

    async def quick() -> None:
        await asyncio.sleep(0)  # arrives once the busy loop has started
        done.append("quick")

    await asyncio.gather(busy(0.05, timeslice, done), quick())
    return done


async def test_a_sharing_loop_lets_a_call_through_before_it_ends() -> None:
    assert await order_of(None) == ["busy", "quick"]  # the stall that sharing prevents
    assert await order_of(TimeSlice()) == ["quick", "busy"]
    assert await order_of(TimeSlice(rest_s=0.001)) == ["quick", "busy"]
