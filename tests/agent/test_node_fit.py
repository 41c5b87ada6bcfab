"""Which nodes may run a task: labels, arch and software requirements, as the coordinator reads
them."""

from __future__ import annotations

from federation.agent.node_fit import qualifying_nodes
from federation.placement.compat import load_table_files

from .cores import node, offer

TABLE = load_table_files()


def test_only_nodes_with_every_label_and_requirement_qualify() -> None:
    nodes = [
        node("old", labels={"driver": "470.82", "torch": "2.4.1"}, arch="x86_64"),
        node("new", labels={"driver": "550.54", "torch": "2.4.1"}, arch="x86_64"),
        node("arm", labels={"driver": "550.54", "torch": "2.4.1"}, arch="aarch64"),
    ]
    ask = offer(requires={"cuda": ">=12.1", "arch": "x86_64"}, node_labels={"torch": "2.4.1"})
    found = qualifying_nodes(nodes, ask, TABLE)
    assert not isinstance(found, str)
    assert [n.name for n in found] == ["new"]  # the driver 550 runs CUDA 12.4


def test_why_none_qualifies_names_the_first_nodes_and_counts_the_rest() -> None:
    nodes = [node(f"n{i}", labels={"torch": "2.3.0"} if i == 0 else {}) for i in range(5)]
    reason = qualifying_nodes(nodes, offer(node_labels={"torch": "2.4.1"}), TABLE)
    assert reason == (
        "no node qualifies: n0 needs node label torch='2.4.1', has '2.3.0'; "
        "n1 needs node label torch='2.4.1', has none; "
        "n2 needs node label torch='2.4.1', has none (and 2 more nodes)"
    )


def test_an_unreadable_requirement_is_a_reason_not_an_error() -> None:
    reason = qualifying_nodes([node("n")], offer(requires={"cuda": "latest!"}), TABLE)
    assert isinstance(reason, str)
    assert "not a valid version range" in reason
