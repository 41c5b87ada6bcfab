"""May a task of a queue start now? Quotas, borrowing and the queue hierarchy, as one pure
function over the queues and what each holds.

A queue may always hold its *nominal* quota of a resource. Beyond it, up to its *borrowing
limit* more, while the queues beside it (its cohort: the queues with the same parent) leave
theirs idle: together the cohort holds no more of a resource than the sum of its nominal
quotas. So a task within its nominal quota waits too while the cohort holds all of that sum:
the queues that borrow owe it back (``owed``), and the scheduler stops their tasks for it. A
queue's quotas bound the queues under it together, so a task is checked against its queue and
every queue above it. Resources a queue sets no quota for are not limited by it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from federation.api.v1 import queues_pb2
from federation.coordinator.policy.resources import Demand, quota_key, quota_label

EPSILON = 1e-9
Held = Callable[[str], Mapping[str, float]]
"""What a queue and the queues under it hold now, by resource."""


@dataclass(frozen=True, slots=True)
class Debt:
    """What the queues beside ``queue`` must give back of ``key`` so that a task of ``queue``
    within its nominal quota may start without the cohort holding more than its nominal
    quotas together."""

    queue: str
    key: str
    amount: float
    over: Mapping[str, float]
    """Each queue beside ``queue`` that borrows ``key``: how much it holds over its nominal."""


def admission(
    name: str,
    need: Demand,
    queues: Mapping[str, queues_pb2.Queue],
    held: Held,
    borrowed: Callable[[str, str], bool] | None = None,
) -> str | None:
    """None when a task of queue ``name`` that needs ``need`` may start now; else why not,
    in quota terms, for people (``fedctl jobs explain``). ``borrowed(queue, key)``: whether
    some queue beside ``queue`` may hold more than its nominal quota of ``key``; where none
    does, the queues beside one within its nominal quota cannot hold all of their sum, and
    are not read (None: they are always read)."""
    current = name
    while current in queues:  # a parent deleted meanwhile ends the walk as the top would
        queue = queues[current]
        for quota in queue.quotas:
            key = quota_key(quota)
            want = need.get(key, 0.0)
            if not want:
                continue
            now = held(current).get(key, 0.0)
            after = now + want
            what = f"{quota_label(quota)} quota ({now:g}/{quota.nominal:g})"
            if after <= quota.nominal + EPSILON:
                if borrowed is not None and not borrowed(current, key):
                    continue
                used, pool = _cohort(current, key, queues, held)
                if used + want > pool + EPSILON:  # it is owed what the queues beside it borrow
                    return (
                        f"queue {current} within its nominal {what}, but the queues beside it "
                        f"hold {used:g} of their {pool:g} {quota_label(quota)} together: waits "
                        "for what they borrow to be given back"
                    )
                continue
            if after > quota.nominal + quota.borrowing_limit + EPSILON:
                limit = f", may borrow {quota.borrowing_limit:g}" if quota.borrowing_limit else ""
                return f"queue {current} at its {what}{limit}; this task needs {want:g}"
            used, pool = _cohort(current, key, queues, held)
            if used + want > pool + EPSILON:
                return (
                    f"queue {current} at its nominal {what}, borrowing blocked: the queues "
                    f"beside it hold {used:g} of their {pool:g} {quota_label(quota)} together"
                )
        current = queue.parent
    return None


def within_nominal(
    name: str, need: Demand, queues: Mapping[str, queues_pb2.Queue], held: Held
) -> bool:
    """Whether a task of queue ``name`` that needs ``need`` fits within the nominal quotas of
    its queue and every queue above it: what it would take is owed to it, not borrowed."""
    current = name
    while current in queues:
        queue = queues[current]
        for quota in queue.quotas:
            key = quota_key(quota)
            want = need.get(key, 0.0)
            if want and held(current).get(key, 0.0) + want > quota.nominal + EPSILON:
                return False
        current = queue.parent
    return True


def owed(
    name: str, need: Demand, queues: Mapping[str, queues_pb2.Queue], held: Held
) -> list[Debt] | None:
    """When a task of queue ``name`` that needs ``need`` is within the nominal quotas of its
    queue and every queue above it: what the queues beside each of them must give back for it
    to start (nothing: []). None when it would borrow itself: it is owed nothing."""
    if not within_nominal(name, need, queues, held):
        return None
    debts = []
    current = name
    while current in queues:
        queue = queues[current]
        for quota in queue.quotas:
            key = quota_key(quota)
            want = need.get(key, 0.0)
            used, pool = _cohort(current, key, queues, held) if want else (0.0, 0.0)
            if want and used + want > pool + EPSILON:
                over = {}
                for other in queues.values():
                    if other.parent != queue.parent or other.name == current:
                        continue
                    nominal = _nominal(other, key)
                    theirs = held(other.name).get(key, 0.0)
                    if nominal is not None and theirs > nominal + EPSILON:
                        over[other.name] = theirs - nominal
                debts.append(Debt(current, key, used + want - pool, over))
        current = queue.parent
    return debts


def _nominal(queue: queues_pb2.Queue, key: str) -> float | None:
    """``queue``'s nominal quota of ``key``, or None when it sets none."""
    return next((q.nominal for q in queue.quotas if quota_key(q) == key), None)


def _cohort(
    name: str, key: str, queues: Mapping[str, queues_pb2.Queue], held: Held
) -> tuple[float, float]:
    """What the queues beside ``name`` (itself included) that set a quota counting ``key``
    hold of it together, and the sum of their nominal quotas of it."""
    parent = queues[name].parent
    used = pool = 0.0
    for other in queues.values():
        if other.parent != parent:
            continue
        if (nominal := _nominal(other, key)) is not None:
            pool += nominal
            used += held(other.name).get(key, 0.0)
    return used, pool
