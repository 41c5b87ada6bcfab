"""The checks on what a site sends: every bad number, count and probe endpoint named by field."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from federation.agent.config import AgentConfig
from federation.agent.discovery import discover_host_node
from federation.agent.embedded_core import EmbeddedCore
from federation.agent.enroll import credential_paths
from federation.agent.inventory import load_inventory
from federation.agent.links import declared_links
from federation.agent.runtime import AgentRuntime
from federation.api.v1 import admin_service_pb2, jobs_pb2, resources_pb2
from federation.api.v1 import site_link_service_pb2 as pb
from federation.coordinator.sites.checks import (
    MAX_ENVELOPE_MESSAGES,
    MAX_HELLO_TASKS,
    MAX_VIEW_NODES,
    check_envelope,
    peer_address,
    probe_endpoint_problem,
)
from federation.coordinator.sites.live_view import LiveView, plan_deltas
from federation.coordinator.sites.registry import SiteRegistry, SiteSession
from federation.errors import InvalidArgumentError
from federation.placement.selector_cost import MAX_ATTRIBUTE_CHARS, MAX_DEVICE_ATTRIBUTES
from federation.security.interceptors import MAX_VIOLATIONS
from federation.store import SqliteStore

PEER = "ipv4:10.0.0.7:51234"

INVENTORY = """\
nodes:
  - name: dgx
    cpu_cores: 64
    memory_mib: 524288
    labels: {cuda: "12.4"}
    devices:
      - kind: GPU
        vendor: nvidia
        model: A100-40GB
        memory_mib: 40960
        count: 2
        tflops_fp16: 312
        power_tdp_watts: 400
        interconnect_group: nvlink-0
        attributes: {compute_capability: "8.0"}
        partitions: [{profile: 1g.5gb, count: 7, memory_mib: 4864}]
      - kind: NPU
        vendor: huawei
        model: Ascend-910B
        memory_mib: 65536
        shareable: true
"""


@pytest.fixture
async def runtime(tmp_path: Path) -> AsyncIterator[AgentRuntime]:
    """An agent runtime over this host's discovery and a declared inventory, as agents run."""
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY)
    config = AgentConfig(
        site="dc-1",
        domain="datacenter",
        coordinator="127.0.0.1:1",
        ca=tmp_path / "ca.pem",
        state_dir=tmp_path,
        price_per_device_hour=2.5,
        labels={"zone": "a"},
        datasets={"imagenet": 150 << 30},
    )
    core = EmbeddedCore(
        [discover_host_node(), *load_inventory(inventory)],
        site=config.site,
        work_dir=tmp_path / "work",
        on_status=lambda report: None,
        on_change=lambda: None,
    )
    yield AgentRuntime(config, credential_paths(tmp_path), core, probe_endpoint="10.0.0.7:7400")
    await core.close()


def hello(view: resources_pb2.SiteView, *tasks: pb.TaskReport) -> list[pb.AgentMessage]:
    return [pb.AgentMessage(hello=pb.Hello(view=view, generation=1, tasks=tasks))]


def refused(messages: list[pb.AgentMessage], *, first: bool = True) -> dict[str, str]:
    """Field -> description of every violation the check names."""
    with pytest.raises(InvalidArgumentError) as caught:
        check_envelope(messages, PEER, first=first)
    return {v.field: v.description for v in caught.value.violations}


def good_view() -> resources_pb2.SiteView:
    view = resources_pb2.SiteView(site="s", price_per_device_hour=1.0, probe_endpoint="10.0.0.7:1")
    view.queue.estimated_wait_s = 5
    node = view.nodes.add(name="n", cpu_cores=8, cpu_free=4, memory_mib=1024, memory_free_mib=512)
    device = node.devices.add(
        kind=resources_pb2.DEVICE_KIND_GPU, memory_total_mib=80, free_fraction=1
    )
    device.partitions.add(profile="1g.10gb", total=7, free=7)
    view.links.add(peer_site="t", bandwidth_mbps=100, rtt_ms=3, measured_at=1.7e9)
    return view


def test_views_from_agent_discovery_pass(runtime: AgentRuntime) -> None:
    """A hello and a delta built by the agent itself, over its discovered host and declared
    GPUs (with MIG profiles) and NPUs, pass: the checks refuse no honest site."""
    view = runtime.full_view()
    view.links.extend(
        declared_links([{"peer": "edge", "bandwidth_mbps": 50, "rtt_ms": 20}], source="t")
    )
    report = pb.TaskReport(job_id="j", task="t", epoch=1, state=jobs_pb2.JOB_STATE_RUNNING)
    report.checkpoint.bytes = 10 << 30
    report.checkpoint.progress_s = 60
    report.checkpoint.time.GetCurrentTime()
    check_envelope(hello(view, report), PEER, first=True)
    delta = runtime._delta()  # nothing marked sent: it carries every node
    assert len(delta.delta.upserted_nodes) == len(view.nodes) == 2
    check_envelope([pb.AgentMessage(view=delta)], PEER, first=False)


def test_good_view_passes() -> None:
    """The view the other tests spoil passes as it is."""
    check_envelope(hello(good_view()), PEER, first=True)


Spoil = Callable[[resources_pb2.SiteView], object]
BAD_VIEWS: list[tuple[str, Spoil, str]] = [
    ("NaN price", lambda v: setattr(v, "price_per_device_hour", math.nan), "price_per_device_hour"),
    ("negative power", lambda v: setattr(v, "power_watts", -1.0), "power_watts"),
    (
        "infinite wait",
        lambda v: setattr(v.queue, "estimated_wait_s", math.inf),
        "queue.estimated_wait_s",
    ),
    ("negative cpu", lambda v: setattr(v.nodes[0], "cpu_free", -1.0), "nodes[0].cpu_free"),
    ("cpu free > total", lambda v: setattr(v.nodes[0], "cpu_free", 9.0), "nodes[0].cpu_free"),
    (
        "memory 2^64-1",
        lambda v: setattr(v.nodes[0], "memory_mib", 2**64 - 1),
        "nodes[0].memory_mib",
    ),
    (
        "memory free > total",
        lambda v: setattr(v.nodes[0], "memory_free_mib", 2048),
        "nodes[0].memory_free_mib",
    ),
    (
        "device memory 2^64-1",
        lambda v: setattr(v.nodes[0].devices[0], "memory_total_mib", 2**64 - 1),
        "nodes[0].devices[0].memory_total_mib",
    ),
    (
        "device memory free > total",
        lambda v: setattr(v.nodes[0].devices[0], "memory_free_mib", 81),
        "nodes[0].devices[0].memory_free_mib",
    ),
    (
        "infinite speed",
        lambda v: setattr(v.nodes[0].devices[0], "tflops_fp16", math.inf),
        "nodes[0].devices[0].tflops_fp16",
    ),
    (
        "negative device power",
        lambda v: setattr(v.nodes[0].devices[0], "power_tdp_watts", -300.0),
        "nodes[0].devices[0].power_tdp_watts",
    ),
    (
        "NaN temperature",
        lambda v: setattr(v.nodes[0].devices[0], "temperature_c", math.nan),
        "nodes[0].devices[0].temperature_c",
    ),
    (
        "fraction over 1",
        lambda v: setattr(v.nodes[0].devices[0], "free_fraction", 1.5),
        "nodes[0].devices[0].free_fraction",
    ),
    (
        "negative fraction",
        lambda v: setattr(v.nodes[0].devices[0], "free_fraction", -0.5),
        "nodes[0].devices[0].free_fraction",
    ),
    (
        "device use over 1",
        lambda v: setattr(v.nodes[0].devices[0].measured, "compute", 1.5),
        "nodes[0].devices[0].measured.compute",
    ),
    (
        "device memory used over its total",
        lambda v: setattr(v.nodes[0].devices[0].measured, "memory_used_mib", 81),
        "nodes[0].devices[0].measured.memory_used_mib",
    ),
    (
        "NaN node CPU use",
        lambda v: setattr(v.nodes[0].measured, "compute", math.nan),
        "nodes[0].measured.compute",
    ),
    (
        "unknown device kind",
        lambda v: setattr(v.nodes[0].devices[0], "kind", 999),
        "nodes[0].devices[0].kind",
    ),
    (
        "partition free > total",
        lambda v: setattr(v.nodes[0].devices[0].partitions[0], "free", 8),
        "nodes[0].devices[0].partitions[0].free",
    ),
    ("NaN rtt", lambda v: setattr(v.links[0], "rtt_ms", math.nan), "links[0].rtt_ms"),
    (
        "infinite coordinator link",
        lambda v: setattr(v.coordinator_link, "bandwidth_mbps", math.inf),
        "coordinator_link.bandwidth_mbps",
    ),
    (
        "negative bandwidth",
        lambda v: setattr(v.links[0], "bandwidth_mbps", -1.0),
        "links[0].bandwidth_mbps",
    ),
    (
        "too many attributes",
        lambda v: (
            v.nodes[0]
            .devices[0]
            .attributes.update({f"k{i}": "v" for i in range(MAX_DEVICE_ATTRIBUTES + 1)})
        ),
        "nodes[0].devices[0].attributes",
    ),
    (
        "long attribute",
        lambda v: v.nodes[0].devices[0].attributes.update({"k": "x" * (MAX_ATTRIBUTE_CHARS + 1)}),
        "nodes[0].devices[0].attributes['k']",
    ),
    ("huge dataset", lambda v: v.datasets.update({"d": 2**64 - 1}), "datasets['d']"),
    ("probe elsewhere", lambda v: setattr(v, "probe_endpoint", "10.9.9.9:7400"), "probe_endpoint"),
    (
        "huge image",
        lambda v: v.nodes[0].images.add(references=["r.io/a:1"], size_bytes=2**64 - 1),
        "nodes[0].images[0].size_bytes",
    ),
    (
        "long image reference",
        lambda v: v.nodes[0].images.add(references=["r.io/" + "a" * MAX_ATTRIBUTE_CHARS]),
        "nodes[0].images[0].references[0]",
    ),
    (
        "too many images",
        lambda v: v.nodes[0].images.extend(
            resources_pb2.CachedImage(references=[f"r.io/a:{i}"]) for i in range(257)
        ),
        "nodes[0].images",
    ),
    ("long image refusal", lambda v: setattr(v, "image_refusal", "x" * 4097), "image_refusal"),
    (
        "long registry",
        lambda v: v.image_registries.append("r" * (MAX_ATTRIBUTE_CHARS + 1)),
        "image_registries[0]",
    ),
]


@pytest.mark.parametrize(
    ("spoil", "field"), [b[1:] for b in BAD_VIEWS], ids=[b[0] for b in BAD_VIEWS]
)
def test_bad_view_is_refused_naming_the_field(spoil: Spoil, field: str) -> None:
    """Each kind of bad figure in a hello's view is refused, named by its proto field path."""
    view = good_view()
    spoil(view)
    assert list(refused(hello(view))) == [f"hello.view.{field}"]


def test_bad_full_view_and_delta_are_named_by_message() -> None:
    """After the hello, a message is named by its place in its stream write."""
    full = good_view()
    full.nodes[0].cpu_free = math.nan
    delta = resources_pb2.SiteViewDelta(upserted_nodes=[full.nodes[0]], has_queue=True)
    delta.queue.estimated_wait_s = -1
    messages = [
        pb.AgentMessage(heartbeat=pb.Heartbeat()),
        pb.AgentMessage(view=pb.ViewUpdate(full=full)),
        pb.AgentMessage(view=pb.ViewUpdate(delta=delta)),
    ]
    assert set(refused(messages, first=False)) == {
        "messages[1].view.full.nodes[0].cpu_free",
        "messages[2].view.delta.upserted_nodes[0].cpu_free",
        "messages[2].view.delta.queue.estimated_wait_s",
    }


def test_bad_task_reports_are_refused() -> None:
    """Reports with a state no site holds, or a checkpoint of impossible size, progress or
    time, are refused, in a hello and on their own."""
    report = pb.TaskReport(job_id="j", task="t", epoch=1, state=jobs_pb2.JOB_STATE_PENDING)
    report.checkpoint.bytes = 2**64 - 1
    report.checkpoint.progress_s = math.inf
    report.checkpoint.time.seconds = -1
    answer = pb.OfferAnswer(accepted=True, lease_s=math.nan)
    messages = [*hello(good_view(), report), pb.AgentMessage(offer_answer=answer)]
    messages.append(pb.AgentMessage(task_status=report))
    found = refused(messages)
    assert set(found) == {
        *(
            f"{where}.{name}"
            for where in ("hello.tasks[0]", "messages[2].task_status")
            for name in (
                "state",
                "checkpoint.bytes",
                "checkpoint.progress_s",
                "checkpoint.time.seconds",
            )
        ),
        "messages[1].offer_answer.lease_s",
    }


def test_counts_are_bounded_before_anything_is_read() -> None:
    """Too many nodes, hello tasks or messages in one write are refused for their number."""
    view = good_view()
    view.nodes.extend([view.nodes[0]] * MAX_VIEW_NODES)
    tasks = [pb.TaskReport(job_id="j", task="t", state=jobs_pb2.JOB_STATE_RUNNING)]
    found = refused(hello(view, *tasks * (MAX_HELLO_TASKS + 1)))
    assert set(found) == {"hello.view.nodes", "hello.tasks"}
    assert found["hello.tasks"] == f"at most {MAX_HELLO_TASKS} entries, got {MAX_HELLO_TASKS + 1}"
    heartbeats = [pb.AgentMessage(heartbeat=pb.Heartbeat())] * (MAX_ENVELOPE_MESSAGES + 1)
    assert set(refused(heartbeats, first=False)) == {"messages"}


def test_a_delta_checks_the_devices_it_changed() -> None:
    """A device of a delta's node equal to the one the site's view holds at its place passed
    the checks when it came and is passed by; one that changed is checked, named by its place,
    and so is every device of a node whose devices came in another number or order."""
    held = good_view().nodes[0]
    held.devices.add(kind=resources_pb2.DEVICE_KIND_GPU, memory_total_mib=80)
    held.devices[0].memory_free_mib = 100  # as if it had passed: the delta's copy is not read
    node = resources_pb2.Node()
    node.CopyFrom(held)
    node.cpu_free = 2
    node.devices[1].memory_free_mib = 81
    path = "messages[0].view.delta.upserted_nodes[0]"

    live = LiveView(resources_pb2.SiteView(site="s", nodes=[held]))

    def found(*nodes: resources_pb2.Node) -> set[str]:
        messages = [
            pb.AgentMessage(
                view=pb.ViewUpdate(delta=resources_pb2.SiteViewDelta(upserted_nodes=[n]))
            )
            for n in nodes
        ]
        with pytest.raises(InvalidArgumentError) as caught:
            check_envelope(messages, PEER, first=False, plans=plan_deltas(live, messages))
        return {v.field for v in caught.value.violations}

    assert found(node) == {f"{path}.devices[1].memory_free_mib"}
    # A second delta of the same write is compared with the first: its bad device came there.
    again = resources_pb2.Node()
    again.CopyFrom(node)
    again.cpu_free = 1
    assert found(node, again) == {f"{path}.devices[1].memory_free_mib"}
    node.devices.add().CopyFrom(node.devices[1])
    node.devices[2].memory_free_mib = 0
    assert found(node) == {
        f"{path}.devices[0].memory_free_mib",
        f"{path}.devices[1].memory_free_mib",
    }


def test_violations_are_capped() -> None:
    """A view bad everywhere names the first MAX_VIOLATIONS fields and stops reading there."""
    view = good_view()
    view.nodes.extend([resources_pb2.Node(name="x", cpu_cores=math.nan)] * 100)
    assert len(refused(hello(view))) == MAX_VIOLATIONS


@pytest.mark.parametrize(
    ("peer", "address"),
    [
        ("ipv4:127.0.0.1:5555", "127.0.0.1"),
        ("ipv6:[::1]:5555", "::1"),
        ("ipv6:%5B::1%5D:5555", "::1"),  # as grpc names it
        ("ipv6:%5B::ffff:10.0.0.7%5D:5555", "10.0.0.7"),  # an IPv4 client of a dual-stack port
        ("unix:/run/coordinator.sock", None),
    ],
)
def test_peer_address(peer: str, address: str | None) -> None:
    """The address is read from each form of gRPC's peer name."""
    found = peer_address(peer)
    assert (str(found) if found else None) == address


@pytest.mark.parametrize(
    ("endpoint", "peer", "ok"),
    [
        ("127.0.0.1:7400", "ipv4:127.0.0.1:5555", True),
        ("[::1]:7400", "ipv6:%5B::1%5D:5555", True),
        ("10.0.0.7:7400", "ipv6:%5B::ffff:10.0.0.7%5D:5555", True),
        ("10.0.0.8:7400", "ipv4:10.0.0.7:5555", False),  # another host: an attack on it
        ("edge.example.org:7400", "ipv4:10.0.0.7:5555", False),  # could resolve anywhere
        ("0.0.0.0:7400", "ipv4:10.0.0.7:5555", False),
        ("10.0.0.7:0", "ipv4:10.0.0.7:5555", False),
        ("10.0.0.7", "ipv4:10.0.0.7:5555", False),
        ("10.0.0.7:7400", "unix:/run/c.sock", False),
    ],
)
def test_probe_endpoint_must_be_on_the_peer(endpoint: str, peer: str, ok: bool) -> None:
    """A probe endpoint passes only as an IP address the site's stream comes from, and a port."""
    assert (probe_endpoint_problem(endpoint, peer) is None) == ok


async def test_only_checked_probe_endpoints_are_announced(store: SqliteStore) -> None:
    """Peers are told the endpoint each session checked, never one a stored view names."""
    sites = SiteRegistry(store, lambda: None)
    sessions = {}
    for name, checked in (("a", "10.0.0.1:7400"), ("b", ""), ("c", "10.0.0.3:7400")):
        sites.registered(admin_service_pb2.Site(name=name))
        sessions[name] = SiteSession(name, probe_endpoint=checked)
        view = resources_pb2.SiteView(site=name, probe_endpoint="10.6.6.6:7400")
        sites.attach(sessions[name], pb.Hello(view=view))
    sites.announce_probe_peers()
    peers = {}
    for name, session in sessions.items():
        message = session.outbox.get_nowait()
        assert message is not None
        peers[name] = {p.site: p.endpoint for p in message.probe_peers.peers}
    assert peers["b"] == {"a": "10.0.0.1:7400", "c": "10.0.0.3:7400"}
    assert peers["a"] == {"c": "10.0.0.3:7400"}
