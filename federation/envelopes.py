"""Many messages to one stream write: the Connect stream carries envelopes of queued messages.

A gRPC stream costs about as much per write as per byte for small messages, so each side sends
everything it has queued at the moment it writes, in order, bounded so an envelope stays far
below gRPC's 4 MiB message limit.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol, TypeVar

MAX_MESSAGES = 512
MAX_BYTES = 1 << 20
"""Once an envelope holds this much, the rest waits for the next write. A message that comes
next still goes in, so an envelope can reach this plus its largest message (a full view)."""
MAX_STREAM_MESSAGE_BYTES = 64 << 20
"""gRPC's receive limit on both ends of the Connect stream (its default, 4 MiB, is less than
one envelope of large views can take)."""


class _Sized(Protocol):
    def ByteSize(self) -> int: ...


M = TypeVar("M", bound=_Sized)
E = TypeVar("E")


def take_queued(queue: asyncio.Queue[M | None], first: M) -> tuple[list[M], bool]:
    """``first`` and the messages queued behind it, up to the limits; and whether the end
    marker (None) came next, which the caller then handles after sending these."""
    batch = [first]
    size = first.ByteSize()
    while len(batch) < MAX_MESSAGES and size < MAX_BYTES and not queue.empty():
        message = queue.get_nowait()
        if message is None:
            return batch, True
        batch.append(message)
        size += message.ByteSize()
    return batch, False


async def envelopes(
    queue: asyncio.Queue[M | None], wrap: Callable[[list[M]], E]
) -> AsyncIterator[E]:
    """A request stream: each write wraps everything queued; None in the queue ends it."""
    while (first := await queue.get()) is not None:
        messages, ended = take_queued(queue, first)
        yield wrap(messages)
        if ended:
            return
