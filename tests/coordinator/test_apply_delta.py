"""Applying site view deltas to the coordinator's live copy of a view."""

from __future__ import annotations

from federation.api.v1 import resources_pb2
from federation.api.v1 import site_link_service_pb2 as pb
from federation.coordinator.sites.live_view import (
    COMPACT_SHARE,
    LiveView,
    hardware_came,
    plan_deltas,
)

GPU = resources_pb2.DEVICE_KIND_GPU


def node(name: str, cpu: float = 8.0, **labels: str) -> resources_pb2.Node:
    return resources_pb2.Node(
        name=name,
        cpu_cores=cpu,
        cpu_free=cpu,
        memory_free_mib=1024,
        labels=labels,
        schedulable=True,
        devices=[resources_pb2.Device(id="0", kind=GPU, model="H100")],
    )


def view(*nodes: resources_pb2.Node) -> resources_pb2.SiteView:
    return resources_pb2.SiteView(
        site="s",
        nodes=list(nodes),
        queue=resources_pb2.QueueState(pending_tasks=3, running_tasks=1, estimated_wait_s=9.0),
        labels={"tier": "gold"},
    )


def names(v: resources_pb2.SiteView) -> list[str]:
    return [n.name for n in v.nodes]


def apply_delta(
    v: resources_pb2.SiteView, delta: resources_pb2.SiteViewDelta
) -> resources_pb2.SiteView:
    """The whole view after one delta."""
    live = LiveView(v)
    live.apply(delta)
    return live.view()


def test_upsert_adds_a_new_node_in_name_order() -> None:
    """A node the view lacks is added, and nodes stay sorted by name."""
    v = view(node("a"), node("c"))
    v = apply_delta(v, resources_pb2.SiteViewDelta(upserted_nodes=[node("b")]))
    assert names(v) == ["a", "b", "c"]


def test_upsert_replaces_a_node_whole() -> None:
    """An upserted node replaces the old one entirely: fields it leaves out are gone."""
    old = node("a", cpu=8.0, zone="x")
    v = view(old, node("b"))
    new = resources_pb2.Node(name="a", cpu_free=2.0)
    v = apply_delta(v, resources_pb2.SiteViewDelta(upserted_nodes=[new]))
    assert v.nodes[0] == new
    assert not v.nodes[0].devices
    assert not v.nodes[0].labels
    assert v.nodes[1] == node("b")


def test_untouched_nodes_keep_every_field() -> None:
    """Nodes that the delta does not mention come through unchanged."""
    keep = node("k", cpu=3.0, zone="z")
    v = view(node("a"), keep)
    v = apply_delta(v, resources_pb2.SiteViewDelta(upserted_nodes=[node("a", cpu=1.0)]))
    assert v.nodes[1] == keep


def test_remove_drops_nodes_and_ignores_unknown_names() -> None:
    """Removed nodes disappear; removing a node the view lacks is harmless."""
    v = view(node("a"), node("b"), node("c"))
    v = apply_delta(v, resources_pb2.SiteViewDelta(removed_nodes=["b", "zz"]))
    assert names(v) == ["a", "c"]
    assert v.nodes[1] == node("c")


def test_view_nodes_are_sorted_even_if_they_were_not() -> None:
    """After any delta the view's nodes are in name order."""
    v = view(node("c"), node("a"), node("b"))
    v = apply_delta(v, resources_pb2.SiteViewDelta())
    assert names(v) == ["a", "b", "c"]


def test_combined_upserts_and_removals() -> None:
    """One delta may add, replace and remove nodes at once."""
    v = view(node("b"), node("d"), node("e"))
    delta = resources_pb2.SiteViewDelta(
        upserted_nodes=[node("e", cpu=1.0), node("a")], removed_nodes=["d"]
    )
    v = apply_delta(v, delta)
    assert names(v) == ["a", "b", "e"]
    assert v.nodes[2].cpu_free == 1.0


def test_delta_is_not_aliased_into_the_view() -> None:
    """Changing the delta after applying it does not change the view."""
    v = view(node("a"))
    delta = resources_pb2.SiteViewDelta(upserted_nodes=[node("b", cpu=4.0)])
    v = apply_delta(v, delta)
    delta.upserted_nodes[0].cpu_free = 0.0
    assert v.nodes[1].cpu_free == 4.0


def test_queue_is_replaced_only_when_has_queue() -> None:
    """Without has_queue the queue is untouched; with it, the delta's queue replaces it whole."""
    v = view(node("a"))
    before = resources_pb2.QueueState()
    before.CopyFrom(v.queue)
    v = apply_delta(
        v, resources_pb2.SiteViewDelta(queue=resources_pb2.QueueState(pending_tasks=99))
    )
    assert v.queue == before
    v = apply_delta(
        v,
        resources_pb2.SiteViewDelta(
            queue=resources_pb2.QueueState(pending_tasks=7), has_queue=True
        ),
    )
    assert v.queue == resources_pb2.QueueState(pending_tasks=7)


def test_empty_queue_with_has_queue_clears_the_queue() -> None:
    """has_queue with an all-zero queue means the site's queue is now empty."""
    v = view(node("a"))
    v = apply_delta(v, resources_pb2.SiteViewDelta(has_queue=True))
    assert v.queue == resources_pb2.QueueState()


def test_fields_outside_nodes_and_queue_are_untouched() -> None:
    """A delta changes only nodes and queue; the site's other fields stay."""
    v = view(node("a"))
    v = apply_delta(v, resources_pb2.SiteViewDelta(removed_nodes=["a"], has_queue=True))
    assert (v.site, dict(v.labels), list(v.nodes)) == ("s", {"tier": "gold"}, [])


def test_the_view_given_is_left_as_it_was() -> None:
    """The live view never changes the full view it started from."""
    v = view(node("a"), node("b"))
    before = v.SerializeToString(deterministic=True)
    after = apply_delta(
        v,
        resources_pb2.SiteViewDelta(
            upserted_nodes=[node("c")], removed_nodes=["a"], has_queue=True
        ),
    )
    assert after is not v
    assert names(after) == ["b", "c"]
    assert v.SerializeToString(deterministic=True) == before


def test_many_deltas_across_compactions_match_a_plain_model() -> None:
    """Node by node, through several gatherings of lone nodes into one message, the live view
    says what a plain dict of nodes says; queue and links survive the gatherings."""
    live = LiveView(view(*(node(f"n{i:02d}") for i in range(40))))
    model = {f"n{i:02d}": node(f"n{i:02d}") for i in range(40)}
    links = [resources_pb2.Link(peer_site="t", bandwidth_mbps=100.0)]
    live.apply(resources_pb2.SiteViewDelta(links=links, has_links=True))
    for step in range(40 * COMPACT_SHARE):
        name = f"n{step * 7 % 40:02d}"
        if step % 9 == 0:
            live.apply(resources_pb2.SiteViewDelta(removed_nodes=[name]))
            model.pop(name, None)
        else:
            new = node(name, cpu=float(step))
            live.apply(resources_pb2.SiteViewDelta(upserted_nodes=[new]))
            model[name] = new
        assert [n.name for n in live.nodes()] == sorted(model)
    final = live.view()
    assert list(final.nodes) == [model[name] for name in sorted(model)]
    assert list(final.links) == links
    assert final.queue == view().queue
    assert live.header.nodes == []  # the nodes live apart from the header


def test_placement_arrays_are_rebuilt_only_when_nodes_change() -> None:
    """The site's part of the snapshot is kept through a queue change and rebuilt, with the
    new numbers, after a node change."""
    live = LiveView(view(node("a"), node("b")))
    part = live.part()
    live.apply(resources_pb2.SiteViewDelta(queue=resources_pb2.QueueState(), has_queue=True))
    assert live.part() is part
    live.apply(resources_pb2.SiteViewDelta(upserted_nodes=[node("b", cpu=1.0)]))
    assert live.part() is not part
    assert live.part().node_cpu_free.tolist() == [8.0, 1.0]


def test_the_full_view_is_copied_not_kept() -> None:
    """The live view holds nothing of the message it started from (keeping a part of it
    would keep the whole stream message it arrived in)."""
    full = view(node("a"))
    live = LiveView(full)
    full.nodes[0].cpu_free = 0.0
    full.site = "changed"
    assert live.view().nodes[0].cpu_free == 8.0
    assert live.header.site == "s"


def changed(base: resources_pb2.Node, **edits: object) -> resources_pb2.Node:
    out = resources_pb2.Node()
    out.CopyFrom(base)
    for field_name, value in edits.items():
        if isinstance(value, dict):
            getattr(out, field_name).update(value)
        elif isinstance(value, resources_pb2.MeasuredUse):
            getattr(out, field_name).CopyFrom(value)
        else:
            setattr(out, field_name, value)
    return out


def test_a_delta_says_whether_room_grew() -> None:
    """Room that tasks may book counts (freed cores, memory, devices, a node back or new);
    measured use, labels, a node leaving and a queue change do not."""
    booked = node("a")
    booked.cpu_free = 2.0
    booked.devices[0].allocated = True
    booked.devices[0].health = resources_pb2.DEVICE_HEALTH_HEALTHY

    def grew(**edits: object) -> bool:
        live = LiveView(view(booked))
        return live.apply(resources_pb2.SiteViewDelta(upserted_nodes=[changed(booked, **edits)]))

    assert grew(cpu_free=4.0)
    assert grew(memory_free_mib=2048)
    assert not grew(cpu_free=1.0)
    assert not grew(labels={"driver": "550"})
    assert not grew(measured=resources_pb2.MeasuredUse(compute=0.1))
    freed = changed(booked)
    freed.devices[0].allocated = False
    assert LiveView(view(booked)).apply(resources_pb2.SiteViewDelta(upserted_nodes=[freed]))
    sick = changed(booked)
    sick.devices[0].health = resources_pb2.DEVICE_HEALTH_UNHEALTHY
    live = LiveView(view(sick))
    assert live.apply(resources_pb2.SiteViewDelta(upserted_nodes=[booked]))  # healthy again
    cordoned = changed(booked, schedulable=False)
    assert LiveView(view(cordoned)).apply(resources_pb2.SiteViewDelta(upserted_nodes=[booked]))
    assert LiveView(view(booked)).apply(resources_pb2.SiteViewDelta(upserted_nodes=[node("b")]))
    live = LiveView(view(booked, node("b")))
    assert not live.apply(resources_pb2.SiteViewDelta(removed_nodes=["b"]))
    queue = resources_pb2.QueueState(pending_tasks=1)
    assert not live.apply(resources_pb2.SiteViewDelta(has_queue=True, queue=queue))


def test_hardware_came_only_with_devices_health_or_labels_a_node_had_not() -> None:
    """What may let a task in that no site had the hardware for: a node new or back, a device
    new or healthy again, other labels; room coming free, or less of it, does not."""
    before = node("a")
    before.devices[0].health = resources_pb2.DEVICE_HEALTH_HEALTHY

    def came(**edits: object) -> bool:
        return hardware_came(before, changed(before, **edits))

    assert hardware_came(None, before)
    assert came(labels={"driver": "550"})
    assert not came(cpu_free=1.0)
    assert not came(cpu_free=16.0)  # room, not hardware
    assert not came(memory_free_mib=4096)
    more = changed(before)
    more.devices.add(id="1", kind=GPU, model="A100")
    assert hardware_came(before, more)
    sick = changed(before)
    sick.devices[0].health = resources_pb2.DEVICE_HEALTH_UNHEALTHY
    assert hardware_came(sick, before)
    assert not hardware_came(before, sick)
    assert hardware_came(changed(before, schedulable=False), before)


def test_a_write_is_planned_against_the_view_as_its_earlier_messages_leave_it() -> None:
    """``plan_deltas`` reads each delta of one stream write against the view as the deltas
    before it in that write leave it, so each node is compared once: a plan is used only by
    the view it was read from, after exactly the deltas before it."""
    a, b = node("a"), node("b")
    live = LiveView(view(a, b))
    first = changed(a, cpu_free=2.0)
    second = changed(first)
    second.devices[0].health = resources_pb2.DEVICE_HEALTH_UNHEALTHY
    heartbeat = pb.AgentMessage(heartbeat=pb.Heartbeat())
    messages = [
        update(upserted_nodes=[first]),
        heartbeat,
        update(upserted_nodes=[second], removed_nodes=["b"]),
        update(upserted_nodes=[b]),
    ]
    plans = plan_deltas(live, messages)
    assert sorted(plans) == [0, 2, 3]
    assert [c.came_at for c in plans[0].changes] == [[]]  # only the CPU changed
    moved = plans[2].changes
    assert [(c.was is not None, c.now is not None) for c in moved] == [(True, False), (True, True)]
    assert list(moved[1].came_at) == [0]  # against ``first``, not the view's ``a``
    assert plans[3].changes[0].was is None  # b was removed by the write's earlier delta
    for i in sorted(plans):
        assert plans[i].valid_for(live)
        live.apply(messages[i].view.delta, plans[i].changes)
        assert not plans[i].valid_for(live)
    assert live.view() == view(second, b)
    # A full view in the write: later deltas read its nodes, and no view can use their plans.
    full = pb.ViewUpdate(full=view(node("c")))
    later = plan_deltas(live, [pb.AgentMessage(view=full), update(upserted_nodes=[node("c")])])
    assert later[1].changes[0].was == node("c")
    assert later[1].view is None
    assert not later[1].valid_for(live)


def update(**delta: object) -> pb.AgentMessage:
    return pb.AgentMessage(view=pb.ViewUpdate(delta=resources_pb2.SiteViewDelta(**delta)))
