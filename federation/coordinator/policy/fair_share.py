"""Weighted dominant-resource fairness between queues (as Armada and Volcano's DRF do)."""

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


def fair_order(lines: Mapping[str, Iterable[T]], share: Callable[[str], float]) -> Iterator[T]:
    """The items of every queue's line, each next one from the queue with the smallest share
    now: ``share`` is asked again each time a queue's turn comes round, so a queue whose
    tasks were just admitted falls back behind the others (ties go to the queue's name)."""
    iterators = {queue: iter(items) for queue, items in lines.items()}
    heap = [(share(queue), queue) for queue in iterators]
    heapq.heapify(heap)
    while heap:
        _, queue = heapq.heappop(heap)
        item = next(iterators[queue], None)
        if item is None:
            continue
        yield item
        heapq.heappush(heap, (share(queue), queue))
