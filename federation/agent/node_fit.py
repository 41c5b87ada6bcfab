"""Whether a site may take an offered task, and which of its nodes may run it: the node has the
final say.

Every core asks ``task_problem`` first: a job id or task name that is no folder name, a task
without a command or with a cpu request that is no count is declined alike everywhere. A core
then adds only what its own scheduler cannot do (Slurm's GRES and partition, say).

The coordinator accepts a site when any of its nodes qualifies; the site must then put every
replica on a node that does. The cores ask ``qualifying_nodes``, so a node label, a cordon or a
software requirement means the same at every site and at the coordinator: the node's labels
(with its ``arch``) carry each of the job's node labels exactly and meet every requirement, read
through the same compatibility table as the coordinator's Compatibility filter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from federation.api.v1 import resources_pb2, site_link_service_pb2
from federation.placement.compat import CompatError, CompatTable, node_labels, unmet

MAX_NAMED = 3
"""Nodes named in a decline reason; the rest are counted."""


def bad_path_part(value: str) -> bool:
    """Whether ``value`` (a job id, say) is no single folder name."""
    return not value or "/" in value or "\0" in value or value in (".", "..")


def bad_task_name(value: str) -> bool:
    """A task's name is one folder, or two for a part of a divided task ("train/1")."""
    head, part, number = value.rpartition("/")
    if part:
        return bad_path_part(head) or not (number.isascii() and number.isdigit())
    return bad_path_part(value)


def invalid_names(offer: site_link_service_pb2.Offer) -> str:
    """Why an offer whose job id or task name the site cannot take is declined."""
    return f"invalid job id or task name {offer.job_id!r}/{offer.task!r}"


def task_problem(offer: site_link_service_pb2.Offer) -> str:
    """Why the site declines the offer's task whatever its nodes, or "" when it does not."""
    if bad_path_part(offer.job_id) or bad_task_name(offer.task):
        return invalid_names(offer)
    if not offer.spec.command:
        return "task has no command"
    cpu = offer.spec.resources.cpu
    if not math.isfinite(cpu) or cpu < 0:
        return f"invalid cpu request {cpu}"
    return ""


def node_problem(
    node: resources_pb2.Node,
    wanted: Mapping[str, str],
    requires: tuple[tuple[str, str], ...],
    table: CompatTable,
) -> str:
    """Why ``node`` may not run the task, or "" when it may."""
    labels = node_labels(node)
    for key, value in sorted(wanted.items()):
        if labels.get(key) != value:
            has = f"{labels[key]!r}" if key in labels else "none"
            return f"needs node label {key}={value!r}, has {has}"
    try:
        return unmet(requires, labels, table) or ""
    except CompatError as err:  # the coordinator refuses these at submit
        return str(err)


def qualifying_nodes(
    nodes: Iterable[resources_pb2.Node],
    offer: site_link_service_pb2.Offer,
    table: CompatTable,
) -> list[resources_pb2.Node] | str:
    """The nodes that may run ``offer``'s task, or why none may (naming the first few)."""
    requires = tuple(sorted(offer.spec.requires.items()))
    found: list[resources_pb2.Node] = []
    refused: list[str] = []
    cordoned = set(offer.cordoned_nodes)
    for node in nodes:
        if node.name in cordoned:
            refused.append(f"{node.name} is cordoned")
        elif problem := node_problem(node, offer.node_labels, requires, table):
            refused.append(f"{node.name} {problem}")
        else:
            found.append(node)
    if found or not refused:
        return found
    more = len(refused) - MAX_NAMED
    return (
        "no node qualifies: "
        + "; ".join(refused[:MAX_NAMED])
        + (f" (and {more} more nodes)" if more > 0 else "")
    )
