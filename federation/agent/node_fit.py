"""Which of a site's nodes may run a task: the node has the final say.

The coordinator accepts a site when any of its nodes qualifies; the site must then put every
replica on a node that does. Both cores (embedded and Slurm) ask here, so a node label or a
software requirement means the same at every site and at the coordinator: the node's labels
(with its ``arch``) carry each of the job's node labels exactly and meet every requirement, read
through the same compatibility table as the coordinator's Compatibility filter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from federation.api.v1 import resources_pb2, site_link_service_pb2
from federation.placement.compat import CompatError, CompatTable, node_labels, unmet

MAX_NAMED = 3
"""Nodes named in a decline reason; the rest are counted."""


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
