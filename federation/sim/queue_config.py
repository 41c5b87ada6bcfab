"""The topology's queues and priority classes, read from its YAML and checked as the
coordinator checks them."""

from __future__ import annotations

from collections.abc import Mapping

from federation.api.v1 import queues_pb2
from federation.config import ConfigError
from federation.coordinator.policy.priority import PriorityClass, parse_priority_classes
from federation.coordinator.policy.queues import queue_violations
from federation.sim.fields import Fields, InputFileError


def parse_queues(top: Fields) -> dict[str, queues_pb2.Queue]:
    """The top level's ``queues``: each checked as ``fedctl queues create`` checks it."""
    queues = []
    for item in top.items("queues"):
        queue = queues_pb2.Queue(
            name=item.string("name"),
            tenant=item.string("tenant", ""),
            weight=item.number("weight", 1.0),
            parent=item.string("parent", ""),
        )
        for q in item.items("quotas"):
            resource = q.string("resource")
            if "/" in resource:
                # The coordinator narrows a task's sites and models by such quotas, which the
                # replay's offers do not carry.
                raise q.fail("resource", f"{resource}: quotas of one model are not simulated")
            queue.quotas.add(
                resource=resource,
                nominal=q.number("nominal"),
                borrowing_limit=q.number("borrowing_limit", 0.0),
            )
            q.done()
        item.done()
        queues.append(queue)
    names = [q.name for q in queues]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise top.fail("queues", f"duplicate queue name(s) {', '.join(duplicates)}")
    known = {q.name: q for q in queues}
    for i, queue in enumerate(queues):
        for problem in queue_violations(queue, known, f"queues[{i}]"):
            raise InputFileError(f"{top.source}: {problem.field}: {problem.description}")
        queue.weight = queue.weight or 1.0  # as the queue book stores it: zero means 1
    return known


def parse_classes(top: Fields) -> dict[str, PriorityClass]:
    """The top level's ``priority_classes``, as the coordinator's config gives them."""
    raw = top.raw("priority_classes")
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise top.fail("priority_classes", "expected a mapping: name -> {value: ...}")
    try:
        return parse_priority_classes({str(k): v for k, v in raw.items()}, source=top.source)
    except ConfigError as err:
        raise InputFileError(str(err)) from None
