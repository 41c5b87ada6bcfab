"""Weighted dominant-resource fairness between queues (as Armada and Volcano's DRF do), after
what queues are owed: a task within its queue's nominal quota goes before any that would
borrow (as Kueue admits), or the borrower would be given room its lender takes back."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TypeVar

from federation.resources import KINDS

T = TypeVar("T")
BASE = ("cpu", "memory_mib", *KINDS.values())
"""The resources shares are taken of (a model's devices are already counted in their kind)."""


def dominant_share(
    held: Mapping[str, float], capacity: Mapping[str, float], weight: float
) -> tuple[float, str]:
    """The largest share of any resource the federation has that ``held`` takes, over
    ``weight``; and that resource ("" when it holds nothing)."""
    best, which = 0.0, ""
    for resource in BASE:
        total = capacity.get(resource, 0.0)
        if total > 0 and (share := held.get(resource, 0.0) / total) > best:
            best, which = share, resource
    return best / (weight or 1.0), which


def fair_order(
    lines: Mapping[str, Iterable[T]], turn: Callable[[str, T], tuple[bool, float]]
) -> Iterator[T]:
    """The items of every queue's line, each next one from the queue whose turn comes first:
    ``turn(queue, its next item)`` is (whether that item would borrow, the queue's share now)
    and is asked again each time the queue's turn comes round, so a queue whose tasks were
    just admitted falls back behind the others (ties go to the queue's name)."""
    iterators = {queue: iter(items) for queue, items in lines.items()}
    heap: list[tuple[tuple[bool, float], str, T]] = []
    for queue, items in iterators.items():
        if (item := next(items, None)) is not None:
            heap.append((turn(queue, item), queue, item))
    heapq.heapify(heap)  # queue names are unique: items are never compared
    while heap:
        _, queue, item = heapq.heappop(heap)
        yield item
        if (item := next(iterators[queue], None)) is not None:
            heapq.heappush(heap, (turn(queue, item), queue, item))
