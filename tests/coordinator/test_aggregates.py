"""The coordinator's federation-wide gauges follow the views of the connected sites."""

from __future__ import annotations

import random
from typing import Any

import pytest
from prometheus_client import REGISTRY

from federation.api.v1 import admin_service_pb2, resources_pb2
from federation.api.v1 import site_link_service_pb2 as pb
from federation.coordinator.sites.registry import SiteRegistry, SiteSession
from federation.errors import FailedPreconditionError
from federation.metrics import AGGREGATES
from federation.store import SqliteStore

GPU, NPU = resources_pb2.DEVICE_KIND_GPU, resources_pb2.DEVICE_KIND_NPU
HEALTHY = resources_pb2.DEVICE_HEALTH_HEALTHY
UNHEALTHY = resources_pb2.DEVICE_HEALTH_UNHEALTHY


def reading(compute: float) -> resources_pb2.MeasuredUse:
    return resources_pb2.MeasuredUse(measured_at=1.7e9, compute=compute)


def gpu(index: int, **fields: Any) -> resources_pb2.Device:
    return resources_pb2.Device(id=str(index), index=index, kind=GPU, model="H100", **fields)


def dgx() -> resources_pb2.Node:
    """8 cores, 2 booked, CPU at 50%; an allocated GPU at 40%, a free one at 80% that is
    unhealthy, and one never measured."""
    return resources_pb2.Node(
        name="dgx",
        cpu_cores=8,
        cpu_free=6,
        measured=reading(0.5),
        devices=[
            gpu(0, health=HEALTHY, allocated=True, measured=reading(0.4)),
            gpu(1, health=UNHEALTHY, measured=reading(0.8)),
            gpu(2, health=HEALTHY),
        ],
    )


def edge_box() -> resources_pb2.Node:
    """24 cores never measured; a shareable GPU three quarters handed out, two declared NPUs."""
    npu = resources_pb2.Device(kind=NPU, model="Ascend-910B", health=HEALTHY)
    return resources_pb2.Node(
        name="box",
        cpu_cores=24,
        cpu_free=24,
        devices=[gpu(0, health=HEALTHY, shareable=True, free_fraction=0.25), npu, npu],
    )


def view(site: str, *nodes: resources_pb2.Node, pending: int = 0) -> resources_pb2.SiteView:
    queue = resources_pb2.QueueState(pending_tasks=pending, running_tasks=1, estimated_wait_s=4)
    return resources_pb2.SiteView(site=site, nodes=list(nodes), queue=queue)


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def device(model: str, state: str, kind: str = "GPU") -> float | None:
    return value("federation_devices", kind=kind, model=model, state=state)


@pytest.fixture
def sites(store: SqliteStore) -> SiteRegistry:
    registry = SiteRegistry(store, lambda: None)
    for name in ("dc", "edge"):
        registry.registered(admin_service_pb2.Site(name=name))
    return registry


def connect(sites: SiteRegistry, site_view: resources_pb2.SiteView) -> SiteSession:
    session = SiteSession(site_view.site)
    sites.attach(session, pb.Hello(view=site_view, generation=1))
    return session


def test_connected_views_add_up(sites: SiteRegistry) -> None:
    """Devices, their booking, health and measured use add up per kind and model and per
    site; CPU use counts the nodes with a reading only, weighted by cores."""
    connect(sites, view("dc", dgx(), pending=2))
    connect(sites, view("edge", edge_box()))
    assert device("H100", "total") == 4
    assert device("H100", "healthy") == 3
    assert device("H100", "booked") == pytest.approx(1.75)
    assert device("H100", "measured") == 2
    assert value("federation_device_utilization_mean", kind="GPU", model="H100") == (
        pytest.approx(0.6)
    )
    assert device("Ascend-910B", "total", kind="NPU") == 2
    assert value("federation_device_utilization_mean", kind="NPU", model="Ascend-910B") is None
    assert value("federation_cpu_cores", state="total") == 32
    assert value("federation_cpu_cores", state="booked") == 2
    assert value("federation_cpu_cores", state="measured") == 8
    assert value("federation_cpu_cores", state="used") == pytest.approx(4)
    assert value("federation_tasks", state="pending") == 2
    assert value("federation_tasks", state="running") == 2
    assert value("federation_site_devices", site="edge", state="total") == 3
    assert value("federation_site_devices", site="edge", state="booked") == pytest.approx(0.75)
    assert value("federation_site_device_utilization_mean", site="dc") == pytest.approx(0.6)
    assert value("federation_site_device_utilization_mean", site="edge") is None
    assert value("federation_site_cpu_utilization_mean", site="dc") == pytest.approx(0.5)
    assert value("federation_site_cpu_cores", site="edge", state="total") == 24
    assert value("federation_site_tasks", site="dc", state="pending") == 2
    assert value("federation_site_queue_wait_seconds", site="edge") == 4


def test_deltas_move_the_sums(sites: SiteRegistry) -> None:
    """A delta of the queue alone moves the task counts; upserted and removed nodes move the
    device sums; a delta out of order is refused and changes nothing."""
    connect(sites, view("dc", dgx()))
    connect(sites, view("edge", edge_box()))
    queue = resources_pb2.QueueState(pending_tasks=5, running_tasks=3)
    sites.apply_view(
        "dc",
        pb.ViewUpdate(generation=2, delta=resources_pb2.SiteViewDelta(queue=queue, has_queue=True)),
    )
    assert value("federation_tasks", state="pending") == 5
    assert value("federation_tasks", state="running") == 4
    assert device("H100", "total") == 4
    freed = dgx()
    freed.devices[0].allocated = False
    freed.devices[0].measured.compute = 0.0
    sites.apply_view(
        "dc", pb.ViewUpdate(generation=3, delta=resources_pb2.SiteViewDelta(upserted_nodes=[freed]))
    )
    assert device("H100", "booked") == pytest.approx(0.75)
    assert value("federation_device_utilization_mean", kind="GPU", model="H100") == (
        pytest.approx(0.4)
    )
    assert value("federation_tasks", state="pending") == 5  # the queue stays as it was
    with pytest.raises(FailedPreconditionError):
        sites.apply_view(
            "dc",
            pb.ViewUpdate(generation=9, delta=resources_pb2.SiteViewDelta(removed_nodes=["dgx"])),
        )
    assert device("H100", "total") == 4
    sites.apply_view(
        "edge",
        pb.ViewUpdate(generation=2, delta=resources_pb2.SiteViewDelta(removed_nodes=["box"])),
    )
    assert device("H100", "total") == 3
    assert device("Ascend-910B", "total", kind="NPU") is None
    assert value("federation_site_devices", site="edge", state="total") == 0
    assert value("federation_cpu_cores", state="total") == 8


def test_a_site_without_a_session_counts_no_longer(sites: SiteRegistry) -> None:
    """Once a site's session ends its series go and the sums drop it; with none left, no
    series remain but the federation's zero sums."""
    dc = connect(sites, view("dc", dgx()))
    edge = connect(sites, view("edge", edge_box()))
    sites.detach(edge)
    assert device("H100", "total") == 3
    assert device("Ascend-910B", "total", kind="NPU") is None
    assert value("federation_site_devices", site="edge", state="total") is None
    assert value("federation_site_tasks", site="edge", state="running") is None
    assert value("federation_tasks", state="running") == 1
    sites.detach(dc)
    assert device("H100", "total") is None
    assert value("federation_cpu_cores", state="total") == 0
    assert value("federation_cpu_cores", state="used") == 0
    assert value("federation_tasks", state="running") == 0
    connect(sites, view("dc", dgx()))  # and back
    assert device("H100", "total") == 3
    assert value("federation_site_cpu_cores", site="dc", state="booked") == 2


def test_a_new_registry_starts_from_nothing(sites: SiteRegistry, store: SqliteStore) -> None:
    """A new term's registry does not inherit the series of the one before."""
    connect(sites, view("dc", dgx()))
    SiteRegistry(store, lambda: None)
    assert device("H100", "total") is None
    assert value("federation_site_devices", site="dc", state="total") is None


def aggregate_samples() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the federation-wide gauges, by name and labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in AGGREGATES.collect()
        for sample in family.samples
    }


def random_node(rng: random.Random, name: str) -> resources_pb2.Node:
    """A node of a few devices of two models (or none), each booked, shared, measured and
    healthy or not at random, with figures that do not add up exactly in binary."""
    node = resources_pb2.Node(name=name, cpu_cores=rng.choice([0.1, 3, 7.3, 64]), schedulable=True)
    node.cpu_free = rng.uniform(0, node.cpu_cores)
    if rng.random() < 0.5:
        node.measured.CopyFrom(reading(rng.random()))
    for index in range(rng.choice([0, 2, 3])):
        device = resources_pb2.Device(
            id=str(index),
            index=index,
            kind=GPU,
            model=rng.choice(["H100", "L4"]),
            health=rng.choice([HEALTHY, UNHEALTHY, resources_pb2.DEVICE_HEALTH_UNSPECIFIED]),
            allocated=rng.random() < 0.3,
            shareable=rng.random() < 0.3,
            free_fraction=rng.choice([0.1, 0.3, 0.7, 1.0]),
        )
        if rng.random() < 0.5:
            device.measured.CopyFrom(reading(rng.random()))
        node.devices.append(device)
    return node


def test_deltas_keep_the_sums_a_recount_finds(sites: SiteRegistry, store: SqliteStore) -> None:
    """After hundreds of deltas (nodes changed, added and removed, one device or all of a
    node's, queues changed, a whole view, a site gone and back), every series is what a new
    registry finds from the same views counted whole: kept by difference, the sums neither
    drift nor keep what went."""
    rng = random.Random(7)
    sessions = {
        name: connect(sites, view(name, *(random_node(rng, f"{name}-{i}") for i in range(4))))
        for name in ("dc", "edge")
    }
    generation = dict.fromkeys(sessions, 1)
    for step in range(400):
        if step == 300:
            edge = sites.get("edge").view
            assert edge is not None
            sites.detach(sessions["edge"])
            assert value("federation_site_devices", site="edge", state="total") is None
            sessions["edge"] = connect(sites, edge.view())
            generation["edge"] = 1
        name = rng.choice(list(sessions))
        held = sites.get(name).view
        assert held is not None
        delta = resources_pb2.SiteViewDelta()
        nodes = [node.name for node in held.nodes()]
        roll = rng.random()
        if roll < 0.1 and nodes:
            delta.removed_nodes.append(rng.choice(nodes))
        elif roll < 0.2:
            delta.upserted_nodes.append(random_node(rng, f"{name}-{rng.randrange(8)}"))
        elif nodes:
            node = resources_pb2.Node()
            node.CopyFrom(held.node(rng.choice(nodes)))
            node.cpu_free = rng.uniform(0, node.cpu_cores)
            if node.devices:  # one device changes, the rest come again as they were
                device = rng.choice(node.devices)
                device.allocated = not device.allocated
                device.measured.compute = rng.random()
            delta.upserted_nodes.append(node)
        if rng.random() < 0.3:
            delta.has_queue = True
            delta.queue.pending_tasks = rng.randrange(5)
            delta.queue.running_tasks = rng.randrange(5)
            delta.queue.estimated_wait_s = rng.random()
        generation[name] += 1
        update = pb.ViewUpdate(generation=generation[name], delta=delta)
        if step == 200:
            update = pb.ViewUpdate(generation=generation[name], full=held.view())
            update.full.nodes.append(random_node(rng, f"{name}-whole"))
        sites.apply_view(name, update)
    kept = aggregate_samples()
    views = {name: sites.get(name).view for name in sessions}
    recount = SiteRegistry(store, lambda: None)
    for name, live in views.items():
        assert live is not None
        recount.registered(admin_service_pb2.Site(name=name))
        recount.attach(SiteSession(name), pb.Hello(view=live.view(), generation=1))
    found = aggregate_samples()
    assert kept.keys() == found.keys()
    for key, counted in found.items():
        assert kept[key] == pytest.approx(counted, rel=1e-9, abs=1e-9), key
