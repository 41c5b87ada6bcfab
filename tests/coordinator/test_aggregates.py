"""The coordinator's federation-wide gauges follow the views of the connected sites."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY

from federation.api.v1 import admin_service_pb2, resources_pb2
from federation.api.v1 import site_link_service_pb2 as pb
from federation.coordinator.sites import SiteRegistry, SiteSession
from federation.errors import FailedPreconditionError
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
